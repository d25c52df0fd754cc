"""Plain vs speculation on the Qwen2.5-Coder pair (the 1.5B, the 0.5B drafting), greedy, two code prompts, 160 tokens,
every configuration once per round, two rounds, one thread; tok/s of whole chat() calls (round 1 includes the
prompt's prefill, round 2 finds it in the prefix cache; suffix decoding, inside auto, remembers round 1's answer).

    python docs/bench/speed_int8_2026-12-04/pair.py [THREADS] [CONFIGS] [TEMPERATURE]

(TEMPERATURE > 0: seeded sampling, which gives the same tokens with or without speculation.)
"""
import sys, time, json, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
torch.set_num_threads(threads)
from specdecode.engine.llm import LLM
from specdecode.sampling import SamplingParams
PROMPTS = {
 "complete": "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals and returns them sorted. Include a docstring and handle empty input.",
 "edit": "Add type hints to this function and rename the variable `d` to `counts`. Return the whole function.\n\n```python\ndef word_freq(text, stop=None):\n    d = {}\n    if stop is None:\n        stop = set()\n    for line in text.splitlines():\n        for w in line.split():\n            w = w.strip('.,;:!?').lower()\n            if not w or w in stop:\n                continue\n            if w in d:\n                d[w] += 1\n            else:\n                d[w] = 1\n    items = sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))\n    result = []\n    for word, n in items:\n        result.append((word, n))\n    return result\n```",
}
configs = {
  "plain": None,
  "draft-adaptive": {"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 8},
  "draft-k4": {"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 4, "adaptive": False},
  "ngram": {"method": "ngram", "num_speculative_tokens": 8},
  "auto": {"method": "auto", "num_speculative_tokens": 8},
}
only = sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] else list(configs)
llms = {n: LLM(model="qwen2.5-coder-1.5b-instruct", speculative_config=configs[n], max_num_seqs=1) for n in only}
temperature = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
params = SamplingParams(temperature=temperature, seed=1 if temperature > 0 else None, max_tokens=160)
res = {n: {p: [] for p in PROMPTS} for n in llms}
texts = {}
for r in range(2):
    for p, prompt in PROMPTS.items():
        for n, llm in llms.items():
            t = time.perf_counter(); [out] = llm.chat([{"role": "user", "content": prompt}], params); dt = time.perf_counter() - t
            res[n][p].append(len(out.outputs[0].token_ids) / dt)
            texts.setdefault(p, {})[n] = out.outputs[0].token_ids
for p in PROMPTS:
    base = max(res["plain"][p]) if "plain" in res else None
    for n in llms:
        same = texts[p][n] == texts[p].get("plain", texts[p][n])
        print(f"{p:9s} {n:15s} rounds {[round(v, 1) for v in res[n][p]]} {max(res[n][p]):6.2f} tok/s" + (f"  {max(res[n][p])/base:.2f}x" if base else "") + ("" if same else "  OUTPUT DIFFERS"), flush=True)
