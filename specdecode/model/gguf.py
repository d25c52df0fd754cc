"""GGUF checkpoints (llama.cpp's single-file format): the model config from the metadata, and the weights
dequantised and renamed to the Hugging Face names that the loader already checks.

Read with the `gguf` package (llama.cpp's own reader). GGUF converters permute the rows of llama attention
q/k weights for llama.cpp's interleaved rotary; that is undone here, so the tensors equal the HF checkpoint's.
"""
from __future__ import annotations

import dataclasses
import functools
import mmap
import re
import struct
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

from specdecode.errors import CheckpointError, ConfigError
from specdecode.model.config import ModelConfig

GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
"""GGUF general.architecture -> our model_type. Mistral GGUFs are written as llama."""
PERMUTED_QK_ARCHITECTURES = ("llama",)
"""Architectures whose q/k rows the converter permuted (llama.cpp's non-NeoX rotary)."""
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
                          "Q2_K", "Q3_K")
"""Tensor types dequantised at load (all through gguf.quants)."""

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
DERIVED_TENSORS = ("rope_freqs.weight",)
"""Tensors that the config already describes (read by gguf_config), not weights."""
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
GGUF_MAGIC = b"GGUF"


def is_gguf_file(path: Path) -> bool:
    if not path.is_file():
        return False
    if path.suffix == ".gguf":
        return True
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file that `path` names: the file itself, or the only *.gguf in a directory without a
    config.json. None when `path` is a Hugging Face directory (or does not exist)."""
    path = Path(path)
    if path.is_file():
        if is_gguf_file(path):
            return path
        raise CheckpointError(f"{path} is a file but not a GGUF checkpoint; pass a .gguf file or a Hugging Face "
                              "directory (config.json + model.safetensors)")
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:4])
        raise CheckpointError(f"{path} holds {len(found)} GGUF files ({names}); pass the one to load as --model FILE")
    return found[0] if found else None


def transformers_source(path: str | Path) -> tuple[str, dict]:
    """(pretrained_model_name_or_path, extra kwargs) for transformers' from_pretrained on one of our checkpoint
    paths: a GGUF becomes (its directory, {"gguf_file": its name}); a HF directory is passed as is."""
    gguf_path = find_gguf(path)
    if gguf_path is None:
        return str(path), {}
    return str(gguf_path.parent), {"gguf_file": gguf_path.name}


class GGUFCheckpoint:
    """One opened GGUF file: metadata values and tensors (views of the file's memory map, read lazily)."""

    def __init__(self, path: Path):
        self.path = path
        truncated = truncation(path)  # before the reader, whose errors on a short file are numpy's
        if truncated is not None:
            raise CheckpointError(truncated)
        try:
            self.reader = GGUFFile(path)
        except Exception as exc:  # ValueError, KeyError, IndexError, struct.error... on a damaged file
            raise CheckpointError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}); it is "
                                  "corrupt: download it again") from exc
        self.architecture = self.get("general.architecture")
        if self.architecture not in GGUF_ARCHITECTURES:
            raise ConfigError(f"{path}: GGUF architecture {self.architecture!r} is not supported; specdecode "
                              f"supports {', '.join(GGUF_ARCHITECTURES)} (Mistral as llama)")

    def get(self, key: str, default=None):
        return self.reader.fields.get(key, default)

    def arch(self, key: str, default=None):
        """A metadata value under this file's architecture prefix, e.g. arch('block_count')."""
        return self.get(f"{self.architecture}.{key}", default)


@dataclasses.dataclass
class GGUFTensor:
    """One tensor of a GGUF file, as gguf.GGUFReader describes it: `shape` in GGUF's order (row length first) and
    `data` a view of the memory map in PyTorch's order ([rows, bytes] for block types)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: object
    """A gguf.GGMLQuantizationType."""
    data: np.ndarray


class GGUFFile:
    """A GGUF file's metadata (`fields`: key -> value as Python values) and tensors (`tensors`), read by one walk of
    its header. gguf.GGUFReader, which builds a memory-mapped array per metadata item, took ~6 s on the 152k-token
    vocabulary and merges of a Qwen2.5 file; this takes ~0.3 s and gives the same values and tensor views."""

    _SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    _ARRAYS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
               7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
    _PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
              "I32": np.int32, "I64": np.int64}

    def __init__(self, path: Path):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        data = self._map
        if data[:4] != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        self._pos = 8
        if struct.unpack_from("<I", data, 4)[0] & 0xFFFF == 0:
            raise ValueError("big-endian GGUF files are not supported")
        tensor_count, kv_count = self._number("Q"), self._number("Q")
        self.fields = {}
        for _ in range(kv_count):
            key = self._string()
            self.fields[key] = self._value(self._number("I"))
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            dims = tuple(self._number("Q") for _ in range(self._number("I")))
            infos.append((name, dims, GGMLQuantizationType(self._number("I")), self._number("Q")))
        alignment = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // alignment) * alignment
        self.tensors = []
        for name, dims, kind, offset in infos:
            elements = int(np.prod(dims)) if dims else 1
            shape = list(reversed(dims))
            if kind.name in self._PLAIN:
                dtype, count = self._PLAIN[kind.name], elements
            else:  # block types (and BF16): bytes, the last dimension counted in bytes
                block, size = GGML_QUANT_SIZES[kind]
                dtype, count = np.uint8, elements // block * size
                shape[-1] = shape[-1] // block * size
            array = np.frombuffer(data, dtype=dtype, count=count, offset=start + offset).reshape(shape)
            self.tensors.append(GGUFTensor(name, dims, kind, array))

    def release_pages(self) -> None:
        """Drop this process's resident pages of the map (they come back from the page cache when read again)."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def _number(self, kind: str):
        value = struct.unpack_from("<" + kind, self._map, self._pos)[0]
        self._pos += struct.calcsize(kind)
        return value

    def _string(self) -> str:
        size = self._number("Q")
        self._pos += size
        return self._map[self._pos - size:self._pos].decode("utf-8", errors="replace")

    def _value(self, kind: int):
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._number("I"), self._number("Q")
            if item == _STRING:  # (a vocabulary: 150k strings, in one tight loop)
                strings, data, pos, length = [], self._map, self._pos, _U64.unpack_from
                for _ in range(count):
                    size = length(data, pos)[0]
                    strings.append(data[pos + 8:pos + 8 + size].decode("utf-8", errors="replace"))
                    pos += 8 + size
                self._pos = pos
                return strings
            if item == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            values = np.frombuffer(self._map, dtype=self._ARRAYS[item], count=count, offset=self._pos)
            self._pos += values.nbytes
            return values.tolist()
        return self._number(self._SCALARS[kind])


_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""Bytes of each fixed-size GGUF metadata value type (gguf.GGUFValueType); 8 is a string, 9 an array."""
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_U64 = struct.Struct("<Q")


class _HeaderCut(Exception):
    """The header runs past the end of the file; `needed` is the end of the item that did not fit."""

    def __init__(self, needed: int):
        self.needed = needed


def described_size(path: Path) -> int:
    """The size in bytes that a GGUF file's own header describes: the end of its last tensor's data.

    Walks the header (metadata values are skipped, not decoded). Raises _HeaderCut when the file ends inside
    the header, and ValueError/KeyError/struct.error when the bytes are not a GGUF header."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    size = path.stat().st_size
    with open(path, "rb") as f:
        if not GGUF_MAGIC.startswith(f.read(4)):
            raise ValueError("GGUF magic invalid")
    if size < 24:  # magic, version, tensor and metadata counts
        raise _HeaderCut(24)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        order = ">" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF == 0 else "<"  # a big-endian file
        pos = 8

        def take(n: int) -> int:
            nonlocal pos
            pos += n
            if pos > size:
                raise _HeaderCut(pos)
            return pos - n

        def number(kind: str) -> int:
            return struct.unpack_from(order + kind, data, take(struct.calcsize(kind)))[0]

        def skip_value(kind: int) -> None:
            if kind == _STRING:
                take(number("Q"))
            elif kind == _ARRAY:
                item, count = number("I"), number("Q")
                if item == _STRING:  # (a vocabulary: only the lengths are read, in one tight loop)
                    nonlocal pos
                    length = struct.Struct(order + "Q").unpack_from
                    for _ in range(count):
                        if pos + 8 > size:
                            raise _HeaderCut(pos + 8)
                        pos += 8 + length(data, pos)[0]
                    if pos > size:
                        raise _HeaderCut(pos)
                elif item == _ARRAY:
                    for _ in range(count):
                        skip_value(item)
                else:
                    take(count * _VALUE_SIZES[item])
            else:
                take(_VALUE_SIZES[kind])

        tensor_count, kv_count = number("Q"), number("Q")
        alignment = 32
        for _ in range(kv_count):
            key_start = take(number("Q"))
            key, kind = data[key_start:pos], number("I")
            if key == b"general.alignment" and kind == _UINT32:
                alignment = number("I")
            else:
                skip_value(kind)
        end = 0
        for _ in range(tensor_count):
            take(number("Q"))  # the name
            dims = [number("Q") for _ in range(number("I"))]
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(number("I"))]
            elements = 1
            for d in dims:
                elements *= d
            end = max(end, number("Q") + elements // block * block_bytes)
        data_start = -(-pos // alignment) * alignment
        return data_start + end


def truncation(path: Path) -> str | None:
    """What is missing from a GGUF file that ends before what its header describes (one line), or None when it
    is complete or not a GGUF layout at all (the reader then says what is wrong)."""
    size = path.stat().st_size
    try:
        needed = described_size(path)
    except _HeaderCut as cut:
        return (f"{path} is truncated: it ends inside its header, which needs at least {cut.needed:,} bytes, the "
                f"file has {size:,} (at least {cut.needed - size:,} missing); download it again")
    except (ValueError, KeyError, struct.error, OverflowError):
        return None
    if needed <= size:
        return None
    return (f"{path} is truncated: its header describes {needed:,} bytes, the file has {size:,} "
            f"({needed - size:,} missing); download it again")


def same_gguf_tokenizer(a: str | Path | None, b: str | Path | None) -> bool:
    """Whether two checkpoints are GGUFs with the same tokenizer: every `tokenizer.ggml.*` field (tokens, their
    types, merges, special token ids, pre-tokenizer) equal. Then a draft needs no token-by-token comparison with
    its target (compat.py's, which builds the draft's tokenizer: ~0.7 s for Qwen2.5's 152k tokens)."""
    files = [find_gguf(path) if path is not None else None for path in (a, b)]
    if None in files:
        return False
    fields = [{k: v for k, v in open_gguf(f).reader.fields.items() if k.startswith("tokenizer.ggml.")}
              for f in files]
    return bool(fields[0]) and fields[0] == fields[1]


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFCheckpoint:
    return GGUFCheckpoint(Path(path))


def release_pages(path: str | Path) -> None:
    """Drop this process's resident pages of a GGUF's memory map (after its matrices were packed: the kernels read
    the packed copies, and the few pages read again - embedding rows - come back from the page cache). Without it the
    resident size counts the file twice (the 1.5B: ~2.2 GB after loading instead of ~1.2)."""
    open_gguf(path).reader.release_pages()


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open (once: the model and its tokenizer share the parse, which takes seconds for a large vocabulary)."""
    path = Path(path).resolve()
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    stat = path.stat()
    return _open_cached(str(path), stat.st_mtime_ns, stat.st_size)


def gguf_config(ckpt: GGUFCheckpoint) -> ModelConfig:
    """The ModelConfig that the metadata describes (same rules as a config.json with that model_type)."""
    tensor_names = {t.name for t in ckpt.reader.tensors}
    heads = ckpt.arch("attention.head_count")
    hidden = ckpt.arch("embedding_length")
    embed = next((t for t in ckpt.reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise CheckpointError(f"{ckpt.path} has no token_embd.weight tensor; it is not a decoder checkpoint")
    head_dim = ckpt.arch("attention.key_length") or (hidden // heads if heads else None)
    rope_dim = ckpt.arch("rope.dimension_count")
    if rope_dim is not None and head_dim is not None and rope_dim != head_dim:
        raise ConfigError(f"{ckpt.path}: partial rotary (rope.dimension_count {rope_dim} < head_dim {head_dim}) "
                          "is not supported")
    scaling = ckpt.arch("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ConfigError(f"{ckpt.path}: rope scaling {scaling!r} in a GGUF is not supported; use the model's "
                          "Hugging Face checkpoint")
    eos = [i for i in (ckpt.get("tokenizer.ggml.eos_token_id"), ckpt.get("tokenizer.ggml.eot_token_id"))
           if i is not None]
    raw = {
        "model_type": GGUF_ARCHITECTURES[ckpt.architecture],
        "vocab_size": int(embed.shape[1]),
        "hidden_size": hidden,
        "intermediate_size": ckpt.arch("feed_forward_length"),
        "num_hidden_layers": ckpt.arch("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": ckpt.arch("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": ckpt.arch("context_length", 2048),
        "rms_norm_eps": float(ckpt.arch("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(ckpt.arch("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": ckpt.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": sorted(set(eos)) or None,
    }
    rope_freqs = next((t for t in ckpt.reader.tensors if t.name == "rope_freqs.weight"), None)
    try:
        if rope_freqs is not None:
            raw["rope_scaling"] = _llama3_scaling(raw, dequantize(rope_freqs, ckpt.path))
        config = ModelConfig.from_dict(raw)
    except (ConfigError, TypeError) as exc:
        raise ConfigError(f"{ckpt.path}: its metadata does not describe a supported model ({exc})") from exc
    if ckpt.architecture == "llama" and any(n.endswith("attn_q.bias") for n in tensor_names):
        config.attention_bias = True
    return config


def _llama3_scaling(raw: dict, rope_freqs: np.ndarray) -> dict:
    """The Llama 3.1+ rope_scaling that llama.cpp's converter turned into `rope_freqs` (base / scaled frequency
    per rotary pair); the converter drops the parameters, so Meta's (low 1, high 4, 8192 tokens) are checked."""
    scaling = {"rope_type": "llama3", "factor": float(rope_freqs.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    plain = ModelConfig.from_dict(raw)
    scaled = ModelConfig.from_dict({**raw, "rope_scaling": scaling})
    implied = (plain.inv_freq() / scaled.inv_freq()).numpy()
    if implied.shape != rope_freqs.shape or not np.allclose(implied, rope_freqs, rtol=1e-3):
        raise ConfigError("its rope_freqs tensor is not Llama 3 rope scaling with the usual parameters; this rope "
                          "scaling is not supported, use the model's Hugging Face checkpoint")
    return scaling


def hf_name(gguf_name: str) -> str | None:
    """Our (Hugging Face) parameter name for a GGUF tensor name; None for a tensor we do not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def dequantize(tensor, path: Path) -> np.ndarray:
    """A GGUF tensor as float32 in PyTorch's (row-major, reversed GGUF) shape."""
    import gguf

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TENSOR_TYPES:
        raise ConfigError(f"{path}: tensor {tensor.name} has type {kind}, which specdecode cannot dequantise; "
                          f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}")
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return values.reshape([int(n) for n in reversed(tensor.shape)])


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert permutation of q/k rows: per head, row pairs (2i, 2i+1) go back to (i, i + hd/2).

    weight [num_heads * head_dim, ...] (a weight or a bias).
    """
    rest = weight.shape[1:]
    head_dim = weight.shape[0] // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, *rest)  # [H, hd/2, 2, ...]
            .transpose(1, 2).reshape(weight.shape))


def gguf_state_dict(ckpt: GGUFCheckpoint, config: ModelConfig, dtype: torch.dtype,
                    keep: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the file under its HF name, dequantised to `dtype`; unknown tensors are reported by the
    loader's unexpected-weight check under their GGUF name.

    keep: GGUF tensor types (e.g. {"Q4_1": "q4_1"}) whose 2-d tensors are returned as shipped instead, as
    (format, uint8 [rows, bytes]) pairs over the file's memory map (no copy; llama's q/k, whose rows are put back
    in PyTorch's order, are copies). Other matrices are dequantised, saying so in one line."""
    state, dequantised = {}, set()
    permuted = ckpt.architecture in PERMUTED_QK_ARCHITECTURES
    for tensor in ckpt.reader.tensors:
        if tensor.name in DERIVED_TENSORS:
            continue
        name = hf_name(tensor.name) or tensor.name
        kind = tensor.tensor_type.name
        if keep and kind in keep and len(tensor.shape) == 2:
            rows = _in_place(tensor.data)  # [rows, bytes], the file's bytes where they lie
            if permuted and name.endswith("q_proj.weight"):
                rows = unpermute_rows(rows, config.num_attention_heads).contiguous()
            elif permuted and name.endswith("k_proj.weight"):
                rows = unpermute_rows(rows, config.num_key_value_heads).contiguous()
            state[name] = (keep[kind], rows)
            continue
        if keep and len(tensor.shape) == 2 and kind not in ("F32", "F16", "BF16"):
            dequantised.add(kind)
        values = dequantize(tensor, ckpt.path)
        if not values.flags.writeable:  # F32 comes back as a view of the read-only memory map
            values = values.copy()
        weight = torch.from_numpy(np.ascontiguousarray(values))
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = unpermute_rows(weight, config.num_attention_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = unpermute_rows(weight, config.num_key_value_heads)
        state[name] = weight.to(dtype)
    if dequantised:
        print(f"specdecode: {ckpt.path.name}: tensors of type {', '.join(sorted(dequantised))} are dequantised to "
              f"{str(dtype).removeprefix('torch.')} (the kernels keep {', '.join(keep)} quantized)", file=sys.stderr,
              flush=True)
    return state


def _in_place(data: np.ndarray) -> torch.Tensor:
    """A tensor over the bytes of a read-only memory map, without a copy (the model never writes its weights)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(data)

