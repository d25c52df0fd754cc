"""`specdecode bench serve --mix assistant`: a code assistant's traffic against one server at a time - many short
chat turns and, now and then, a file-sized prompt - in closed loops for a fixed time, and what each class of
request sees.

- short: `--streams` closed loops of the coding questions we ship (workloads/code_problems.json), each answer at most
  `--max-tokens-cap` tokens;
- long: `--long-streams` closed loops of a held-out standard-library file (workloads/heldout.json: the interpreter's
  own files, so nothing is downloaded), cut to `--long-tokens` tokens, and a question about it; `--long-max-tokens`
  tokens out. Each long request is a different file, so no prefix cache serves it.

Per class: requests done, time to first token and the gaps between streamed chunks (p50/p90/p99), TPOT p50; over all
streams the output tokens per second. Any OpenAI-compatible --base-url (llama-server too) is measured the same way.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import sysconfig
import time
from pathlib import Path

import httpx

from specdecode.bench.measure import percentile
from specdecode.bench.serve import Outcome, Request, _one

QUESTION = "\n\nWhat does this file do, and what is its most important function? Answer in three sentences."
CLASSES = ("short", "long")


@dataclasses.dataclass
class MixOutcome:
    """One request of the mix: its class, when it was sent (seconds after the start) and what it did."""

    kind: str
    sent: float
    outcome: Outcome
    cut_off: bool = False
    """Still running at max_seconds (neither done nor failed): outcome.ttft is its time to first text if it had shown
    any (outcome.output_tokens 1), else its wait so far (output_tokens 0)."""


def short_requests(max_tokens: int) -> list[Request]:
    """The coding questions we ship, as one-turn chats."""
    from specdecode.bench.workloads import WORKLOAD_DIR

    problems = json.loads((WORKLOAD_DIR / "code_problems.json").read_text())["problems"]
    return [Request([{"role": "user", "content": p["prompt"]}], max_tokens, f"code_problems:{p['id']}")
            for p in problems]


def long_requests(tokenizer, tokens: int, max_tokens: int) -> list[Request]:
    """Held-out standard-library files of at least `tokens` tokens, each cut to `tokens` tokens of its start (whole
    lines) and followed by QUESTION."""
    from specdecode.bench.workloads import heldout_files

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for rel in sorted(heldout_files()):
        try:
            text = (stdlib / rel).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < tokens:
            continue
        cut = tokenizer.decode(ids[:tokens])
        cut = cut[:cut.rfind("\n") + 1] or cut
        out.append(Request([{"role": "user", "content": f"```python\n{cut}```{QUESTION}"}], max_tokens,
                           f"stdlib:{rel}"))
    return out


async def run_mix(base_url: str, model: str, short: list[Request], long: list[Request], streams: int,
                  long_streams: int, max_seconds: float, temperature: float = 0.0,
                  api_key: str | None = None) -> tuple[list[MixOutcome], float]:
    """Every stream sends its class's requests one after another (stream i starts at request i, long ones each a
    different file) until max_seconds; requests still running then are cut off and not counted."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=streams + long_streams + 1)
    done: list[MixOutcome] = []
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(max_seconds)) as client:
        start = time.perf_counter()

        async def loop(kind: str, requests: list[Request], first: int, step: int) -> None:
            i = first
            while time.perf_counter() - start < max_seconds:
                sent = time.perf_counter() - start
                progress = {}
                try:
                    outcome = await asyncio.wait_for(_one(client, model, requests[i % len(requests)], temperature,
                                                          progress), max(0.0, max_seconds - sent))
                except asyncio.TimeoutError:  # cut off: what it had shown by then
                    first = progress.get("ttft")
                    shown = Outcome(False, max_seconds - sent, error="cut off at max_seconds") if first is None else \
                        Outcome(False, first, output_tokens=1, error="cut off at max_seconds")
                    done.append(MixOutcome(kind, sent, shown, cut_off=True))
                    return
                done.append(MixOutcome(kind, sent, outcome))
                i += step

        tasks = [asyncio.create_task(loop("short", short, i, streams)) for i in range(streams)]
        tasks += [asyncio.create_task(loop("long", long, i, long_streams)) for i in range(long_streams)]
        _, pending = await asyncio.wait(tasks, timeout=max_seconds + 5)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        seconds = time.perf_counter() - start
    return done, seconds


def summarise_mix(outcomes: list[MixOutcome], seconds: float) -> dict:
    """Per class and over all: requests done and failed, TTFT and chunk-gap percentiles (ms), TPOT p50, tokens/s."""
    out = {"seconds": seconds}
    for kind in CLASSES:
        mine = [m.outcome for m in outcomes if m.kind == kind and not m.cut_off]
        cut = [m for m in outcomes if m.kind == kind and m.cut_off]
        ok = [o for o in mine if o.ok]
        started = [m.outcome.ttft for m in cut if m.outcome.output_tokens]  # streaming at the end: a first token
        ttfts, gaps = [o.ttft for o in ok] + started, [g for o in ok for g in o.chunk_gaps]
        tpots = [o.tpot for o in ok if o.output_tokens > 1]
        row = {"done": len(ok), "failed": len(mine) - len(ok), "errors": sorted({o.error for o in mine if not o.ok})[:3],
               "cut_off": len(cut), "waiting_at_end_s": sorted(round(m.outcome.ttft, 1) for m in cut
                                                               if not m.outcome.output_tokens),
               "output_tokens": sum(o.output_tokens for o in ok), "p50_tpot_ms": 1000 * percentile(tpots, 50)}
        for q in (50, 90, 99):
            row[f"p{q}_ttft_ms"] = 1000 * percentile(ttfts, q)
            row[f"p{q}_gap_ms"] = 1000 * percentile(gaps, q)
        row["ttfts_ms"] = [round(1000 * t, 1) for t in ttfts]
        row["gaps_ms"] = [round(1000 * g, 1) for g in gaps]
        out[kind] = row
    out["output_tokens_per_s"] = sum(out[k]["output_tokens"] for k in CLASSES) / seconds if seconds else 0.0
    return out


def write_mix_report(results: dict, out: Path) -> dict[str, Path]:
    """mix_results.json, mix_report.md and mix.png (the distributions of every target's TTFT and chunk gaps per class,
    on one figure) in `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = {"results": out / "mix_results.json", "report": out / "mix_report.md", "plot": out / "mix.png"}
    paths["results"].write_text(json.dumps(results, indent=1) + "\n")
    lines = [f"# `bench serve --mix assistant`: {results['settings'].get('note') or ''}".rstrip(), "",
             f"CPU: {results.get('cpu', '?')}; {results['settings']['streams']} short streams, "
             f"{results['settings']['long_streams']} long stream(s) of {results['settings']['long_tokens']}-token files, "
             f"{results['settings']['max_seconds']:.0f} s per target.", "",
             "| target | output tok/s | short done (cut off) | short TTFT p50 / p90 / p99 (s) | short gap p50 / p99 (ms) "
             "| long done (cut off) | long TTFT p50 / p99 (s) | still waiting for a first token at the end (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]

    def seconds(row, *qs, digits=2):
        return " / ".join(f"{row[f'p{q}_ttft_ms'] / 1000:.{digits}f}" for q in qs) if row["ttfts_ms"] else "-"

    for name, run in results["runs"].items():
        s, lg = run["short"], run["long"]
        waiting = ", ".join(f"{k} {w:g}" for k in CLASSES for w in run[k].get("waiting_at_end_s", [])) or "-"
        gaps = f"{s['p50_gap_ms']:.0f} / {s['p99_gap_ms']:.0f}" if s["gaps_ms"] else "-"
        lines.append(f"| {name} | {run['output_tokens_per_s']:.1f} | {s['done']} ({s.get('cut_off', 0)}) | "
                     f"{seconds(s, 50, 90, 99)} | {gaps} | {lg['done']} ({lg.get('cut_off', 0)}) | "
                     f"{seconds(lg, 50, 99, digits=1)} | {waiting} |")
    paths["report"].write_text("\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, run in results["runs"].items():
        for ax, (kind, key, label) in zip(axes, (("short", "ttfts_ms", "short requests: time to first token (s)"),
                                                 ("short", "gaps_ms", "short requests: gap between chunks (s)"),
                                                 ("long", "ttfts_ms", "long requests: time to first token (s)"))):
            values = sorted(v / 1000 for v in run[kind][key])
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name,
                        marker="o" if len(values) < 20 else None)  # (a class with few requests: its points)
            ax.set_xlabel(label)
            ax.set_xscale("log")
    axes[0].set_ylabel("fraction of requests (or gaps) at most")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(paths["plot"], dpi=110)
    plt.close(fig)
    return paths
