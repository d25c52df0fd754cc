"""One decode step over a paged cache (blocks of 16) and over the slots layout at the same context, interleaved in one
process, one thread: the median time of each and their ratio.

    python docs/bench/paged_2026-12-04/step_ab.py MODEL [CONTEXT]
"""
import time, torch, statistics, sys
torch.set_num_threads(1)
from specdecode.engine.llm import LLM
llm = LLM(model=sys.argv[1], max_num_seqs=1)
m = llm.target
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 300
caches = {"slots": m.make_cache(1, 2048), "paged": m.make_cache(1, 2048, block_size=16, num_blocks=200)}
ids = torch.randint(0, 1000, (1, ctx))
with torch.inference_mode():
    for c in caches.values():
        m(ids, cache=c, compute_logits=False); c.advance(torch.tensor([0]), ctx)
    one = torch.tensor([[5]])
    t = {k: [] for k in caches}
    for r in range(60):
        for k in (list(caches) if r % 2 else list(caches)[::-1]):
            c = caches[k]
            s = time.perf_counter()
            for _ in range(5):
                m(one, cache=c)
            t[k].append((time.perf_counter() - s) / 5)
print(sys.argv[1], ctx, {k: round(statistics.median(v) * 1000, 3) for k, v in t.items()}, "ratio paged/slots", round(statistics.median(t["paged"]) / statistics.median(t["slots"]), 4))
