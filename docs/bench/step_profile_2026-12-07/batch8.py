"""Profile target: 8 code questions at once under `auto` (the 0.5B draft and prompt lookup), greedy."""
import sys, time
import torch
from specdecode.engine.llm import LLM
from specdecode.sampling import SamplingParams
threads = int(sys.argv[1]); tokens = int(sys.argv[2])
torch.set_num_threads(threads)
questions = ["Write a Python function that merges two sorted lists.", "Explain what a Python generator is, with an example.",
             "Write a function that parses an ISO date string into a datetime.", "Implement binary search in Python.",
             "Write a context manager that times a block of code.", "How do I read a CSV file with the csv module?",
             "Write a function that flattens a nested list.", "Write a class for a stack with push, pop and peek."]
llm = LLM(max_num_seqs=8)
msgs = [[{"role": "user", "content": q}] for q in questions]
llm.chat(msgs[:1], SamplingParams(temperature=0, max_tokens=8))
t = time.perf_counter(); outs = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)); dt = time.perf_counter() - t
n = sum(len(o.outputs[0].token_ids) for o in outs)
print(f"batch 8, auto: {n} tokens in {dt:.2f} s, {n/dt:.1f} tok/s", flush=True)
