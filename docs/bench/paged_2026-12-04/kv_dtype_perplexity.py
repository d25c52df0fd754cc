"""What storing the KV cache in 16 bits costs in quality: perplexity of held-out text (the standard-library files of
`specdecode bench perplexity`) read through the cache in chunks of 32 tokens, so that every attention reads the
stored (rounded) keys and values, with a float32, bfloat16 and float16 cache; same model, same kernels otherwise.

    python docs/bench/paged_2026-12-04/kv_dtype_perplexity.py MODEL [WINDOWS] [WINDOW]
"""
import math
import sys

import torch

from specdecode.bench.perplexity import default_text
from specdecode.engine.llm import LLM

torch.set_num_threads(2)
model = sys.argv[1]
windows = int(sys.argv[2]) if len(sys.argv) > 2 else 4
window = int(sys.argv[3]) if len(sys.argv) > 3 else 512
CHUNK = 32
llm = LLM(model=model, max_num_seqs=1)
target = llm.target
ids = llm.tokenizer.encode(default_text())
starts = [i * (len(ids) - window) // max(1, windows - 1) for i in range(windows)]
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in starts:
            tokens = torch.tensor([ids[start:start + window]])
            cache = target.make_cache(1, window + 1, block_size=16, dtype=dtype)
            for first in range(0, window, CHUNK):
                chunk = tokens[:, first:first + CHUNK]
                logits = target(chunk, cache=cache).logits[0]  # [T, V]
                cache.advance(torch.tensor([0]), chunk.shape[1])
                following = tokens[0, first + 1:first + 1 + chunk.shape[1]]
                logp = torch.log_softmax(logits[:len(following)].float(), -1)
                nll -= float(logp.gather(1, following[:, None]).sum())
                count += len(following)
    print(f"{model} KV cache {str(dtype).replace('torch.', '')}: perplexity {math.exp(nll / count):.4f} over "
          f"{count} tokens ({windows} windows of {window})", flush=True)
