"""Whole-model step time at context L (1 and 5 new tokens), random cache contents, one thread.
python docs/bench/long_prompt_2026-12-07/step_at_context.py SRC_DIR LABEL [THREADS] (SRC_DIR: a checkout, for A/B)"""
import sys, time, torch
sys.path.insert(0, sys.argv[1])
from specdecode.engine.llm import LLM
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
llm = LLM(speculative_config=None, max_num_seqs=1)
model = llm.target
out = []
for L in (512, 4096, 8192):
    cache = model.make_cache(1, L + 64, block_size=16, num_blocks=(L + 64) // 16 + 4)
    cache.reserve([0], [L + 8])
    for k, v in zip(cache.k, cache.v):
        used = cache.tables[0][cache.tables[0] >= 0]
        k[used] = torch.randn(k[used].shape).to(k.dtype) * 0.5
        v[used] = torch.randn(v[used].shape).to(v.dtype) * 0.5
    cache.lengths[0] = L
    for T in (1, 5):
        ids = torch.randint(100, 1000, (1, T))
        model.forward(ids, cache=cache)
        best = 1e9
        for _ in range(3):
            s = time.perf_counter()
            for _ in range(4): model.forward(ids, cache=cache)
            best = min(best, (time.perf_counter() - s) / 4)
        out.append(f"L{L}T{T}:{best*1e3:.1f}")
    del cache
print(sys.argv[2], " ".join(out), flush=True)
