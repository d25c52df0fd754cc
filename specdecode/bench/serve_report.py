"""Render `specdecode bench serve` results: serve_results.json, serve_report.md and serve.png (TTFT, TPOT and
output-token throughput against load, one line per server)."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402


def serve_table(runs: list[dict]) -> str:
    lines = ["| server | load | done | req/s | output tok/s | goodput req/s | TTFT p50 / p90 / p99 ms | "
             "TPOT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | server CPU-s per 1M tokens |",
             "|---|---|---:|---:|---:|---:|---|---|---|---:|"]
    for r in runs:
        def pct(name: str) -> str:
            return " / ".join(f"{r[f'p{q}_{name}_ms']:.0f}" if name == "ttft" else f"{r[f'p{q}_{name}_ms']:.1f}"
                              for q in (50, 90, 99))
        cpu = f"{r['cpu_s_per_million_tokens']:,.0f}" if "cpu_s_per_million_tokens" in r else "-"
        lines.append(f"| {r['target']} | {r['load']} | {r['completed']}/{r['requests']} | "
                     f"{r['request_throughput']:.2f} | {r['output_token_throughput']:.1f} | {r['goodput']:.2f} | "
                     f"{pct('ttft')} | {pct('tpot')} | {pct('itl')} | {cpu} |")
    return "\n".join(lines)


def plot_serve(runs: list[dict], path: Path) -> None:
    targets = list(dict.fromkeys(r["target"] for r in runs))
    loads = list(dict.fromkeys(r["load"] for r in runs))
    fig, axes = plt.subplots(1, 3, figsize=(13.0, 3.8))
    for target in targets:
        rows = [next(r for r in runs if r["target"] == target and r["load"] == load) for load in loads]
        for ax, key in zip(axes, ("p50_ttft_ms", "p50_tpot_ms", "output_token_throughput")):
            ax.plot(range(len(loads)), [r[key] for r in rows], marker="o", label=target)
    for ax, title in zip(axes, ("TTFT p50 (ms)", "TPOT p50 (ms)", "output tokens/s")):
        ax.set_xticks(range(len(loads)), loads, fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def serve_markdown(results: dict) -> str:
    s = results["settings"]
    where = (f"against `{s['base_url']}`" if s.get("base_url") else
             "against `specdecode serve` subprocesses started by the benchmark, one per mode: " +
             "; ".join(f"{m}: `{c}`" for m, c in results.get("servers", {}).items()))
    parts = ["# specdecode bench serve",
             f"Requests: {len(results['requests'])} held-out ShareGPT first turns (max_tokens = the reference "
             f"answer's length, at most {s['max_tokens_cap']}), streamed chat completions at temperature "
             f"{s['temperature']:g}, {where}. Bounded at {s['num_requests']} requests and {s['max_seconds']:.0f} s per "
             f"server and load; every server takes its turn at each load. Goodput SLO: TTFT <= {s['slo_ttft_ms']:.0f} "
             f"ms and TPOT <= {s['slo_tpot_ms']:.0f} ms. Whole run {results['wall_seconds']:.0f} s"
             + (". Load average {:.2f} at the start, {:.2f} at the end.".format(*results["load_average"])
                if results.get("load_average") else ".")
             + (f" {s['note']}" if s.get("note") else ""),
             serve_table(results["runs"]),
             "TTFT: request sent -> first streamed text; TPOT: (last - first token) / (tokens - 1) per request; ITL: "
             "gaps between streamed chunks (a chunk carries every token a step accepted); server CPU: the server "
             "process's user + system time during the load.",
             "![TTFT, TPOT and throughput against load](serve.png)"]
    return "\n\n".join(parts) + "\n"


def write_serve_report(results: dict, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"results": out / "serve_results.json", "report": out / "serve_report.md", "plot": out / "serve.png"}
    paths["results"].write_text(json.dumps(results, indent=1, default=str))
    plot_serve(results["runs"], paths["plot"])
    paths["report"].write_text(serve_markdown(results))
    return paths
