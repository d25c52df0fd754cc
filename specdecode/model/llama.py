"""One Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3), configured by ModelConfig.

Two forwards share the same weights: a training forward (full causal attention, no cache) and an inference
forward over a static KVCache, with explicit position ids per token and an optional draft-tree mask. State-dict
names match Hugging Face's, so a checkpoint's state dict loads as is; inside, q/k/v and gate/up are stacked into
one matrix each (see stack_under_hf_names). The linear backend is chosen after loading (model/linear.py).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.model.attention import CacheContext
from specdecode.model.cache import KV_DTYPES, KVCache
from specdecode.model.config import ModelConfig


@dataclasses.dataclass
class ModelOutput:
    hidden: torch.Tensor
    """Final (normed) hidden states [B, T, D], the input of the output head."""
    logits: torch.Tensor | None = None
    """Output logits [B, T, vocab], float32 (None when compute_logits=False)."""
    layer_hidden: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Outputs of the requested decoder layers, each [B, T, D]."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # the library op: fewer dispatches, and it runs twice per layer per token
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Reduced precision: normalise (in float32 inside the op), round, then scale, in the reference
        # implementation's rounding order.
        return self.weight * F.rms_norm(x, self.weight.shape, None, self.eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] computed as roll(x) = [x2, x1] times
    signed_sin = [-sin1, sin2]: the same numbers in three operations. x, cos, sin [B, T, heads, hd] (or broadcast)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def stack_under_hf_names(module: nn.Module, stacked: str, parts: tuple[str, ...], sizes: tuple[int, ...]) -> None:
    """Keep the projections `parts` of `module` (Hugging Face names, e.g. q_proj, k_proj, v_proj) as one
    nn.Linear `stacked` whose output rows are theirs in order (`sizes` rows each): one matrix product instead of
    several. State dicts still speak the parts' names: loading stacks them, state_dict() splits them (as views)."""

    def stack_on_load(mod, state_dict, prefix, *args):
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{part}.{kind}" for part in parts]
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}{stacked}.{kind}"] = torch.cat([state_dict.pop(k) for k in keys])

    def split_on_save(mod, state_dict, prefix, local_metadata):
        for kind in ("weight", "bias"):
            value = state_dict.pop(f"{prefix}{stacked}.{kind}", None)
            if value is not None:
                state_dict.update({f"{prefix}{part}.{kind}": chunk for part, chunk in zip(parts, value.split(sizes))})

    module.register_load_state_dict_pre_hook(stack_on_load)
    module.register_state_dict_post_hook(split_on_save)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        d, hd, bias = config.hidden_size, config.head_dim, config.attention_bias
        sizes = (self.num_heads * hd, self.num_kv_heads * hd, self.num_kv_heads * hd)  # q, k, v
        self.qkv_proj = nn.Linear(d, sum(sizes), bias=bias)
        stack_under_hf_names(self, "qkv_proj", ("q_proj", "k_proj", "v_proj"), sizes)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: CacheContext | None):
        """x [B * T, D] (token-major), cos/sin [B, T, 1, hd] -> [B * T, D]."""
        B, T = cos.shape[0], cos.shape[1]
        h, kvh = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(B, T, h + 2 * kvh, self.head_dim)  # heads in order: q..., k..., v...
        qk, v = qkv[:, :, :h + kvh], qkv[:, :, h + kvh:]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :, :h]), self.k_norm(qk[:, :, h:])), dim=2)
        qk = apply_rotary(qk, cos, sin)  # queries and keys at once
        q, k, v = qk[:, :, :h].transpose(1, 2), qk[:, :, h:].transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, hd]
        if ctx is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = ctx.attend(self.layer_idx, q, k, v)  # [B, heads, T, hd]
        return self.o_proj(out.transpose(1, 2).reshape(B * T, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        stack_under_hf_names(self, "gate_up_proj", ("gate_proj", "up_proj"), (config.intermediate_size,) * 2)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [B * T, ffn] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, ctx):
        """x [B * T, D]: two dimensions, so that every nn.Linear is one plain matrix product."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


def embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding(num, dim); on the meta device (where load_model builds, then assigns the weights) without the
    random init, whose meta version is a Python decomposition that imports torch._dynamo on first use (~1.3 s)."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding.from_pretrained(torch.empty(num, dim), freeze=False)
    return nn.Embedding(num, dim)


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", config.inv_freq(), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the weights' too, unless they are block-quantized, see quant.py)."""
        return self.model.norm.weight.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype: on CPU float16 where the layers run through the fused kernels (attention.cpp widens
        each entry exactly as it reads it: half the bytes of float32; on Qwen2.5-Coder-1.5B over 2 x 4,096 tokens
        +0.016% perplexity, the top token unchanged at 99.1% of positions, closer than bfloat16's 99.05%:
        docs/bench/long_prompt_2026-12-07), else float32 (torch's matrix products over a 16-bit cache are slow on
        CPU); the model's dtype elsewhere."""
        if self.device.type != "cpu":
            return self.dtype
        return torch.float16 if self.fused_kernel() is not None else torch.float32

    def fused_layers(self, cache: KVCache):
        """fused_kernel() where the cache is one it reads (float32, bfloat16 or float16, contiguous), else None."""
        if cache.k[0].dtype not in KV_DTYPES.values() or not cache.k[0].is_contiguous():
            return None
        return self.fused_kernel()

    def fused_kernel(self):
        """(the kernel, per-layer arguments, heads, kv heads) for cached forwards through kernels/layer.cpp - every
        layer block-quantized, float32 on CPU (Qwen3's q/k norms included) - or None: the layers then run as
        modules. The arguments are gathered once (the weights of an inference model do not change)."""
        prepared = self.__dict__.get("_fused_layers", False)
        if prepared is not False:
            return prepared
        from specdecode.model.quant import QuantLinear, kernels

        layers, prepared = self.model.layers, None
        module = kernels() if self.device.type == "cpu" and self.dtype == torch.float32 else None
        if module is not None and all(
                isinstance(m, QuantLinear) for layer in layers
                for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                          layer.mlp.down_proj)):
            args = []
            for layer in layers:
                attn, mlp = layer.self_attn, layer.mlp
                args.append((layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                             layer.input_layernorm.eps, attn.qkv_proj.packed, attn.qkv_proj.format_ids,
                             attn.qkv_proj.bias, *((attn.q_norm.weight.detach(), attn.k_norm.weight.detach())
                                                   if attn.q_norm is not None else (None, None)),
                             attn.o_proj.packed, attn.o_proj.format_ids,
                             mlp.gate_up_proj.packed, mlp.gate_up_proj.format_ids, mlp.down_proj.packed,
                             mlp.down_proj.format_ids))
            prepared = (module.layer_step, args, layers[0].self_attn.num_heads, layers[0].self_attn.num_kv_heads)
        self.__dict__["_fused_layers"] = prepared
        return prepared

    @property
    def batch_invariant(self) -> bool:
        """Whether a row's numbers in a cached forward are the same whatever else shares the pass (its own drafts,
        other requests, a prefill in chunks): every layer runs through the fused kernels and the output head is
        block-quantized too; kernels/quant.cpp computes each output the same way for any number of rows. Float
        weights run oneDNN's matrix kernels, whose rounding depends on the number of rows."""
        from specdecode.model.quant import QuantLinear

        return isinstance(self.lm_head, QuantLinear) and self.fused_kernel() is not None

    def make_cache(self, slots: int, max_len: int, block_size: int | None = None,
                   num_blocks: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        """A KV cache of `slots` rows of up to max_len positions: paged in blocks of block_size (a pool of
        num_blocks), or one preallocated block a row (block_size None); dtype default kv_dtype."""
        c = self.config
        kv_heads = self.model.layers[0].self_attn.num_kv_heads  # this rank's share under tensor parallelism
        return KVCache(c.num_hidden_layers, slots, kv_heads, max_len, c.head_dim, dtype=dtype or self.kv_dtype,
                       device=self.device, block_size=block_size, num_blocks=num_blocks)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (see apply_rotary) [B, T, 1, head_dim] for position ids [B, T]."""
        freqs = positions.float()[:, :, None, None] * self.inv_freq  # [B, T, 1, hd/2]
        cos, sin = freqs.cos().to(self.dtype), freqs.sin().to(self.dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, slots: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, hidden_layers: tuple[int, ...] = (),
                compute_logits: bool = True, inputs_embeds: torch.Tensor | None = None,
                pending: int = 0, chunk: tuple[int, list[int]] | None = None) -> ModelOutput:
        """Run the decoder.

        input_ids [B, T]. Without a cache: the training forward (causal attention over the T tokens).
        With a cache: new tokens are appended after each row's committed length (rows are `slots` [B],
        default 0..B-1) and attend to that prefix plus, among the new tokens, either the causal past or,
        with tree_mask [B, T, T] (bool, True = may attend), their tree ancestors and themselves.
        `pending` > 0 says that the P positions after each row's length already hold uncommitted tokens of
        this draft (written by an earlier forward): the new tokens are written after them and tree_mask is then
        [B, T, P + T], its first P columns saying which of those earlier tokens each new token sees.
        positions [B, T] default to the write positions. The cache's lengths are not changed.
        chunk (slot, token ids): the next piece of another row's prompt, written after that row's length in the same
        forward (through the kernels, each layer's weights are read once for both; elsewhere it runs first, alone);
        the output covers the B rows only.
        """
        if chunk is not None:
            fused = self.fused_layers(cache)
            if fused is None or hidden_layers or inputs_embeds is not None:
                self.forward(torch.tensor([chunk[1]], device=self.device), cache=cache,
                             slots=torch.tensor([chunk[0]]), compute_logits=False)
                chunk = None
            else:  # its blocks first: a pool too short raises before anything is written
                start = int(cache.lengths[chunk[0]])
                cache.reserve([chunk[0]], [start + len(chunk[1])])
        B, T = input_ids.shape
        ctx = None
        if cache is not None:
            ctx = CacheContext(cache, slots, B, T, tree_mask, pending)
            if positions is None:
                positions = ctx.write_pos
        elif positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        cos, sin = self.rotary(positions.to(self.device))
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        x = x.reshape(B * T, -1)  # [B * T, D]
        layer_hidden = {}
        fused = self.fused_layers(cache) if ctx is not None else None
        if fused is not None:  # one kernel call a layer, x updated in place (kernels/layer.cpp)
            x = x.float().clone() if inputs_embeds is not None or x.dtype != torch.float32 else x.contiguous()
            cos, sin = cos.reshape(B * T, -1).float().contiguous(), sin.reshape(B * T, -1).float().contiguous()
            visible = None if ctx.tree_mask is None else ctx.tree_mask.cpu()
            step, args, heads, kv_heads = fused
            ride = (None, 0, 0)
            if chunk is not None:  # its rows after the B * T
                ids = torch.tensor(chunk[1], device=self.device)
                c_cos, c_sin = self.rotary(torch.arange(start, start + len(ids), device=self.device)[None])
                x = torch.cat((x, self.model.embed_tokens(ids).float()))
                cos = torch.cat((cos, c_cos.reshape(len(ids), -1).float())).contiguous()
                sin = torch.cat((sin, c_sin.reshape(len(ids), -1).float())).contiguous()
                ride = (cache.tables[[chunk[0]]], start, len(ids))
            for i, (layer_args, k, v) in enumerate(zip(args, cache.k, cache.v)):
                step(x, *layer_args, cos, sin, k, v, ctx.tables, ctx.lengths, ctx.pending, visible,
                     heads, kv_heads, T, *ride)
                if i in hidden_layers:
                    layer_hidden[i] = x.view(B, T, -1).clone()
            x = x[:B * T]
        else:
            for i, layer in enumerate(self.model.layers):
                x = layer(x, cos, sin, ctx)
                if i in hidden_layers:
                    layer_hidden[i] = x.view(B, T, -1)
        hidden = self.model.norm(x)
        # Logits in float32 whatever the weights: sampling and verification want it, and on CPU argmax over
        # bfloat16 is 5x slower than the conversion and a float32 argmax together.
        logits = self.lm_head(hidden).view(B, T, -1).float() if compute_logits else None
        return ModelOutput(hidden=hidden.view(B, T, -1), logits=logits, layer_hidden=layer_hidden)
