"""Soak the server: N concurrent clients for a bounded time, streaming and not, greedy and sampled, completions and
chat, with random mid-stream disconnects and cancelled requests. Checks: no 5xx; every greedy answer that completed
equals offline `LLM.generate` for the same prompt; no slot or memory leak (the server's RSS after the run at most
10% above its RSS after warm-up - it may fall, as the OS drops pages of a memory-mapped model; the running and
waiting gauges, and the KV blocks used, back to 0). The report counts the preemptions of the run.

    specdecode bench soak                         # SmolLM2 (float32), 64 clients, 10 minutes
    specdecode bench soak --clients 16 --duration 60 --model DIR --speculative-model DRAFT

tests/server/test_soak.py runs a short soak on the tiny test model with the same code.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import random
import time

import httpx

from specdecode.bench.servers import rss_bytes, start_server, stop_server

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Explain what a linked list is.",
    "def fibonacci(n):",
    "List three fruits that are red.",
    "How do I boil an egg?",
    "Translate 'thank you' into German.",
    "Why do cats purr?",
]


@dataclasses.dataclass
class SoakConfig:
    """The load."""

    clients: int = 64
    """Concurrent clients, each sending one request after another."""
    duration: float = 600.0
    """Seconds of load after warm-up."""
    warmup: float = 30.0
    """Seconds of the same load before the memory baseline is taken."""
    max_tokens: tuple[int, int] = (4, 48)
    """Range of max_tokens per request."""
    p_stream: float = 0.5
    """Share of streaming requests."""
    p_greedy: float = 0.5
    """Share of greedy requests (the rest sample at T=0.8 with a seed)."""
    p_chat: float = 0.5
    """Share of chat requests (the rest are completions)."""
    p_abandon: float = 0.2
    """Share of requests the client walks away from: mid-stream, or by cancelling a non-streaming request."""
    seed: int = 0
    """Seeds every client's choices."""


@dataclasses.dataclass
class SoakReport:
    requests: int = 0
    completed: int = 0
    abandoned: int = 0
    statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    transport_errors: list[str] = dataclasses.field(default_factory=list)
    greedy: dict = dataclasses.field(default_factory=dict)
    """(endpoint, prompt, max_tokens) -> set of greedy texts the server answered."""
    greedy_checked: int = 0
    mismatches: list[str] = dataclasses.field(default_factory=list)
    rss_warm: int = 0
    rss_end: int = 0
    gauges_end: dict = dataclasses.field(default_factory=dict)
    preemptions: int = 0
    """Requests the server preempted (and recomputed) during the run: > 0 when its KV pool is too small for the load."""
    seconds: float = 0.0

    @property
    def server_errors(self) -> int:
        return sum(n for s, n in self.statuses.items() if s >= 500)

    @property
    def rss_growth(self) -> float:
        return self.rss_end / self.rss_warm - 1 if self.rss_warm else 0.0

    @property
    def ok(self) -> bool:
        return (self.server_errors == 0 and not self.transport_errors and not self.mismatches
                and self.rss_growth <= 0.10 and all(v == 0 for v in self.gauges_end.values()))

    def summary(self) -> str:
        codes = ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses.items()))
        return (f"{self.requests} requests in {self.seconds:.0f} s ({codes}); {self.completed} completed, "
                f"{self.abandoned} abandoned by their clients; {self.server_errors} 5xx, "
                f"{len(self.transport_errors)} transport errors; greedy answers checked against offline "
                f"generation: {self.greedy_checked}, mismatches {len(self.mismatches)}; server RSS "
                f"{self.rss_warm / 2**20:.0f} MiB after warm-up -> {self.rss_end / 2**20:.0f} MiB after the run "
                f"({self.rss_growth:+.1%}); {self.preemptions} preemptions; gauges after the run {self.gauges_end} -> "
                f"{'OK' if self.ok else 'FAIL'}")


def _body(rng: random.Random, config: SoakConfig, chat: bool, greedy: bool, stream: bool) -> tuple[dict, str, int]:
    prompt = rng.choice(PROMPTS)
    max_tokens = rng.randint(*config.max_tokens)
    body = {"max_tokens": max_tokens, "stream": stream, "temperature": 0 if greedy else 0.8}
    if not greedy:
        body["seed"] = rng.randrange(2**31)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body, prompt, max_tokens


def _text(event: dict, chat: bool) -> str:
    choice = event["choices"][0] if event.get("choices") else {}
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def _sse_lines(response: httpx.Response):
    """Lines of an event stream, split at LF only (as SSE says; str.splitlines would also split at U+2028...)."""
    buffer = ""
    async for chunk in response.aiter_text():
        buffer += chunk
        *lines, buffer = buffer.split("\n")
        for line in lines:
            yield line.rstrip("\r")


async def _one(client: httpx.AsyncClient, rng: random.Random, config: SoakConfig, report: SoakReport,
               record: bool) -> None:
    chat, greedy, stream = (rng.random() < config.p_chat, rng.random() < config.p_greedy,
                            rng.random() < config.p_stream)
    abandon = rng.random() < config.p_abandon
    body, prompt, max_tokens = _body(rng, config, chat, greedy, stream)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if record:
        report.requests += 1
    try:
        if stream:
            text, stop_after = [], rng.randint(1, 4) if abandon else None
            async with client.stream("POST", path, json=body) as response:
                report.statuses[response.status_code] += record
                if response.status_code != 200:
                    await response.aread()
                    return
                async for line in _sse_lines(response):
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        report.statuses[500] += record
                        return
                    text.append(_text(event, chat))
                    if stop_after is not None and len(text) >= stop_after:
                        report.abandoned += record
                        return  # leaving the block closes the connection mid-stream
            text = "".join(text)
        else:
            send = client.post(path, json=body)
            if abandon:
                try:
                    response = await asyncio.wait_for(send, timeout=rng.uniform(0.05, 1.0))
                except asyncio.TimeoutError:
                    report.abandoned += record
                    return
            else:
                response = await send
            report.statuses[response.status_code] += record
            if response.status_code != 200:
                return
            answer = response.json()["choices"][0]
            text = answer["message"]["content"] if chat else answer["text"]
    except httpx.HTTPError as exc:
        if record:
            report.transport_errors.append(f"{type(exc).__name__}: {exc}"[:200])
        return
    if record:
        report.completed += 1
        if greedy:
            report.greedy.setdefault((path, prompt, max_tokens), set()).add(text)


async def _client(url: str, index: int, config: SoakConfig, report: SoakReport, until: float, record: bool,
                  timeout: float) -> None:
    rng = random.Random(config.seed * 100_003 + index + (0 if record else 7919))
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        while time.monotonic() < until:
            await _one(client, rng, config, report, record)


async def _load(url: str, config: SoakConfig, seconds: float, report: SoakReport, record: bool,
                timeout: float) -> None:
    until = time.monotonic() + seconds
    await asyncio.gather(*(_client(url, i, config, report, until, record, timeout) for i in range(config.clients)))


GAUGES = {"specdecode:num_requests_running", "specdecode:num_requests_waiting", "specdecode:kv_cache_blocks_used"}


def gauges(url: str, wanted: set[str] = GAUGES) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in wanted}


PREEMPTIONS = "specdecode:num_preemptions_total"


def settle(url: str, timeout: float = 120.0) -> dict:
    """The gauges once no request is running or waiting (or as they are after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        now = gauges(url)
        if all(v == 0 for v in now.values()) or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def run_soak(url: str, pid: int, config: SoakConfig, request_timeout: float = 600.0) -> SoakReport:
    """Warm up, load for config.duration seconds, let the server settle; the server's RSS after warm-up and after
    the run, its gauges, and what the clients saw (check_greedy compares the greedy answers afterwards)."""
    report = SoakReport()
    asyncio.run(_load(url, config, config.warmup, SoakReport(), False, request_timeout))
    settle(url)
    report.rss_warm = rss_bytes(pid)
    preempted = gauges(url, {PREEMPTIONS}).get(PREEMPTIONS, 0.0)
    start = time.monotonic()
    asyncio.run(_load(url, config, config.duration, report, True, request_timeout))
    report.seconds = time.monotonic() - start
    report.gauges_end = settle(url)
    report.rss_end = rss_bytes(pid)
    report.preemptions = int(gauges(url, {PREEMPTIONS}).get(PREEMPTIONS, 0.0) - preempted)
    return report


def check_greedy(report: SoakReport, offline) -> None:
    """Compare every completed greedy answer with offline([(endpoint, prompt, max_tokens), ...]) -> texts."""
    keys = sorted(report.greedy)
    for key, expected in zip(keys, offline(keys) if keys else []):
        report.greedy_checked += 1
        path, prompt, max_tokens = key
        report.mismatches += [f"{path} {prompt!r} max_tokens={max_tokens}: {t!r} != {expected!r}"
                              for t in report.greedy[key] if t != expected]


def offline_generator(llm):
    """offline(keys): for each (endpoint, prompt, max_tokens), the greedy text LLM.generate gives for the prompt (for
    chat: for the prompt rendered in the chat template, as the server renders it), all in one batch."""
    from specdecode.sampling import SamplingParams

    def offline(keys: list[tuple[str, str, int]]) -> list[str]:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
                   if path.endswith("chat/completions") else prompt for path, prompt, _ in keys]
        params = [SamplingParams(temperature=0, max_tokens=max_tokens) for _, _, max_tokens in keys]
        return [out.outputs[0].text for out in llm.generate(prompts, params)]

    return offline


def cmd_soak(args) -> int:
    """`specdecode bench soak` (its flags: specdecode/cli/bench.py)."""
    config = SoakConfig(clients=args.clients, duration=args.duration, warmup=args.warmup, seed=args.seed)
    server_args = ["--dtype", "float32", "--max-num-seqs", str(args.max_num_seqs), "--max-model-len",
                   str(args.max_model_len)]
    for flag in ("model", "speculative_method", "speculative_model", "num_kv_blocks"):
        if getattr(args, flag):
            server_args += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    proc, url = start_server(server_args)
    try:
        report = run_soak(url, proc.pid, config)
    finally:
        stop_server(proc)
    # The offline reference is loaded after the server stopped, so that the two never compete for memory.
    from specdecode.engine.llm import LLM

    check_greedy(report, offline_generator(LLM(args.model, dtype="float32", max_model_len=args.max_model_len,
                                               speculative_config=None)))
    print(report.summary())
    for line in (report.mismatches + report.transport_errors)[:20]:
        print("  " + line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**{k: v for k, v in dataclasses.asdict(report).items() if k != "greedy"},
                       "statuses": dict(report.statuses), "server_errors": report.server_errors,
                       "rss_growth": report.rss_growth, "ok": report.ok}, f, indent=1)
    return 0 if report.ok else 1

