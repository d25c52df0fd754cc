"""The packed matrices of a kept-quantized GGUF, kept in the specdecode cache so that a start maps them instead of
packing them again.

The kernels read a matrix in their own layout (quant.cpp's `pack`: 16 rows interleaved), made from the GGUF's rows
at load; a draft's heavier matrices are also requantized to Q4_0 first (quant.py's `lighten`). For the default pair
that is ~3 s of a start on two cores and ~0.2 GB of requantized rows held beside their packed copies. So the first
start writes what its models' kernels read into one safetensors file per GGUF, and later starts memory-map it: the
pages come from the page cache (shared by every process serving the same file, dropped and read again under memory
pressure) and nothing is packed.

A stored file is used only while it is this GGUF's, packed by these kernels: its name carries the kernels' build key
(their sources, the compiler flags, this CPU's instruction sets: kernels.build_key), its metadata the GGUF's size and
mtime (a GGUF replaced or touched is packed again) and the format version; each packed matrix's header is checked
by the kernels at every product (magic, format, shape, size), so a truncated file is never read past its end; it is
written under a temporary name and renamed into place. Anything found invalid is packed again.
"""
from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import struct
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import torch

STORE_VERSION = "1"
"""Format of the stored files; bump it when what is stored under a name changes."""
SMALLEST = 32 * 2**20
"""GGUFs smaller than this are packed at every start (a fraction of a second) and never stored."""
KEEP_FREE = 2 * 2**30
"""A stored file is not written where it would leave less free disk than this."""


class PackedStore:
    """The stored tensors of one GGUF: `get(name, make)` answers from the file's map when it holds `name`, else
    makes it (and remembers it); `save(names)` writes the file once something had to be made."""

    def __init__(self, gguf_path: Path):
        from specdecode.catalog.registry import cache_dir
        from specdecode.kernels import build_key

        gguf_path = Path(os.path.abspath(gguf_path))
        self.gguf_path = gguf_path
        digest = hashlib.sha256(str(gguf_path).encode()).hexdigest()[:16]
        self.folder = cache_dir() / "packed"
        self.prefix = f"{gguf_path.stem}-{digest}-"
        self.path = self.folder / f"{self.prefix}{build_key()}.safetensors"
        self.enabled = gguf_path.stat().st_size >= SMALLEST
        self.mapped = self._map() if self.enabled else {}
        self.made: dict[str, torch.Tensor] = {}

    def get(self, name: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        tensor = self.mapped.get(name)
        if tensor is None:
            tensor = self.made.get(name)
        if tensor is None:
            tensor = self.made[name] = make().contiguous()
        return tensor

    def save(self, names: list[str]) -> None:
        """Write the tensors `names` (each got before) when one of them was made in this process, not mapped."""
        if not self.enabled or all(name in self.mapped for name in names):
            self.made.clear()
            return
        # (mapped tensors are views of one buffer, which safetensors refuses to write: copies of them)
        state = {name: self.mapped[name].clone() if name in self.mapped else self.made[name] for name in names}
        stat = self.gguf_path.stat()
        metadata = {"specdecode.packed": STORE_VERSION, "gguf.size": str(stat.st_size),
                    "gguf.mtime_ns": str(stat.st_mtime_ns)}
        if _write(self.path, state, metadata):
            for old in self.folder.glob(self.prefix + "*.safetensors"):  # (other kernels' builds)
                if old != self.path:
                    old.unlink(missing_ok=True)
            self.mapped = self._map()  # (a later load in this process maps what was just written)
        self.made.clear()

    def _map(self) -> dict[str, torch.Tensor]:
        try:
            return _map_file(self.path, self.gguf_path)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError) as exc:
            print(f"specdecode: the packed weights in {self.path} are not usable ({exc}); packing again",
                  file=sys.stderr, flush=True)
            return {}


def keep_packed(model: torch.nn.Module, store: PackedStore) -> None:
    """Pack (or map) every matrix `model` reads now, and write the store when some were packed here: call it once
    the model is as it will run (a draft after its head and its matrices changed), so that what was replaced is
    neither packed nor kept."""
    from specdecode.model.quant import QuantLinear

    names = []
    for module in model.modules():
        if isinstance(module, QuantLinear) and module.stored:
            module.packed  # noqa: B018 (packs, or maps, every part)
            names += module.stored
    store.save(list(dict.fromkeys(names)))


@functools.lru_cache(maxsize=None)
def store_for(gguf_path: Path) -> PackedStore:
    """The one store of a GGUF in this process (its loads and its draft's requantization share it)."""
    return PackedStore(gguf_path)


DTYPES = {"U8": torch.uint8}


def _map_file(path: Path, gguf_path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a stored file, as views of a read-only map of it whose pages are mapped now (MAP_POPULATE,
    where there is one: the first product then finds them, and the resident size counts them from the start)."""
    with open(path, "rb") as f:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        whole = mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
    (size,) = struct.unpack_from("<Q", whole, 0)
    header = json.loads(whole[8:8 + size])
    metadata = header.pop("__metadata__", {})
    stat = gguf_path.stat()
    if metadata.get("specdecode.packed") != STORE_VERSION:
        raise ValueError("written by another version of specdecode")
    if metadata.get("gguf.size") != str(stat.st_size) or metadata.get("gguf.mtime_ns") != str(stat.st_mtime_ns):
        raise ValueError(f"{gguf_path.name} changed since they were packed")
    with warnings.catch_warnings():  # (torch warns that the buffer is read-only: the kernels only read it)
        warnings.simplefilter("ignore", UserWarning)
        data = torch.frombuffer(whole, dtype=torch.uint8)  # (the tensor keeps the map alive)
    start = 8 + size
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        if info["dtype"] not in DTYPES or start + end > len(whole) or end < begin:
            raise ValueError(f"tensor {name} lies outside the file")
        tensors[name] = data[start + begin:start + end].view(DTYPES[info["dtype"]]).view(info["shape"])
    return tensors


def _write(path: Path, state: dict[str, torch.Tensor], metadata: dict[str, str]) -> bool:
    """Write the file (temporary name, then rename); False, saying why, where it cannot be written."""
    from safetensors.torch import save_file

    size = sum(t.numel() * t.element_size() for t in state.values())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        free = os.statvfs(path.parent)
        if free.f_bavail * free.f_frsize < size + KEEP_FREE:
            raise OSError(f"{size / 2**30:.1f} GiB would leave less than {KEEP_FREE / 2**30:.0f} GiB free")
        fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        os.close(fd)
        try:
            save_file(state, partial, metadata=metadata)
            os.replace(partial, path)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
        return True
    except OSError as exc:
        print(f"specdecode: could not keep the packed weights in {path.parent} ({exc}); the next start packs them "
              "again", file=sys.stderr, flush=True)
        return False
