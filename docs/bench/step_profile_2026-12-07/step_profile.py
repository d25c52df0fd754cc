"""Profile target: the copy task (repeat a stdlib function with one rename) with prompt lookup at a fixed K, greedy,
one thread; run under py-spy --native by the record's command, and alone for the rates and steps.

    python docs/bench/step_profile_2026-12-07/step_profile.py K TOKENS"""
import inspect, sys, textwrap, shutil, time
import torch
from specdecode.engine.llm import LLM
from specdecode.sampling import SamplingParams
k = int(sys.argv[1]); tokens = int(sys.argv[2])
torch.set_num_threads(1)
code = textwrap.dedent(inspect.getsource(shutil._copytree))
prompt = ("Rename the argument `ignore_dangling_symlinks` to `skip_dangling` in this function and return the "
          f"whole function, unchanged otherwise.\n\n```python\n{code}```")
config = None if k == 0 else {"method": "ngram", "num_speculative_tokens": k, "adaptive": False}
llm = LLM(speculative_config=config, max_num_seqs=1)
msgs = [{"role": "user", "content": prompt}]
params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
llm.chat(msgs, SamplingParams(temperature=0, max_tokens=8))  # warm
before = llm.total_stats.steps
t = time.perf_counter(); out = llm.chat(msgs, params); dt = time.perf_counter() - t
steps = llm.total_stats.steps - before
n = len(out[0].outputs[0].token_ids)
per_step = n / steps if steps else 1.0  # (plain decoding counts no speculative steps: one token a step)
print(f"K={k}: {n} tokens in {dt:.2f} s, {n / dt:.1f} tok/s, {per_step:.2f} tokens a step, "
      f"{1000 * dt / (n / per_step):.1f} ms a step", flush=True)
