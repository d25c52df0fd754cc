"""specdecode's own CPU kernels (C++), compiled for this machine on first use, as llama.cpp is (-march=native).

`quant()` returns the compiled module of quant.cpp (matrix products with block-quantized weights) and layer.cpp
(a whole decoder layer per call), or None where it cannot be built (no C++ compiler, no ninja, a failed build):
callers then keep dequantized weights, which is correct and slower, and `failure()` says why, naming the compiler's
first errors (the test suite fails with it: tests/compiled.py). The build lands in the cache
(~/.cache/specdecode/kernels, $SPECDECODE_CACHE/kernels, or $SPECDECODE_KERNELS_DIR), keyed by the sources, the
torch and Python versions and this CPU's instruction sets, so it happens once per machine (60-80 s on a 2-core AMD
EPYC) and later processes load it in milliseconds.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
from pathlib import Path

SOURCES = [Path(__file__).with_name(name)
           for name in ("quant.cpp", "layer.cpp", "attention.cpp", "race.cpp", "quant.h", "vec.h")]
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
"""Compiler flags: this CPU's instruction sets, no fused multiply-adds the source does not write (so that a
number is computed the same way in every tiling, see quant.cpp), and OpenMP: at::parallel_for is a header
template that splits work over torch's threads only when the extension itself is built with it (without it, every
product ran on one thread whatever torch.set_num_threads said)."""

_failure: str | None = None


def cache_dir() -> Path:
    """$SPECDECODE_KERNELS_DIR, else the kernels folder of specdecode's cache ($SPECDECODE_CACHE, as the models)."""
    root = os.environ.get("SPECDECODE_KERNELS_DIR")
    if root:
        return Path(root)
    cache = os.environ.get("SPECDECODE_CACHE")
    if cache:
        return Path(cache) / "kernels"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdecode" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def build_key() -> str:
    import torch
    digest = hashlib.sha256()
    parts = [path.read_bytes() for path in SOURCES]
    parts += [torch.__version__.encode(), _cpu_flags().encode(), " ".join(FLAGS).encode(), sys.version.encode()]
    for part in parts:
        digest.update(part)
    return digest.hexdigest()[:16]


@functools.cache
def quant():
    """The compiled quant.cpp module, or None (then `failure()` says why)."""
    global _failure
    import torch  # noqa: F401  (the extension links against the loaded torch)

    name = f"specdecode_quant_{build_key()}"
    folder = cache_dir() / name
    built = folder / f"{name}.so"
    if built.is_file():  # built before: import it directly (~10 ms; cpp_extension.load re-runs ninja, ~2 s)
        try:
            spec = importlib.util.spec_from_file_location(name, built)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        except ImportError:  # a damaged build: build again below
            pass
    from torch.utils import cpp_extension

    print("specdecode: compiling the quantized CPU kernels for this machine (once, about a minute) ...",
          file=sys.stderr, flush=True)
    saved_path = os.environ.get("PATH", "")
    # ninja comes with the package (a dependency) into this interpreter's bin folder, which need not be on PATH
    os.environ["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), saved_path))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        sources = [str(path) for path in SOURCES if path.suffix == ".cpp"]
        return cpp_extension.load(name=name, sources=sources, extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(folder),
                                  verbose=False)
    except (OSError, RuntimeError, ImportError, SystemExit) as error:  # no compiler, no ninja, a failed build
        _failure = describe(error)
        return None
    finally:
        os.environ["PATH"] = saved_path


def describe(error: BaseException) -> str:
    """One line for a failed build: the compiler's first errors (a build's message is the whole of ninja's output,
    whose last line says only that it stopped), else the message's last line."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line or "Error:" in line][:3]
    return f"{type(error).__name__}: {' | '.join(errors or lines[-1:]) or 'no message'}"


def failure() -> str | None:
    """Why quant() returned None (after it did), else None."""
    return _failure
