"""Megatron-style tensor parallelism of one decoder, in place (gpt-fast's tp.py shape).

Each rank keeps 1/N of the attention heads (q, k and v rows of its heads: column-parallel; the matching columns
of o_proj: row-parallel) and 1/N of the MLP (gate and up rows: column-parallel; down columns: row-parallel).
Attention's and the MLP's partial outputs are summed by one all-reduce each, so every rank ends each layer with
the full hidden state; embeddings, norms and the LM head stay whole on every rank. The KV cache then holds only
the rank's KV heads (make_cache reads the sharded head count).
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from specdecode.errors import ConfigError
from specdecode.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Where one process sits in a tensor-parallel group."""

    rank: int
    """This process's rank, 0..world_size-1 (rank 0 runs the engine)."""
    world_size: int
    """Ranks in the group (--tensor-parallel-size)."""

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside a tensor-parallel group of {self.world_size}")


def valid_sizes(config: ModelConfig) -> list[int]:
    """Tensor-parallel sizes that divide the query heads, the KV heads and the MLP width."""
    common = math.gcd(config.num_attention_heads, config.num_key_value_heads, config.intermediate_size)
    return [n for n in range(1, common + 1) if common % n == 0]


def check_divisible(config: ModelConfig, size: int, what: str = "tensor_parallel_size") -> None:
    """Refuse a size that does not split the model's heads and MLP evenly, naming the sizes that do."""
    if size < 1:
        raise ConfigError(f"{what} must be >= 1, got {size}")
    parts = {"query heads": config.num_attention_heads, "KV heads": config.num_key_value_heads,
             "MLP width": config.intermediate_size}
    bad = [f"{count} {name}" for name, count in parts.items() if count % size]
    if bad:
        raise ConfigError(f"{what}={size} does not divide the model's {' and '.join(bad)}; "
                          f"sizes that work for this model: {', '.join(map(str, valid_sizes(config)))}")


def check_draft_tensor_parallel(size: int | None) -> None:
    """The proposer runs whole on rank 0 (drafts are small: sharding them would add two all-reduces per layer to
    every draft forward for little memory), so the only draft size is 1."""
    if size not in (None, 1):
        raise ConfigError(f"draft_tensor_parallel_size={size} is not supported: the draft model or head runs whole "
                          "on rank 0; use 1 (or leave it unset)")


def _rows(weight: torch.Tensor, blocks: list[tuple[int, int]]) -> torch.Tensor:
    """The rows [start, start + count) of every block, concatenated (a new contiguous tensor)."""
    return torch.cat([weight[start:start + count] for start, count in blocks]).contiguous()


def _shard_rows(linear: nn.Linear, blocks: list[tuple[int, int]]) -> None:
    """Column parallelism: keep the output rows `blocks` of the weight (and bias)."""
    linear.weight = nn.Parameter(_rows(linear.weight.data, blocks), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(_rows(linear.bias.data, blocks), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _shard_columns(linear: nn.Linear, start: int, count: int) -> None:
    """Row parallelism: keep the input columns [start, start + count) (these layers have no bias to split)."""
    linear.weight = nn.Parameter(linear.weight.data[:, start:start + count].contiguous(), requires_grad=False)
    linear.in_features = count


def shard_model(model: nn.Module, tp: TensorParallel, all_reduce) -> nn.Module:
    """Keep this rank's share of every decoder layer of a LlamaForCausalLM (before any linear backend swap) and
    sum the row-parallel outputs with all_reduce(tensor) (in place) after attention and after the MLP."""
    config: ModelConfig = model.config
    check_divisible(config, tp.world_size)
    n, r = tp.world_size, tp.rank
    hd = config.head_dim
    h, kvh, ffn = config.num_attention_heads // n, config.num_key_value_heads // n, config.intermediate_size // n
    q_rows, kv_rows = config.num_attention_heads * hd, config.num_key_value_heads * hd
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        # qkv rows: [q heads | k heads | v heads]; this rank's heads of each, in the same order.
        _shard_rows(attn.qkv_proj, [(r * h * hd, h * hd), (q_rows + r * kvh * hd, kvh * hd),
                                    (q_rows + kv_rows + r * kvh * hd, kvh * hd)])
        _shard_columns(attn.o_proj, r * h * hd, h * hd)
        attn.num_heads, attn.num_kv_heads = h, kvh
        _shard_rows(mlp.gate_up_proj, [(r * ffn, ffn), (config.intermediate_size + r * ffn, ffn)])
        _shard_columns(mlp.down_proj, r * ffn, ffn)
        mlp.intermediate_size = ffn
        for module in (attn, mlp):  # the output of o_proj / down_proj is a fresh tensor: reduce it in place
            module.register_forward_hook(lambda _module, _inputs, output: all_reduce(output))
    model.tensor_parallel = tp
    return model
