"""Attention alone at the 1.5B's shape from a given checkout (for A/B in separate processes), float16 cache, one thread.
    python docs/bench/long_prompt_2026-12-07/ab_attention.py SRC_DIR LABEL"""
import sys, time, torch
sys.path.insert(0, sys.argv[1])
from specdecode.model.quant import kernels
torch.set_num_threads(1)
H, G, hd = 12, 2, 128
out = []
for dtype in (torch.float16,):
    for ctx, T in ((4096, 1), (4096, 5), (8192, 5), (16384, 1), (2048, 64)):
        blocks = (ctx + T) // 16 + 1
        keys = torch.randn(blocks, G, hd, 16).to(dtype); values = torch.randn(blocks, G, 16, hd).to(dtype)
        call = (torch.randn(T, H * hd), keys, values, torch.arange(blocks)[None], torch.tensor([ctx]), 0, None, H, G, T)
        kernels().attention(*call)
        best = 1e9
        for _ in range(5):
            s = time.perf_counter()
            for _ in range(5): kernels().attention(*call)
            best = min(best, (time.perf_counter() - s) / 5)
        out.append(f"{ctx}x{T}:{best*1e3:.3f}")
print(sys.argv[2], " ".join(out), flush=True)
