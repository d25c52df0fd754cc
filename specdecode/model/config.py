"""Model configuration: one dataclass for every Llama-family architecture, read from a Hugging Face config.json.

Architectures differ only by fields here (q/k/v bias, q/k norm, rope scaling, tied embeddings), never by code copies.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from specdecode.errors import CheckpointError, ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclasses.dataclass
class ModelConfig:
    """Shape and options of a Llama-family decoder."""

    vocab_size: int
    """Number of rows of the embedding table and of the output head."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_hidden_layers: int
    """Number of decoder layers."""
    num_attention_heads: int
    """Number of query heads."""
    num_key_value_heads: int | None = None
    """Number of key/value heads (grouped-query attention); None means one per query head."""
    head_dim: int | None = None
    """Width of one head; None means hidden_size // num_attention_heads."""
    max_position_embeddings: int = 2048
    """Longest sequence (prompt + generated tokens) the model supports."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    rope_scaling: dict | None = None
    """Rotary scaling; only {"rope_type": "llama3", ...} (Llama 3.1+) and None are supported."""
    tie_word_embeddings: bool = False
    """Whether the output head shares the embedding matrix."""
    attention_bias: bool = False
    """Whether q/k/v projections have a bias (Qwen2)."""
    qk_norm: bool = False
    """Whether queries and keys get a per-head RMSNorm before rotary (Qwen3)."""
    model_type: str = "llama"
    """Hugging Face model_type; one of SUPPORTED_MODEL_TYPES."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id, if the model has one."""
    eos_token_id: int | list[int] | None = None
    """End-of-sequence token id(s)."""
    torch_dtype: str | None = None
    """The dtype the checkpoint was saved in (informational)."""

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported; specdecode supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type not in ("llama3", "default"):
                raise ConfigError(
                    f"rope_scaling of type {rope_type!r} is not supported; use 'llama3' or remove rope_scaling"
                )

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} in config.json is not supported; "
                f"specdecode supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in raw.items() if k in known}
        rope = raw.get("rope_parameters")
        if isinstance(rope, dict):  # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters
            fields["rope_theta"] = rope.get("rope_theta", fields.get("rope_theta", 10000.0))
            if rope.get("rope_type", rope.get("type", "default")) != "default":
                fields["rope_scaling"] = rope
        if raw.get("mlp_bias"):
            raise ConfigError("mlp_bias=true is not supported by specdecode's decoder")
        fields["qk_norm"] = model_type == "qwen3"
        if model_type == "qwen2":
            fields["attention_bias"] = True
        return cls(**fields)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: a model directory needs a Hugging Face config.json")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path} is not valid JSON ({exc}); re-save the checkpoint") from exc
        try:
            return cls.from_dict(raw)
        except ConfigError as exc:  # say which checkpoint: a target and its draft both have a config.json
            raise ConfigError(f"{path}: {exc}") from exc

    def to_hf_dict(self) -> dict:
        """The config.json that transformers reads back as the same architecture."""
        out = {
            "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.model_type]],
            "model_type": self.model_type,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "use_cache": True,
        }
        for f in dataclasses.fields(self):
            if f.name in ("qk_norm", "model_type"):
                continue
            out[f.name] = getattr(self, f.name)
        if self.model_type != "llama":
            out.pop("attention_bias")
        return out

    def inv_freq(self):
        """Rotary inverse frequencies [head_dim // 2], with Llama 3 scaling applied when configured. Always on the
        CPU (the model moves them): on the meta device, where load_model builds, these ops import torch._dynamo."""
        import torch

        dim = self.head_dim
        positions = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu")
        inv_freq = 1.0 / (self.rope_theta ** (positions.float() / dim))
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) == "llama3":
            factor = scaling["factor"]
            low_freq_factor = scaling.get("low_freq_factor", 1.0)
            high_freq_factor = scaling.get("high_freq_factor", 4.0)
            old_context = scaling.get("original_max_position_embeddings", 8192)
            low_freq_wavelen = old_context / low_freq_factor
            high_freq_wavelen = old_context / high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            # Long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
            scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
            smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
            inv_freq = torch.where(is_medium, smoothed, scaled)
        return inv_freq

    def num_parameters(self) -> int:
        d, h, kv, hd = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attn = d * h * hd * 2 + d * kv * hd * 2
        mlp = 3 * d * self.intermediate_size
        per_layer = attn + mlp + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + emb + d
