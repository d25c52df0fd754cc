"""What the paged KV cache buys a server, measured against a live `specdecode serve` (default flags unless given):

- sessions: N concurrent chat sessions of a ~1,000-token prompt each (distinct text, nothing to share), sent at once
  to a server with the paged cache and to one with the slots layout (--block-size 0): how many run at once (the
  peak of num_requests_running, polled from /metrics), how many were refused, preemptions, wall time; then every
  session's next turn (its history, the answer, a new question): the share of its tokens found in the cache (the
  sessions whose keys and values the server still held);
- shared: 16 concurrent requests with one ~1,000-token system prompt and distinct questions, with speculation as
  the server's default and with --no-speculation: the prefix cache's hit rate over the requests after the first
  (the Prometheus counters' change over the scenario, less the first request's prompt), and whether the answers
  agree between the two servers (greedy).

    specdecode bench sessions --model qwen2.5-coder-1.5b-instruct --sessions 24 --out docs/bench/paged_2026-12-04
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from pathlib import Path

import httpx

from specdecode.bench.servers import start_server, stop_server
from specdecode.hardware import cpu_flags, cpu_name

WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega value index buffer table record "
         "vector matrix token block cache layer query result parser stream window").split()
QUESTIONS = ["Summarise the notes above in one line.", "Which item is mentioned first?", "Name two entries above.",
             "Is anything repeated above?", "What is the last line about?", "Count the sections above.",
             "Give the notes a title.", "Which word appears most?", "Quote the first line.",
             "List three keywords from above.", "What is the topic?", "Pick one line and explain it.",
             "Is there a number above?", "What comes after the second line?", "Reply with one word.",
             "Describe the style of the notes."]
GAUGES = ("specdecode:num_requests_running", "specdecode:num_requests_waiting", "specdecode:kv_cache_blocks_used",
          "specdecode:kv_cache_blocks_free")
COUNTERS = ("specdecode:prefix_cache_queries_total", "specdecode:prefix_cache_hits_total",
            "specdecode:num_preemptions_total")


def machine() -> str:
    """The CPU the figures were measured on (model name, vector extensions, cores)."""
    flags = cpu_flags()
    vector = "AMX" if "amx_tile" in flags else "AVX-512 VNNI" if "avx512_vnni" in flags else \
        "AVX2" if "avx2" in flags else "no AVX2"
    return f"{cpu_name()} ({vector}), {os.cpu_count()} cores"


def filler(tokenizer, tokens: int, seed: int) -> str:
    """Text of about `tokens` tokens, different for every seed (numbered lines of words)."""
    rng = random.Random(seed)
    lines, text = [], ""
    while len(tokenizer.encode(text)) < tokens:
        lines.append(f"{seed}.{len(lines)}: " + " ".join(rng.choice(WORDS) for _ in range(12)))
        text = "\n".join(lines)
    return text


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    wanted = set(GAUGES) | set(COUNTERS)
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in wanted}


class Poller:
    """The gauges' peaks over a scenario, /metrics read every `every` seconds on a thread."""

    def __init__(self, url: str, every: float = 0.25):
        self.url, self.every = url, every
        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for name, value in scrape(self.url).items():
                    if name in GAUGES:
                        self.peaks[name] = max(self.peaks.get(name, value), value)
            except httpx.HTTPError:
                pass
            self._stop.wait(self.every)

    def __enter__(self) -> "Poller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


async def _chat(client: httpx.AsyncClient, model: str, messages: list[dict], max_tokens: int) -> dict:
    start = time.perf_counter()
    response = await client.post("/v1/chat/completions", json={"model": model, "messages": messages,
                                                               "max_tokens": max_tokens, "temperature": 0})
    seconds = time.perf_counter() - start
    if response.status_code != 200:
        return {"ok": False, "status": response.status_code, "seconds": seconds, "error": response.text[:200]}
    body = response.json()
    return {"ok": True, "seconds": seconds, "text": body["choices"][0]["message"]["content"],
            "prompt_tokens": body["usage"]["prompt_tokens"], "completion_tokens": body["usage"]["completion_tokens"]}


async def _send(url: str, conversations: list[list[dict]], max_tokens: int, stagger: float = 0.0) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(i, messages):
            await asyncio.sleep(i * stagger)
            return await _chat(client, model, messages, max_tokens)
        return await asyncio.gather(*(one(i, m) for i, m in enumerate(conversations)))


def run_scenario(url: str, conversations: list[list[dict]], max_tokens: int, stagger: float = 0.0) -> dict:
    before = scrape(url)
    start = time.perf_counter()
    with Poller(url) as poller:
        results = asyncio.run(_send(url, conversations, max_tokens, stagger))
    seconds = time.perf_counter() - start
    after = scrape(url)
    moved = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in COUNTERS}
    return {"seconds": seconds, "results": results, "peaks": poller.peaks, "counters": moved,
            "refused": sum(not r["ok"] for r in results)}


def with_server(server_args: list[str], scenario):
    proc, url = start_server(server_args)
    try:
        return scenario(url)
    finally:
        stop_server(proc)


def run(model: str, sessions: int, prompt_tokens: int, max_tokens: int, shared: int, extra: list[str],
        progress=print) -> dict:
    from specdecode.catalog.registry import resolve_model
    from specdecode.model.loading import read_config
    from specdecode.model.tokenizer import Tokenizer

    model_dir = resolve_model(model)
    tokenizer = Tokenizer(model_dir, read_config(model_dir).eos_token_ids)
    base = ["--model", model, *extra]
    report: dict = {"model": model, "sessions": sessions, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
                    "server_args": extra, "cpu": machine()}
    distinct = [[{"role": "user", "content": filler(tokenizer, prompt_tokens, i) + "\n\n" + QUESTIONS[i % 16]}]
                for i in range(sessions)]
    def two_turns(url: str) -> dict:
        first = run_scenario(url, distinct, max_tokens)
        follow = [messages + [{"role": "assistant", "content": r.get("text") or ""},
                              {"role": "user", "content": "And in one more line?"}]
                  for messages, r in zip(distinct, first["results"])]
        second = run_scenario(url, follow, max_tokens)
        counters = second["counters"]
        first["turn2_hit_rate"] = counters["specdecode:prefix_cache_hits_total"] / max(
            1.0, counters["specdecode:prefix_cache_queries_total"])
        first["turn2_seconds"] = second["seconds"]
        return first

    for layout, args in (("paged", base), ("slots", base + ["--block-size", "0"])):
        progress(f"sessions: {sessions} x ~{prompt_tokens}-token prompts, {layout} layout, then each one's next "
                 "turn ...")
        report[f"sessions_{layout}"] = with_server(args, two_turns)
        got = report[f"sessions_{layout}"]
        progress(f"  peak running {got['peaks'].get('specdecode:num_requests_running')}, refused {got['refused']}, "
                 f"{got['seconds']:.0f} s; next turns' prefix hit rate {got['turn2_hit_rate']:.1%}")
    system = filler(tokenizer, prompt_tokens, 10_000)
    common = [[{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[i % 16]}]
              for i in range(shared)]
    first_prompt = len(tokenizer.encode_chat(common[0]))
    for name, args in (("shared_speculation", base), ("shared_plain", base + ["--no-speculation"])):
        progress(f"shared: {shared} requests on one ~{prompt_tokens}-token system prompt ({name}) ...")
        got = with_server(args, lambda url: run_scenario(url, common, max_tokens))
        queries, hits = got["counters"]["specdecode:prefix_cache_queries_total"], \
            got["counters"]["specdecode:prefix_cache_hits_total"]
        got["hit_rate_after_first"] = hits / max(1.0, queries - first_prompt)
        report[name] = got
        progress(f"  hit rate after the first request {got['hit_rate_after_first']:.1%}, peak running "
                 f"{got['peaks'].get('specdecode:num_requests_running')}, {got['seconds']:.0f} s")
    texts = [[r.get("text") for r in report[n]["results"]] for n in ("shared_speculation", "shared_plain")]
    report["shared_answers_identical"] = texts[0] == texts[1]
    return report


def summary(report: dict) -> str:
    lines = [f"{report['model']}: {report['sessions']} concurrent sessions of ~{report['prompt_tokens']} prompt "
             f"tokens, {report['max_tokens']} generated each; {report.get('cpu', 'CPU not recorded')}"]
    for layout in ("paged", "slots"):
        got = report[f"sessions_{layout}"]
        lines.append(f"  {layout:6s} peak running {got['peaks'].get('specdecode:num_requests_running', 0):.0f}, "
                     f"refused {got['refused']}, preemptions "
                     f"{got['counters']['specdecode:num_preemptions_total']:.0f}, wall {got['seconds']:.0f} s; "
                     f"second turns: prefix hit rate {got['turn2_hit_rate']:.1%}, wall {got['turn2_seconds']:.0f} s")
    for name in ("shared_speculation", "shared_plain"):
        got = report[name]
        lines.append(f"  {name}: prefix hit rate after the first request {got['hit_rate_after_first']:.1%}, peak "
                     f"running {got['peaks'].get('specdecode:num_requests_running', 0):.0f}, wall {got['seconds']:.0f} s")
    lines.append(f"  shared answers identical with and without speculation: {report['shared_answers_identical']}")
    return "\n".join(lines)


def cmd_sessions(args) -> int:
    extra = args.server_args.split() if args.server_args else []
    report = run(args.model, args.sessions, args.prompt_tokens, args.max_tokens, args.shared, extra)
    text = summary(report)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sessions.json").write_text(json.dumps(report, indent=1))
        (out / "sessions.txt").write_text(text + "\n")
        _plot(report, out / "sessions.png")
    ok = report["sessions_paged"]["refused"] == 0 and report["shared_answers_identical"]
    return 0 if ok else 1


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    layouts = ["paged", "slots"]
    left.bar(layouts, [report[f"sessions_{l}"]["peaks"].get("specdecode:num_requests_running", 0) for l in layouts],
             color=["tab:blue", "tab:gray"])
    left.set_title(f"sessions running at once (of {report['sessions']})")
    names = ["shared_speculation", "shared_plain"]
    right.bar(["speculation on", "off"], [100 * report[n]["hit_rate_after_first"] for n in names],
              color=["tab:green", "tab:gray"])
    right.set_ylim(0, 100)
    right.set_title("prefix hit rate after the first request (%)")
    fig.suptitle(f"{report['model']}: paged KV cache, live server")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
