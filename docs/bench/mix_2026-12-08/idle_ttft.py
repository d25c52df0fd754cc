"""TTFT of the mix's long requests (4k-token stdlib files and a question) sent alone to an idle server, streamed.
python docs/bench/mix_2026-12-08/idle_ttft.py URL INDEX..."""
import sys, time, json, httpx
from specdecode.bench.mix import long_requests
from specdecode.model.tokenizer import Tokenizer
from specdecode.catalog.registry import resolve_model
reqs = long_requests(Tokenizer(resolve_model("qwen2.5-coder-1.5b-instruct")), 4096, 64)
for i in map(int, sys.argv[2:]):
    r = reqs[i]
    t = time.perf_counter(); first = None
    with httpx.stream("POST", sys.argv[1] + "/v1/chat/completions", timeout=600, json={
            "model": "x", "messages": r.messages, "max_tokens": r.max_tokens, "temperature": 0, "stream": True}) as s:
        for line in s.iter_lines():
            if first is None and line.startswith("data:") and "[DONE]" not in line:
                chunk = json.loads(line[5:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - t
    print(f"{r.source}: TTFT {first:.1f} s, whole {time.perf_counter() - t:.1f} s", flush=True)
