"""Weights kept block-quantized in memory - GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K, byte for
byte (every type of llama.cpp's common presets: Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0, Q4_1 files) - and multiplied by
specdecode's own kernels (specdecode/kernels/quant.cpp, compiled for this CPU on first use).

A GGUF file's matrices are read from the file's memory map and packed once at load into the kernels' layout (8
rows interleaved, the same bytes rearranged: quant.cpp's pack; 0.56 bytes a weight for Q4_K, 1.06 for Q8_0, where
a bfloat16 copy reads 2; nothing is written to disk); a stack of matrices in different formats (a Q4_K_M file's q/k
in Q4_K, v in Q6_K) is one QuantLinear of parts. Any other checkpoint is quantized at load (`quantize_linears`,
GGUF's reference rounding through the gguf package). Activations stay in the model's dtype (float32 for quantized
matrices by default); the kernels round each row of activations to int8 per block of 32 (as llama.cpp does:
+0.016% perplexity on Qwen2.5-Coder-1.5B, +0.24% on SmolLM2, docs/bench/perplexity_int8_activations.md), and the
quantized model is its own target: speculation is exact relative to it (its logits do not depend on how many rows
share a pass, see kernels/quant.cpp).

The modules keep the rest of the code base unchanged: `state_dict()` gives the dequantized weights under the
original names (so digests, saving and the split of stacked q/k/v behave as for a float model) and `.weight` is a
dequantized copy made on access (for the few readers of whole tables, e.g. a speculator's head rows).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import nn

from specdecode.errors import ConfigError

FORMATS = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q5_0": 3, "q5_1": 4, "q4_k": 5, "q5_k": 6, "q6_k": 7}
"""Block formats the kernels multiply, with their ids in quant.cpp."""
BLOCKS = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24),
          "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210)}
"""(values, bytes) of one block of each format (quant.cpp's FORMATS table)."""
GGUF_FORMATS = {name.upper(): name for name in FORMATS}
"""GGUF tensor types kept as shipped (every other type is dequantised at load)."""
QUANTIZE_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
"""Formats a float matrix can be quantized to at load (gguf's reference rounding; K-quants it cannot write)."""
QUANTIZATIONS = ("gguf", "q8_0", "q4_0", "q4_1")
"""What `quantization=` takes for kept-quantized weights: 'gguf' (a GGUF's matrices as shipped) or a format
(every matrix quantized to it at load)."""


def row_bytes(fmt: str, in_features: int) -> int:
    """Bytes of one row of `in_features` weights in format fmt."""
    values, size = BLOCKS[fmt]
    if in_features % values:
        raise ConfigError(f"a {fmt} row holds whole blocks of {values} weights, not {in_features}")
    return in_features // values * size


def bytes_per_weight(fmt: str) -> float:
    values, size = BLOCKS[fmt]
    return size / values


def kernels():
    """The compiled kernels, or None where they cannot be built here."""
    from specdecode import kernels as compiled
    return compiled.quant()


def require_kernels():
    module = kernels()
    if module is None:
        from specdecode import kernels as compiled
        raise ConfigError(f"the quantized CPU kernels could not be compiled here ({compiled.failure()}); install a "
                          "C++ compiler (g++) and ninja, or load the model without quantization (--quantization none)")
    return module


def _ggml_type(fmt: str):
    from gguf import GGMLQuantizationType
    return GGMLQuantizationType[fmt.upper()]


def quantize(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """weight [N, K] (K a multiple of 32) -> uint8 [N, K / 32 * block bytes] in GGUF's layout and rounding."""
    from gguf.quants import quantize as gguf_quantize

    if fmt not in QUANTIZE_FORMATS:
        raise ConfigError(f"cannot quantize to {fmt} here; use one of {', '.join(QUANTIZE_FORMATS)}")
    if weight.shape[-1] % 32:
        raise ConfigError(f"cannot quantize a matrix with {weight.shape[-1]} inputs to {fmt}: blocks are 32 wide")
    module = kernels()
    if fmt == "q4_0" and module is not None:  # the same bytes, a hundred times sooner (a draft's load)
        return module.quantize_q4_0(weight.detach().float().cpu())
    data = gguf_quantize(weight.detach().float().cpu().numpy(), _ggml_type(fmt))
    return torch.from_numpy(np.ascontiguousarray(data))


def dequantize(qweight: torch.Tensor, fmt: str, in_features: int) -> torch.Tensor:
    """uint8 [N, bytes] -> float32 [N, in_features] (the same numbers as gguf's dequantization)."""
    module = kernels()
    if module is not None:
        return module.dequantize_rows(qweight, FORMATS[fmt], in_features, torch.arange(qweight.shape[0]))
    from gguf.quants import dequantize as gguf_dequantize
    values = gguf_dequantize(qweight.numpy(), _ggml_type(fmt))
    return torch.from_numpy(np.ascontiguousarray(values.reshape(qweight.shape[0], in_features)))


Part = tuple[str, torch.Tensor]
"""One block-quantized matrix: (format, uint8 rows [rows, bytes])."""


class QuantLinear(nn.Module):
    """y = x @ W.T (+ b) with W block-quantized, inference only. W may be stacked from parts of different formats
    (a Q4_K_M file's q/k in Q4_K beside its v in Q6_K): the kernel reads each part where it lies (a GGUF's memory
    map) and writes its columns of the output."""

    def __init__(self, parts: list[Part] | Part, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                 packed: list[Callable[[], torch.Tensor]] | None = None, stored: tuple[str, ...] = ()):
        """packed: per part, what gives its packed matrix when a product first needs it (a PackedStore's map, or
        packing then); None packs every part now. stored: the names in that store this module's tensors go by."""
        super().__init__()
        parts = [parts] if isinstance(parts, tuple) else list(parts)
        for fmt, rows in parts:
            if fmt not in FORMATS:
                raise ConfigError(f"weight format {fmt!r} is not one of {', '.join(FORMATS)}")
            if rows.dim() != 2 or rows.shape[1] != row_bytes(fmt, in_features):
                raise ConfigError(f"a {fmt} matrix with {in_features} inputs holds rows of "
                                  f"{row_bytes(fmt, in_features)} bytes, not {tuple(rows.shape)}")
        if sum(rows.shape[0] for _, rows in parts) != out_features:
            raise ConfigError(f"the parts of a {in_features} x {out_features} matrix hold "
                              f"{sum(rows.shape[0] for _, rows in parts)} rows")
        self.formats = [fmt for fmt, _ in parts]
        self.format_ids = [FORMATS[fmt] for fmt in self.formats]
        module = require_kernels()
        self._unpacked: dict[int, Callable[[], torch.Tensor]] = {}
        self.stored = stored
        for i, (fmt, rows) in enumerate(parts):
            self.register_buffer(f"qweight{i}", rows)  # as shipped (a GGUF's memory map): for .weight and saving
            # turned around once for the kernels (8 rows interleaved, quant.cpp's pack): what a product reads
            if packed is None:
                self.register_buffer(f"packed{i}", module.pack(rows.contiguous(), FORMATS[fmt], in_features))
            else:
                self._unpacked[i] = packed[i]
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.value_dtype = dtype  # what state_dict() and .weight give, and the output's dtype
        self._kernel = module.qmatmul_parts

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str) -> "QuantLinear":
        bias = None if linear.bias is None else linear.bias.detach()
        return cls((fmt, quantize(linear.weight, fmt)), linear.in_features, linear.out_features, bias,
                   linear.weight.dtype)

    @property
    def fmt(self) -> str:
        """The format of its parts ('q4_k+q6_k' where they differ)."""
        return "+".join(dict.fromkeys(self.formats))

    @property
    def qweights(self) -> list[torch.Tensor]:
        return [getattr(self, f"qweight{i}") for i in range(len(self.formats))]

    def packing(self, i: int) -> Callable[[], torch.Tensor]:
        """What gives part i's packed matrix (for a module made of some of this one's parts)."""
        if i in self._unpacked:
            return self._unpacked[i]
        tensor = getattr(self, f"packed{i}")
        return lambda: tensor

    @property
    def packed(self) -> list[torch.Tensor]:
        """The parts as the kernels read them (quant.cpp's pack)."""
        while self._unpacked:
            i, make = self._unpacked.popitem()
            self.register_buffer(f"packed{i}", make())
        return [getattr(self, f"packed{i}") for i in range(len(self.formats))]

    @property
    def weight(self) -> torch.Tensor:
        """A dequantized copy [out, in] (made on every access)."""
        return torch.cat([dequantize(rows, fmt, self.in_features) for fmt, rows in zip(self.formats, self.qweights)]
                         ).to(self.value_dtype)

    def bytes_read(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return sum(rows.numel() for rows in self.packed) + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = self._kernel(flat, self.packed, self.format_ids, True)  # [M, out] float32
        if self.bias is not None:
            out += self.bias
        if x.dtype != torch.float32:
            out = out.to(x.dtype)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt}, " \
               f"bias={self.bias is not None}"


class QuantEmbedding(nn.Module):
    """An embedding table kept block-quantized: a lookup dequantizes the rows it reads."""

    def __init__(self, qweight: torch.Tensor, fmt: str, num_embeddings: int, embedding_dim: int,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.fmt, self.format_id = fmt, FORMATS[fmt]
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.register_buffer("qweight", qweight)
        self.value_dtype = dtype
        self._rows = require_kernels().dequantize_rows

    @property
    def weight(self) -> torch.Tensor:
        """A dequantized copy [num, dim] (made on every access)."""
        return dequantize(self.qweight, self.fmt, self.embedding_dim).to(self.value_dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self._rows(self.qweight, self.format_id, self.embedding_dim, ids.reshape(-1))
        return rows.to(self.value_dtype).view(*ids.shape, self.embedding_dim)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.fmt}"


def quantize_linears(model: nn.Module, fmt: str) -> nn.Module:
    """Every nn.Linear of model (and an untied output head) quantized to fmt at load, in place; returns model.
    The input embedding stays as it is (a lookup reads one row)."""
    require_kernels()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.in_features % 32 == 0:
                setattr(parent, name, QuantLinear.from_linear(child, fmt))
    return model


def lighten(model: nn.Module, fmt: str = "q4_0", store=None) -> nn.Module:
    """Every block-quantized matrix of model held in more bits per weight than `fmt` requantized to it, in place;
    returns model. For drafts, whose step is memory-bound and need not be exact (the verifier is): Qwen2.5-Coder-0.5B
    (Q5_0/Q8_0/Q6_K/Q4_K, 64k-row head) reads 235 MB a step instead of 310, its forward 11.9 ms instead of 16.6
    (Zen 4, one thread), and drafting for the 1.5B was accepted as often (115 vs 116 and 124 vs 124 tokens on two
    code prompts). store: a PackedStore (packed_store.py) of the model's GGUF that keeps the requantized rows and
    their packed matrices (the model's modules then name their parts in it), or None."""
    limit = bytes_per_weight(fmt)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, QuantLinear) or all(bytes_per_weight(f) <= limit for f in child.formats):
                continue
            if store is None or not child.stored:
                parts = [(fmt, quantize(dequantize(rows, f, child.in_features), fmt)) if bytes_per_weight(f) > limit
                         else (f, rows) for f, rows in zip(child.formats, child.qweights)]
                setattr(parent, name, QuantLinear(parts, child.in_features, child.out_features, child.bias,
                                                  child.value_dtype))
                continue
            parts, packed, stored = [], [], []
            for i, (f, rows) in enumerate(zip(child.formats, child.qweights)):
                key = child.stored[i]
                if bytes_per_weight(f) > limit:  # requantized once, then read from the store
                    key = key.removesuffix(":packed") + f"@{fmt}"
                    rows = store.get(key + ":rows", lambda rows=rows, f=f: quantize(
                        dequantize(rows, f, child.in_features), fmt))
                    parts.append((fmt, rows))
                    packed.append(stored_packing(store, key, fmt, rows, child.in_features))
                    stored += [key + ":rows", key + ":packed"]
                else:
                    parts.append((f, rows))
                    packed.append(child.packing(i))
                    stored.append(key)
            setattr(parent, name, QuantLinear(parts, child.in_features, child.out_features, child.bias,
                                              child.value_dtype, packed, tuple(stored)))
    model.__dict__.pop("_fused_layers", None)  # (the fused layers' arguments are gathered again)
    return model


SPECULATOR_FORMAT = "q8_0"
"""The block format a draft model's or head's matrices take beside a block-quantized target on the CPU."""


def speculator_format(target: nn.Module) -> str | None:
    """How a speculator (draft model, EAGLE or Medusa head) should hold its matrices beside `target`: Q8_0 when the
    target's are block-quantized on the CPU, so that drafting runs the same fused kernels (an EAGLE level there is
    one layer_step call instead of ~60 operators over float32 matrices: measured on SmolLM2 with the shipped head,
    its drafting went from ~22-27 to ~13 ms a step); None (keep float weights) otherwise. Drafts need not be
    exact (the verifier is), and Q8_0 moves a head's logits by well under its own error."""
    on_cpu = getattr(target, "device", torch.device("cpu")).type == "cpu"
    return SPECULATOR_FORMAT if on_cpu and quantized_format(target) is not None and kernels() is not None else None


def quantized_format(model: nn.Module) -> str | None:
    """The block formats of model's quantized matrices ('q4_1', 'q4_1+q8_0', ...), or None if it has none."""
    formats = sorted({part for m in model.modules() if isinstance(m, QuantLinear | QuantEmbedding)
                      for part in m.fmt.split("+")})
    return "+".join(formats) or None


STACKS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
"""The decoder's stacked matrices (llama.py's stack_under_hf_names) and the checkpoint matrices they hold."""


def stored_packing(store, key: str, fmt: str, rows: torch.Tensor, in_features: int) -> Callable[[], torch.Tensor]:
    """What gives the packed matrix of the rows stored as `key`: the store's map, else packing them then."""
    module = require_kernels()
    return lambda: store.get(key + ":packed", lambda: module.pack(rows.contiguous(), FORMATS[fmt], in_features))


def attach_quantized(model: nn.Module, state: dict, dtype: torch.dtype, store=None) -> None:
    """Put the quantized matrices of `state` (name -> (format, uint8 rows), see gguf_state_dict's keep) into
    model (built on the meta device, llama.py's LlamaForCausalLM) as QuantLinear / QuantEmbedding modules, and
    take them out of state. A stack (q/k/v, gate/up) keeps each part's rows where they are, in its own format; a
    stack with a part that is not quantized is dequantized instead (its parts stay in state as float tensors).
    store: a PackedStore (packed_store.py) of the GGUF: the modules then pack from it when first used (under the
    state's names), else now."""
    require_kernels()

    def linear(keys: list[str], in_features: int, out_features: int, bias: torch.Tensor | None):
        parts = [state[k] for k in keys]
        if store is None:
            return QuantLinear(parts, in_features, out_features, bias, dtype)
        packed = [stored_packing(store, k, fmt, rows, in_features) for k, (fmt, rows) in zip(keys, parts)]
        return QuantLinear(parts, in_features, out_features, bias, dtype, packed, tuple(k + ":packed" for k in keys))

    def dequantize_in_place(names):
        for name in names:
            key = name + ".weight"
            if isinstance(state.get(key), tuple):
                fmt, rows = state[key]
                state[key] = dequantize(rows, fmt, rows.shape[1] // BLOCKS[fmt][1] * BLOCKS[fmt][0])

    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        for stacked, names in STACKS.items():
            keys = [prefix + name + ".weight" for name in names]
            if not all(isinstance(state.get(k), tuple) for k in keys):
                dequantize_in_place(prefix + name for name in names)
                continue
            parent, attr = stacked.split(".")
            old = getattr(getattr(layer, parent), attr)
            bias = None
            if old.bias is not None:
                bias_keys = [prefix + name + ".bias" for name in names]
                if all(k in state for k in bias_keys):
                    bias = torch.cat([state.pop(k) for k in bias_keys])
            setattr(getattr(layer, parent), attr, linear(keys, old.in_features, old.out_features, bias))
            for k in keys:
                del state[k]
        for single in ("self_attn.o_proj", "mlp.down_proj"):
            key = prefix + single + ".weight"
            if isinstance(state.get(key), tuple):
                parent, attr = single.split(".")
                old = getattr(getattr(layer, parent), attr)
                setattr(getattr(layer, parent), attr, linear([key], old.in_features, old.out_features, None))
                del state[key]
    config = model.config
    embed = state.get("model.embed_tokens.weight")
    if isinstance(embed, tuple):
        fmt, rows = embed
        model.model.embed_tokens = QuantEmbedding(rows, fmt, config.vocab_size, config.hidden_size, dtype)
        if config.tie_word_embeddings:
            model.lm_head = linear(["model.embed_tokens.weight"], config.hidden_size, config.vocab_size, None)
        del state["model.embed_tokens.weight"]
    if isinstance(state.get("lm_head.weight"), tuple):
        model.lm_head = linear(["lm_head.weight"], config.hidden_size, config.vocab_size, None)
        del state["lm_head.weight"]
    dequantize_in_place(k.removesuffix(".weight") for k, v in list(state.items()) if isinstance(v, tuple))
