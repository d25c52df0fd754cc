"""What machine this is: for reports and model cards, and for choosing the default dtype."""
from __future__ import annotations

import functools
import platform
from pathlib import Path

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""x86 CPU flags (as /proc/cpuinfo spells them) of native bfloat16 dot products."""


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, or what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU computes bfloat16 dot products natively (avx512_bf16 or AMX) and oneDNN can use them:
    there bfloat16 decoding reads half the bytes of float32 at full speed. Elsewhere bfloat16 is emulated
    and slower than float32."""
    import torch

    flags = cpu_flags() if flags is None else flags
    return bool(flags & set(NATIVE_BF16_FLAGS)) and torch.backends.mkldnn.is_available()


def available_memory() -> int | None:
    """Bytes of memory this process could still take now: the kernel's MemAvailable, capped by the cgroup's
    limit where one is set (a container). None where neither can be read (e.g. macOS)."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            room = max(0, int(limit) - used)
            available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    return available


def return_free_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim): loading leaves hundreds of MB of
    freed requantization and packing buffers in the heap (the pair: 0.6 GB of a 2.6 GB process), which would
    otherwise count as resident for the process's whole life. A no-op without glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is not None:
        trim(0)
