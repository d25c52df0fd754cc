"""Tiny GGUF files written with gguf's own writer, as llama.cpp's converter lays them out: llama q/k rows
permuted, norms in F32, every matrix in the chosen tensor type, the tokenizer in the metadata."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from specdecode.model.config import ModelConfig
from specdecode.model.gguf import _GLOBAL_NAMES, _LAYER_NAMES
from specdecode.model.llama import LlamaForCausalLM

VARIANTS = {
    # name: (GGUF architecture, our model_type, config changes)
    "llama": ("llama", "llama", {}),
    "mistral": ("llama", "llama", {"head_dim": 128, "rope_theta": 1e6}),  # Mistral GGUFs are llama files
    "qwen2": ("qwen2", "qwen2", {"rope_theta": 1e6}),
    "qwen3": ("qwen3", "qwen3", {"head_dim": 128}),  # head_dim != hidden / heads, as in every Qwen3
}
K_QUANT_LAYOUT = {  # block bytes, offsets of the float16 scales (d, dmin) in a block of 256 weights, and a d
    # that keeps the largest weight near 0.15 (d x largest sub-scale x largest quant)
    "Q2_K": (84, (80, 82), 3e-3), "Q3_K": (110, (108,), 1e-3), "Q4_K": (144, (0, 2), 1.5e-4),
    "Q5_K": (176, (0, 2), 7e-5), "Q6_K": (210, (208,), 4e-5),
}


def tiny_model(variant: str, vocab_size: int, seed: int = 0, tied: bool = True, **changes) -> LlamaForCausalLM:
    """A random model whose every matrix has rows of a multiple of 256 (the K-quant block)."""
    _, model_type, variant_changes = VARIANTS[variant]
    fields = dict(vocab_size=vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=tied, model_type=model_type, bos_token_id=0,
                  eos_token_id=1)
    fields.update(variant_changes, **changes)
    config = ModelConfig.from_dict(fields)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.05)
    return model.eval()


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's permute of q/k rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    for g, hf in _GLOBAL_NAMES.items():
        if hf == hf_name:
            return g
    _, _, layer, rest = hf_name.split(".", 3)
    for g, hf in _LAYER_NAMES.items():
        if hf == rest:
            return f"blk.{layer}.{g}"
    raise KeyError(hf_name)


def _random_k_blocks(rows: int, cols: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Valid K-quant data (random quants and sub-scales, small positive float16 super-scales) [rows, bytes]."""
    block, scale_offsets, d = K_QUANT_LAYOUT[kind]
    data = rng.integers(0, 256, size=(rows, cols // 256, block), dtype=np.uint8)
    for i, offset in enumerate(scale_offsets):
        scale = (rng.uniform(0.5 * d, d, size=(rows, cols // 256)) * (0.5 if i else 1.0)).astype(np.float16)
        data[:, :, offset:offset + 2] = scale.view(np.uint8).reshape(rows, cols // 256, 2)
    return data.reshape(rows, -1)


def random_blocks(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid data of any kept format ('q4_k', 'q5_0', ...) [rows, bytes]: random quants, random sub-scales, and
    float16 scales small enough that the weights stay near +-0.2."""
    kind = fmt.upper()
    if kind in K_QUANT_LAYOUT:
        return _random_k_blocks(rows, cols, kind, rng)
    size, scale_offsets, d = {"Q8_0": (34, (0,), 1.5e-3), "Q4_0": (18, (0,), 0.02), "Q4_1": (20, (0, 2), 0.01),
                              "Q5_0": (22, (0,), 0.01), "Q5_1": (24, (0, 2), 5e-3)}[kind]
    data = rng.integers(0, 256, size=(rows, cols // 32, size), dtype=np.uint8)
    for i, offset in enumerate(scale_offsets):  # d > 0; Q4_1 / Q5_1's offset m of either sign
        scale = rng.uniform(0.5 * d, d, size=(rows, cols // 32)) * (rng.choice([-4.0, 4.0], (rows, cols // 32))
                                                                     if i else 1.0)
        data[:, :, offset:offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(rows, cols // 32, 2)
    return data.reshape(rows, -1)


def tokenizer_metadata(tokenizer_json: Path) -> tuple[list[str], list[int], list[str], dict]:
    """(tokens, token types, merges, {special name: id}) of a byte-level BPE tokenizer.json."""
    raw = json.loads(Path(tokenizer_json).read_text())
    vocab = raw["model"]["vocab"]
    for added in raw["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in raw["added_tokens"] if a["special"]}
    types = [3 if t in special else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw["model"]["merges"]]
    return tokens, types, merges, {t: vocab[t] for t in special}


def write_gguf(path: Path, model: LlamaForCausalLM, tokenizer_json: Path, variant: str, qtype: str,
               pre: str = "default", chat_template: str | None = None, add_bos: bool = False, seed: int = 0,
               rope_freqs: np.ndarray | None = None, tensor_types: dict[str, str] | None = None) -> Path:
    """Write `model` (and the tokenizer) as a GGUF with every matrix in `qtype`. K-quant files hold random
    blocks instead of the model's weights (gguf cannot quantise to them); the others hold the model, rounded.
    tensor_types: another type for the matrices whose GGUF name ends with a key (whole dot-separated parts:
    "output.weight" is not "attn_output.weight"), e.g. {"attn_v.weight": "Q6_K"} (a Q4_K_M file's mix)."""
    import gguf

    arch, _, _ = VARIANTS[variant]
    config = model.config
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens, types, merges, special = tokenizer_metadata(tokenizer_json)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(special.get("<|bos|>", 0))
    writer.add_eos_token_id(special.get("<|eos|>", 1))
    writer.add_add_bos_token(add_bos)
    if chat_template:
        writer.add_chat_template(chat_template)
    if rope_freqs is not None:  # Llama 3.1+: the converter writes the rope scaling as a per-frequency divisor
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, tensor in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        values = tensor.detach().float().numpy()
        tensor_type = next((t for suffix, t in (tensor_types or {}).items()
                            if f".{gguf_name(name)}".endswith(f".{suffix}")), qtype)
        kind = gguf.GGMLQuantizationType[tensor_type]
        if arch == "llama" and name.endswith("q_proj.weight"):
            values = _permute(values, config.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            values = _permute(values, config.num_key_value_heads)
        if values.ndim == 1 or tensor_type == "F32":
            writer.add_tensor(gguf_name(name), values.astype(np.float32))
        elif tensor_type == "F16":
            writer.add_tensor(gguf_name(name), values.astype(np.float16))
        elif tensor_type in K_QUANT_LAYOUT:
            data = _random_k_blocks(values.shape[0], values.shape[1], tensor_type, rng)
            writer.add_tensor(gguf_name(name), data, raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def kernel_rounded(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """What the quantized kernels multiply: each block of a row (32 values for the 32-value formats, 256 for the
    K-quants, llama.cpp's Q8_K) rounded to int8 steps of d = max|x| / 127 (as llama.cpp does), in float32 as the
    kernels round (x * (1 / d), to nearest even); float64."""
    blocks = x.float().reshape(-1, x.shape[-1] // block, block)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / torch.where(scale > 0, scale, 1), 0)
    return (torch.round(blocks * inverse).double() * scale.double()).reshape(x.shape)

