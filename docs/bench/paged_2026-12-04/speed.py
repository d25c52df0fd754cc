"""Decode speed with the paged KV cache (blocks of 16) against the slots layout (one row of max_model_len a
sequence), interleaved in one process: one request at a time, greedy, one thread, tok/s of whole chat() calls;
outputs compared token for token.

    python docs/bench/paged_2026-12-04/speed.py MODEL [SPEC] [ROUNDS]

MODEL: smollm2-135m-instruct or qwen2.5-coder-1.5b-instruct; SPEC: none or a draft model name for auto + draft.
"""
import sys
import time

import torch

from specdecode.engine.llm import LLM
from specdecode.sampling import SamplingParams

torch.set_num_threads(1)
model = sys.argv[1]
spec = None if len(sys.argv) < 3 or sys.argv[2] == "none" else {"method": "auto", "model": sys.argv[2],
                                                                "num_speculative_tokens": 8}
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
PROMPTS = ["Write a Python function `merge_intervals(intervals)` that merges overlapping intervals and returns them "
           "sorted. Include a docstring and handle empty input.",
           "Explain in a few sentences what a hash map is and when to use one."]
params = SamplingParams(temperature=0, max_tokens=160)
llms = {layout: LLM(model=model, speculative_config=spec, max_num_seqs=1, enable_prefix_caching=False,
                    block_size=size) for layout, size in (("paged", 16), ("slots", None))}
speed = {layout: [] for layout in llms}
outputs = {layout: [] for layout in llms}
for r in range(rounds):
    for prompt in PROMPTS:
        for layout, llm in (llms.items() if r % 2 == 0 else reversed(llms.items())):
            start = time.perf_counter()
            [out] = llm.chat([{"role": "user", "content": prompt}], params)
            speed[layout].append(len(out.outputs[0].token_ids) / (time.perf_counter() - start))
            outputs[layout].append(out.outputs[0].token_ids)
ratios = sorted(p / s for p, s in zip(speed["paged"], speed["slots"]))
print(f"{model} spec={sys.argv[2] if len(sys.argv) > 2 else 'none'}: paged {max(speed['paged']):.2f} tok/s, "
      f"slots {max(speed['slots']):.2f} tok/s (best of {len(speed['paged'])}); paged/slots per run median "
      f"{ratios[len(ratios) // 2]:.3f} (range {ratios[0]:.3f}-{ratios[-1]:.3f}); "
      f"outputs identical: {outputs['paged'] == outputs['slots']}")
