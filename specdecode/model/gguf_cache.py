"""The converted copy of a GGUF checkpoint loaded with float weights (quantization none), kept in the specdecode
cache (never beside the user's file) so that only the first start pays for the GGUF. A kept-quantized load (the
default on CPUs) writes nothing: it uses the GGUF's matrices from its memory map (loading.read_quantized_gguf).

Parsing a GGUF's metadata and dequantising its tensors takes seconds (most of a start, for SmolLM2); so the first
load of a GGUF in a dtype writes one safetensors file of the dequantised weights under their HF names, with the
model config and the tokenizer (tokenizer.json and its special tokens, chat template) in its metadata. Later
loads memory-map that file and never parse the GGUF again.

A converted file is used only while it is provably this GGUF's, converted by this version of the conversion:
- it records the GGUF's size, mtime and sha256. A start compares size and mtime (a stat: hashing a 4 GB GGUF
  at every start would cost seconds) and re-hashes the GGUF only when the mtime changed (a copy, a touch): the
  same bytes keep the conversion, other bytes are converted again;
- crc32 checksums of its metadata and of its tensors are verified at every load (~0.05 s for 270 MB), so a
  truncated or damaged file is converted again, never used;
- it is written to a temporary name and renamed into place, so an interrupted conversion leaves no file under
  the name that is read.
Anything found invalid is converted again, saying why on stderr.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer

from specdecode.errors import ConfigError
from specdecode.model.config import ModelConfig
from specdecode.model.gguf import gguf_config, gguf_state_dict, open_gguf
from specdecode.model.gguf_tokenizer import GGUFTokenizerSpec, build_gguf_tokenizer
from specdecode.catalog.registry import cache_dir, sha256_file

CACHE_VERSION = "2"
"""Format of the converted files; bump it when the conversion's output changes (names, q/k order, metadata) so
that files written before are converted again."""
KEEP_FREE = 2 * 2**30
"""A converted file is not written where it would leave less free disk than this."""
SUFFIX = ".specdecode-{dtype}.safetensors"
"""What follows the GGUF's stem in a converted file's name."""


class InvalidCache(Exception):
    """A converted file that must not be used; the message says why (shown before converting again)."""


def cache_folders(gguf_path: Path) -> list[Path]:
    """Where the converted files of a GGUF are: in the specdecode cache, in a folder named by a digest of the
    GGUF's full path (never beside the user's file)."""
    return [cache_dir() / "converted" / hashlib.sha256(str(gguf_path).encode()).hexdigest()[:16]]


def cache_locations(gguf_path: Path, dtype: str) -> list[Path]:
    """The places of the converted file of a GGUF in `dtype` (a name: "bfloat16"), in the order they are tried."""
    return [folder / (gguf_path.stem + SUFFIX.format(dtype=dtype)) for folder in cache_folders(gguf_path)]


def read_gguf(gguf_path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and the weights (HF names, in `dtype`) of a GGUF: from its converted file when one is valid,
    else dequantised from the GGUF now and written for the next start. (Kept-quantized loads read the GGUF itself:
    loading.read_quantized_gguf.)"""
    gguf_path = _absolute(gguf_path)
    dtype_name = str(dtype).removeprefix("torch.")
    problems = []
    for path in cache_locations(gguf_path, dtype_name):
        if not path.is_file():
            continue
        try:
            metadata, state = _read_weights(path, gguf_path, dtype_name)
        except InvalidCache as exc:
            problems.append(f"{path.name} {exc}")
            continue
        stat = gguf_path.stat()
        if metadata["gguf.mtime_ns"] != str(stat.st_mtime_ns):  # the same bytes, copied or touched: note the
            metadata["gguf.mtime_ns"] = str(stat.st_mtime_ns)  # new time, so the next start need not re-hash
            _write([path], state, _sealed(metadata), stat.st_mode)
        return _config(metadata), state
    why = f"again: {problems[0]}" if problems else "once; later starts read the converted file"
    print(f"specdecode: converting {gguf_path.name} to {dtype_name} ({why}) ...", file=sys.stderr, flush=True)
    return _convert(gguf_path, dtype, dtype_name)


def gguf_model_config(gguf_path: Path) -> ModelConfig:
    """A GGUF's model config, from any valid converted file of it (the GGUF is parsed when there is none)."""
    metadata = _cached_metadata(_absolute(gguf_path))
    return _config(metadata) if metadata is not None else gguf_config(open_gguf(gguf_path))


def gguf_tokenizer_spec(gguf_path: Path) -> GGUFTokenizerSpec:
    """A GGUF's tokenizer, from any valid converted file of it (built from the GGUF when there is none)."""
    metadata = _cached_metadata(_absolute(gguf_path))
    if metadata is None or "tokenizer.json" not in metadata:
        return build_gguf_tokenizer(open_gguf(gguf_path))
    return GGUFTokenizerSpec(backend=HFTokenizer.from_str(metadata["tokenizer.json"]),
                             **json.loads(metadata["tokenizer.spec"]))


# -- conversion -------------------------------------------------------------------------------------------------


def _convert(gguf_path: Path, dtype: torch.dtype, dtype_name: str) -> tuple[ModelConfig, dict]:
    stat = gguf_path.stat()  # before reading: a GGUF replaced meanwhile then reads as changed at the next start
    ckpt = open_gguf(gguf_path)
    config = gguf_config(ckpt)
    loaded = gguf_state_dict(ckpt, config, dtype)
    state = {name: value.contiguous() for name, value in loaded.items()}
    metadata = {"format": "pt", "specdecode.cache": CACHE_VERSION, "dtype": dtype_name,
                "gguf.size": str(stat.st_size), "gguf.mtime_ns": str(stat.st_mtime_ns),
                "gguf.sha256": sha256_file(gguf_path), "config": json.dumps(dataclasses.asdict(config))}
    try:
        spec = build_gguf_tokenizer(ckpt)
    except ConfigError:  # a tokenizer we cannot build: Tokenizer() reports it, from the GGUF
        spec = None
    if spec is not None:
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "backend"}
        metadata.update({"tokenizer.json": spec.backend.to_str(), "tokenizer.spec": json.dumps(fields)})
    metadata["crc32.tensors"] = _tensors_crc(state)
    _write(cache_locations(gguf_path, dtype_name), state, _sealed(metadata), stat.st_mode)
    return config, loaded


def _write(paths: list[Path], state: dict[str, torch.Tensor], metadata: dict[str, str], mode: int) -> None:
    """Write the converted file at the first of `paths` that can take it (temporary file, then rename), readable
    by whom the GGUF (of st_mode `mode`) is readable."""
    failures = []
    size = sum(t.numel() * t.element_size() for t in state.values())
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(path.parent).free
            if free < size + KEEP_FREE:
                failures.append(f"{path.parent}: {size / 2**30:.1f} GiB would leave less than "
                                f"{KEEP_FREE / 2**30:.0f} GiB of its {free / 2**30:.1f} GiB free")
                continue
            fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        except OSError as exc:  # a read-only folder: try the next place
            failures.append(f"{path.parent}: {exc.strerror or exc}")
            continue
        os.close(fd)
        try:
            save_file(state, partial, metadata=metadata)
            os.chmod(partial, mode & 0o666)  # (safetensors writes it private)
            os.replace(partial, path)
            return
        except OSError as exc:  # a full disk...
            failures.append(f"{path.parent}: {exc.strerror or exc}")
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    print(f"specdecode: could not keep the converted weights ({'; '.join(failures)}); the next start converts "
          "again", file=sys.stderr, flush=True)


# -- verification -----------------------------------------------------------------------------------------------


def _read_weights(path: Path, gguf_path: Path, dtype: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    metadata = _checked_metadata(path, gguf_path)
    if metadata.get("dtype") != dtype:
        raise InvalidCache(f"holds {metadata.get('dtype')} weights, not {dtype}")
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise InvalidCache(f"is unreadable ({exc})") from exc
    if _tensors_crc(state) != metadata.get("crc32.tensors"):
        raise InvalidCache("is damaged (its weights fail their checksum)")
    return metadata, state


def _checked_metadata(path: Path, gguf_path: Path) -> dict[str, str]:
    """The metadata of converted file `path` if it is a conversion of the GGUF as it is now, else InvalidCache."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as exc:
        raise InvalidCache(f"is unreadable ({exc})") from exc
    if metadata.get("specdecode.cache") != CACHE_VERSION:
        raise InvalidCache("was written by another version of specdecode")
    if metadata.get("crc32.metadata") != _metadata_crc(metadata):
        raise InvalidCache("is damaged (its metadata fails its checksum)")
    stat = gguf_path.stat()
    if metadata.get("gguf.size") != str(stat.st_size) or (metadata.get("gguf.mtime_ns") != str(stat.st_mtime_ns)
                                                           and sha256_file(gguf_path) != metadata.get("gguf.sha256")):
        raise InvalidCache(f"is stale ({gguf_path.name} changed since it was converted)")
    try:
        _config(metadata)
    except (KeyError, TypeError, ValueError, ConfigError) as exc:
        raise InvalidCache(f"holds a config this version cannot read ({exc!r})") from exc
    return metadata


def _cached_metadata(gguf_path: Path) -> dict[str, str] | None:
    """The metadata of the first valid converted file of the GGUF, in any dtype (None when there is none)."""
    for folder in cache_folders(gguf_path):
        for path in sorted(folder.glob(glob.escape(gguf_path.stem) + SUFFIX.format(dtype="*"))):
            try:
                return _checked_metadata(path, gguf_path)
            except InvalidCache:
                continue
    return None


def _absolute(path: Path) -> Path:
    """The path made absolute, its symbolic links kept: the converted file is named by the name the user gave
    (a Hugging Face cache links snapshot names to blobs named by hash)."""
    return Path(os.path.abspath(path))


def _config(metadata: dict[str, str]) -> ModelConfig:
    return ModelConfig(**json.loads(metadata["config"]))


def _sealed(metadata: dict[str, str]) -> dict[str, str]:
    """`metadata` with the checksum of the rest of it."""
    return {**metadata, "crc32.metadata": _metadata_crc(metadata)}


def _metadata_crc(metadata: dict[str, str]) -> str:
    rest = {k: v for k, v in metadata.items() if k != "crc32.metadata"}
    return f"{zlib.crc32(json.dumps(rest, sort_keys=True).encode()):08x}"


def _tensors_crc(state: dict[str, torch.Tensor]) -> str:
    """crc32 of every tensor's name, dtype, shape and bytes, in name order."""
    crc = 0
    for name in sorted(state):
        tensor = state[name]
        crc = zlib.crc32(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode(), crc)
        crc = zlib.crc32(tensor.contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"
