"""Attention alone (kernels/attention.cpp) at the 1.5B's shape: 12 query heads over 2 kv heads of 128, a paged cache
of 16-position blocks, one layer per call, one thread. Prints ms a layer, x28 (the model's layers) and GFLOP/s
(4 x new tokens x context x head dim x heads).

    python docs/bench/long_prompt_2026-12-07/attention_bench.py [--threads 1]
"""
import argparse
import time

import torch

from specdecode.model.quant import kernels

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=1)
args = p.parse_args()
torch.set_num_threads(args.threads)
H, G, hd = 12, 2, 128
for dtype in (torch.float16, torch.float32):
    for ctx, T in ((4096, 1), (4096, 5), (8192, 5), (16384, 1), (3584, 512)):
        blocks = (ctx + T) // 16 + 1
        keys = torch.randn(blocks, G, hd, 16).to(dtype)
        values = torch.randn(blocks, G, 16, hd).to(dtype)
        tables = torch.arange(blocks)[None]
        q = torch.randn(T, H * hd)
        call = (q, keys, values, tables, torch.tensor([ctx]), 0, None, H, G, T)
        kernels().attention(*call)
        n = 3 if T > 100 else 20
        start = time.perf_counter()
        for _ in range(n):
            kernels().attention(*call)
        seconds = (time.perf_counter() - start) / n
        flops = 4 * T * (ctx + T / 2) * hd * H
        print(f"{str(dtype)[6:]:8s} context {ctx:5d}, {T:3d} new tokens: {seconds * 1e3:7.2f} ms a layer, "
              f"x28 = {seconds * 28 * 1e3:7.1f} ms, {flops / seconds / 1e9:5.1f} GFLOP/s", flush=True)
