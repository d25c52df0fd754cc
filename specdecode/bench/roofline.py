"""How close plain decoding runs to the machine's memory bound.

At batch 1 a decode step reads every weight once (the input embedding only one row of it) and the whole KV
cache, so memory read bandwidth / bytes read per step is the most tokens/s plain decoding could reach; the
measured tokens/s as a share of that says how much is left to take.
"""
from __future__ import annotations

import time

import torch

from torch import nn

from specdecode.model.linear import PackedLinear
from specdecode.model.quant import QuantEmbedding, QuantLinear
from specdecode.model.llama import LlamaForCausalLM


def measure_read_bandwidth(bytes_: int = 512 * 2**20, repeats: int = 5, device: str | torch.device = "cpu",
                           now=time.perf_counter) -> float:
    """Bytes/s of the fastest of `repeats` full reads (a sum) of a float32 tensor of `bytes_` bytes: well
    above every cache size, so it is the memory's read bandwidth at the current torch thread count. `now` is
    the clock (time.thread_time leaves out time spent waiting for a core on a shared machine)."""
    x = torch.ones(bytes_ // 4, dtype=torch.float32, device=device)
    x.sum()  # first touch: page faults, lazy allocation
    best = float("inf")
    for _ in range(repeats):
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        start = now()
        x.sum().item()  # .item() waits for the device
        best = min(best, now() - start)
    return x.numel() * x.element_size() / best


def weight_bytes_per_step(model: LlamaForCausalLM) -> int:
    """Bytes of weights one decode step reads: every linear layer's weight in the form its kernel reads (an int8
    copy one byte a weight, block-quantized matrices their blocks), every other parameter, except that an input
    embedding contributes one row (the lookup) rather than the whole table - unless it is also the output head."""
    total, counted = 0, set()
    for module in model.modules():
        if isinstance(module, nn.Linear | PackedLinear):
            total += module.bytes_read() if isinstance(module, PackedLinear) else sum(
                t.numel() * t.element_size() for t in (module.weight, module.bias) if t is not None)
            counted.update(id(t) for t in (module.weight, module.bias) if t is not None)
        elif isinstance(module, QuantLinear):
            total += module.bytes_read()
            counted.update(id(t) for t in (*module.qweights, module.bias) if t is not None)
    embedding = model.model.embed_tokens
    if isinstance(embedding, QuantEmbedding):
        if id(embedding.qweight) not in counted:  # untied: the looked-up row
            total += embedding.qweight.shape[1]
        return total + sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in counted)
    for p in model.parameters():  # parameters() yields tied ones once
        if id(p) in counted:
            continue
        total += embedding.weight.shape[1] * p.element_size() if p is embedding.weight else p.numel() * p.element_size()
    return total


def kv_bytes_per_step(model: LlamaForCausalLM, context_len: float) -> float:
    """Bytes of keys and values read by one decode step at this context length (batch 1)."""
    c = model.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * model.kv_dtype.itemsize * context_len


def roofline(model: LlamaForCausalLM, bandwidth: float, context_len: float, tokens_per_s: float) -> dict:
    """The memory-bound ceiling of batch-1 plain decoding and the measured speed's share of it."""
    weights = weight_bytes_per_step(model)
    kv = kv_bytes_per_step(model, context_len)
    ceiling = bandwidth / (weights + kv)
    return {"bandwidth_gb_s": bandwidth / 1e9, "weight_bytes": weights, "kv_bytes": kv,
            "mean_context_len": context_len, "ceiling_tokens_per_s": ceiling, "plain_tokens_per_s": tokens_per_s,
            "share": tokens_per_s / ceiling}


def macs_per_token(model: LlamaForCausalLM) -> int:
    """Multiply-adds of the matrix products one token costs (every linear layer, the output head included;
    attention over the cache is left out: it is small beside them at the contexts measured)."""
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear | PackedLinear | QuantLinear):
            total += module.in_features * module.out_features
    return total

