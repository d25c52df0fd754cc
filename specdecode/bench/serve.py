"""Load generator for OpenAI-compatible servers, in the shape of vLLM's benchmark_serving: replay held-out
ShareGPT first turns (the reference answer's token length, capped, as max_tokens) as streaming chat requests that
arrive as a Poisson process at a given rate (or all at once, or at a fixed concurrency), and measure what a user
sees.

- TTFT: request sent -> first streamed chunk with text.
- TPOT: (end - first token) / (output tokens - 1), per request.
- ITL: the gaps between streamed chunks after the first (one chunk can carry several tokens when a step accepts
  a draft; vLLM's benchmark reports the same per-chunk gaps).
- goodput: requests per second that met both SLOs (TTFT and TPOT).
Bounded: at most num_requests requests, and none sent or awaited past max_seconds (those count as unfinished).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time

import httpx

from specdecode.bench.measure import percentile


@dataclasses.dataclass
class Request:
    """One replayed request."""

    messages: list[dict]
    """Chat messages to send."""
    max_tokens: int
    """The reference answer's length in tokens, capped."""
    source: str = ""
    """ShareGPT id."""


@dataclasses.dataclass
class Outcome:
    """What one request did."""

    ok: bool
    ttft: float = 0.0
    seconds: float = 0.0
    """Sent -> last byte."""
    output_tokens: int = 0
    chunk_gaps: list[float] = dataclasses.field(default_factory=list)
    """Seconds between streamed text chunks after the first."""
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.seconds - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclasses.dataclass
class LoadConfig:
    """How the requests arrive."""

    rate: float | None = None
    """Requests per second, Poisson arrivals (inf: all at once); None when concurrency is set."""
    concurrency: int | None = None
    """Requests in flight at all times (a closed loop) instead of a rate."""
    max_seconds: float = 300.0
    """No request is sent or awaited past this many seconds after the first."""
    seed: int = 0
    """Seed of the arrival times."""
    temperature: float = 0.0
    """Sampling temperature of every request."""

    def __post_init__(self):
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("give exactly one of rate and concurrency")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s (inf: all at once), got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")

    @property
    def label(self) -> str:
        return f"concurrency {self.concurrency}" if self.concurrency else f"{self.rate:g} req/s"


def sharegpt_requests(tokenizer, n: int, max_tokens_cap: int, max_prompt_tokens: int) -> list[Request]:
    """n held-out ShareGPT first turns (hash order) whose prompt fits, each with its reference answer's token
    count (by `tokenizer`, capped at max_tokens_cap) as max_tokens."""
    from specdecode.catalog import sharegpt
    from specdecode.train import speculators

    _, heldout = sharegpt.split(sharegpt.load_conversations(sharegpt.fetch(quiet=True)))
    out = []
    for conv in speculators.hash_order(heldout):
        first = next(i for i, m in enumerate(conv.messages) if m["role"] == "user")
        answer = next((m["content"] for m in conv.messages[first + 1:] if m["role"] == "assistant"), "")
        messages = conv.messages[:first + 1]
        answer_tokens = len(tokenizer.encode(answer, add_special_tokens=False))
        if answer_tokens < 2 or len(tokenizer.encode_chat(messages)) > max_prompt_tokens:
            continue
        out.append(Request(messages, min(max_tokens_cap, answer_tokens), conv.id))
        if len(out) == n:
            break
    return out


async def _one(client: httpx.AsyncClient, model: str, request: Request, temperature: float,
               progress: dict | None = None) -> Outcome:
    """The request streamed to its end. progress: where the seconds to its first text go as soon as they are known
    (for a caller that may cut the request off before it ends)."""
    body = {"model": model, "messages": request.messages, "max_tokens": request.max_tokens, "stream": True,
            "temperature": temperature, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    chunks, gaps, usage = 0, [], None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return Outcome(False, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return Outcome(False, error=str(event["error"])[:200])
                usage = event.get("usage") or usage
                choices = event.get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                        if progress is not None:
                            progress["ttft"] = first - start
                    else:
                        gaps.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return Outcome(False, error=f"{type(exc).__name__}: {exc}"[:200])
    end = time.perf_counter()
    if first is None:
        return Outcome(False, error="no text streamed")
    tokens = usage["completion_tokens"] if usage else chunks
    return Outcome(True, first - start, end - start, tokens, gaps)


async def run_load(base_url: str, model: str, requests: list[Request], load: LoadConfig,
                   api_key: str | None = None) -> tuple[list[Outcome], float]:
    """Send the requests as `load` says; (outcomes in request order, None-free; seconds from the first send to the
    last answer)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(requests) + 1, max_keepalive_connections=len(requests) + 1)
    rng = random.Random(load.seed)
    outcomes: list[Outcome | None] = [None] * len(requests)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=httpx.Timeout(load.max_seconds),
                                 limits=limits) as client:
        start = time.perf_counter()
        deadline = start + load.max_seconds

        async def send(i: int) -> None:
            outcomes[i] = await _one(client, model, requests[i], load.temperature)

        tasks = []
        if load.concurrency:
            queue = iter(range(len(requests)))

            async def worker() -> None:
                for i in queue:
                    if time.perf_counter() >= deadline:
                        return
                    await send(i)
            tasks = [asyncio.create_task(worker()) for _ in range(load.concurrency)]
        else:
            next_at = start
            for i in range(len(requests)):
                if load.rate != float("inf"):
                    next_at += rng.expovariate(load.rate)
                    await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                if time.perf_counter() >= deadline:
                    break
                tasks.append(asyncio.create_task(send(i)))
        pending = ()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        seconds = time.perf_counter() - start
    return [o or Outcome(False, error="not finished within max_seconds") for o in outcomes], seconds


def summarise(outcomes: list[Outcome], seconds: float, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    """vLLM benchmark_serving's figures (times in ms), over the finished requests; goodput under the SLOs."""
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft for o in ok]
    tpots = [o.tpot for o in ok if o.output_tokens > 1]
    itls = [g for o in ok for g in o.chunk_gaps]
    tokens = sum(o.output_tokens for o in ok)
    good = [o for o in ok if o.ttft <= slo_ttft_s and o.tpot <= slo_tpot_s]
    out = {"requests": len(outcomes), "completed": len(ok), "failed": len(outcomes) - len(ok),
           "errors": sorted({o.error for o in outcomes if not o.ok})[:5], "seconds": seconds,
           "output_tokens": tokens, "request_throughput": len(ok) / seconds if seconds else 0.0,
           "output_token_throughput": tokens / seconds if seconds else 0.0,
           "goodput": len(good) / seconds if seconds else 0.0, "good_requests": len(good)}
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls)):
        out[f"mean_{name}_ms"] = 1000 * sum(values) / len(values) if values else 0.0
        for q in (50, 90, 99):
            out[f"p{q}_{name}_ms"] = 1000 * percentile(values, q)
    return out
