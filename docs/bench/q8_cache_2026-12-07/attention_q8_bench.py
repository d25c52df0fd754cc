# Record: how docs/bench/q8_cache_2026-12-07 was made: python docs/bench/q8_cache_2026-12-07/attention_q8_bench.py
"""Attention alone at the 1.5B's shape, float16 vs the 8-bit cache, interleaved (best of 3 rounds), one thread."""
import sys, time
import torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))  # (the repo root)
from specdecode.model.quant import kernels
from tests.model.test_q8_cache import packed
torch.set_num_threads(1)
H, G, hd = 12, 2, 128
for ctx, T in ((4096, 1), (4096, 5), (8192, 5), (16384, 1), (3584, 512)):
    blocks = (ctx + T) // 16 + 1
    k32, v32 = torch.randn(blocks, G, hd, 16), torch.randn(blocks, G, 16, hd)
    k8, v8, _, _ = packed(k32, v32)
    caches = {"float16": (k32.half(), v32.half()), "q8_0": (k8, v8)}
    tables = torch.arange(blocks)[None]
    q = torch.randn(T, H * hd)
    best = {}
    n = 3 if T > 100 else 20
    for _ in range(3):
        for name, (k, v) in caches.items():
            call = (q, k, v, tables, torch.tensor([ctx]), 0, None, H, G, T)
            kernels().attention(*call)
            t = time.perf_counter()
            for _ in range(n):
                kernels().attention(*call)
            best[name] = min(best.get(name, 1e9), (time.perf_counter() - t) / n)
    print(f"ctx {ctx:6d} T {T:4d}: float16 {1000*best['float16']:7.2f} ms, q8_0 {1000*best['q8_0']:7.2f} ms a layer "
          f"({best['q8_0']/best['float16']:.2f}x)", flush=True)
