"""The step breakdown of `bench --speed` alone (specdecode/bench/breakdown.py), on the default model's GGUF:
prompt lookup K = 4 and 8 at batch 1 and the default speculation (`auto`: the 0.5B draft and prompt lookup) at
batch 8, on the speed benchmark's copying prompt, 128 tokens each.

    python docs/bench/step_breakdown_2026-12-08/breakdown.py THREADS OUT.json
"""
import json
import sys

import torch

from specdecode.bench.breakdown import breakdown_lines, step_breakdowns
from specdecode.bench.speed import SPEC_PROMPT, SpeedConfig
from specdecode.catalog.registry import resolve_model

torch.set_num_threads(int(sys.argv[1]))
config = SpeedConfig(model=resolve_model("qwen2.5-coder-1.5b-instruct"), tokens=128, batch=8)
results = step_breakdowns(config, SPEC_PROMPT)
for name, shares in results.items():
    print("\n".join(breakdown_lines(name, shares)), flush=True)
json.dump({"threads": int(sys.argv[1]), "breakdowns": results}, open(sys.argv[2], "w"), indent=1)
