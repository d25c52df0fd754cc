"""The breakdown of the copy task (step_profile_2026-12-07's prompt: repeat a stdlib function with one rename), prompt
lookup at a fixed K, 256 tokens, one thread.

    python docs/bench/step_breakdown_2026-12-08/copy_task.py K
"""
import inspect, sys, textwrap, shutil
import torch
from specdecode.engine.llm import LLM
from specdecode.sampling import SamplingParams
from specdecode.bench.breakdown import StepBreakdown, breakdown_lines
k = int(sys.argv[1]); torch.set_num_threads(1)
code = textwrap.dedent(inspect.getsource(shutil._copytree))
prompt = ("Rename the argument `ignore_dangling_symlinks` to `skip_dangling` in this function and return the "
          f"whole function, unchanged otherwise.\n\n```python\n{code}```")
llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": k, "adaptive": False}, max_num_seqs=1)
msgs = [{"role": "user", "content": prompt}]
llm.chat(msgs, SamplingParams(temperature=0, max_tokens=8))
with StepBreakdown(llm) as m:
    llm.chat(msgs, SamplingParams(temperature=0, max_tokens=256, ignore_eos=True))
print("\n".join(breakdown_lines(f"copy K={k}", m.shares())))
print("prompt tokens", len(llm.tokenizer.encode_chat(msgs)))
