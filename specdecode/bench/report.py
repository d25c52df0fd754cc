"""Render `specdecode bench` results: results.json, report.md and PNG plots (speedup per engine and workload,
speedup against batch size, histogram of accepted draft lengths)."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

from specdecode.bench.sweep import markdown_table  # noqa: E402

PLOTS = {"speedup": "speedup.png", "sweep": "batch_sweep.png", "accepted": "accepted_length.png"}

DEFINITIONS = """\
- **tokens/s**: generated tokens / wall time of the generate calls (prefill included), prompts one at a time.
- **speedup**: tokens/s over the same library's plain decoding, measured in this run on the same prompts.
- **tokens/step**: tokens emitted per target forward (accepted draft tokens + 1); **acceptance**: accepted /
  proposed draft tokens.
- **draft / verify / other**: shares of wall time spent proposing, in target passes with verification and
  commit (prefill included), and elsewhere (scheduling, detokenising, Python).
- **p50 / p99 latency**: per generated token after the first. A step that delivers n tokens dt seconds after the
  previous delivery counts n tokens of dt / n each, so speculation's bursts and plain decoding's single tokens
  are measured by one rule. **TTFT**: mean time to the first token.
- **same as plain**: prompts whose tokens equal specdecode plain decoding's, token for token. Greedy
  speculation is exact, so every specdecode method must match on every prompt; transformers runs the same
  checkpoint, so it matches unless its float rounding flips a near-tie."""


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _ms(x: float) -> str:
    return f"{1000 * x:.2f}"


def machine_line(results: dict) -> str:
    m = results["machine"]
    line = (f"{m['cpu']} ({m['cpu_count']} cores), device {m['device']}{', ' + m['gpu'] if 'gpu' in m else ''}, "
            f"torch {m['torch']} with {m['torch_threads']} thread(s), Python {m['python']}")
    if "transformers" in m:
        line += f", transformers {m['transformers']}"
    if "load_average_start" in m:
        line += (f"; load average {m['load_average_start']:.2f} at the start, "
                 f"{m.get('load_average_end', float('nan')):.2f} at the end")
    if results["settings"].get("note"):
        line += f". {results['settings']['note']}"
    return line


def engine_table(results: dict) -> str:
    labels = results["labels"]
    lines = ["| workload | engine | tokens/s | speedup | tokens/step | acceptance | draft / verify / other "
             "| p50 ms | p99 ms | TTFT ms | same as plain |",
             "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for workload, rows in results["workloads"].items():
        for name, r in rows.items():
            speculative = "steps" in r and name != "plain"  # specdecode's speculative engines
            cells = [workload, labels.get(name, name), f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
                     f"{r['mean_accepted_len']:.2f}" if speculative else "-",
                     _pct(r["acceptance_rate"]) if speculative else "-",  # None: nothing was drafted
                     f"{_pct(r['draft_share'])} / {_pct(r['verify_share'])} / {_pct(r['other_share'])}"
                     if "draft_share" in r else "-",
                     _ms(r["latency_p50_s"]), _ms(r["latency_p99_s"]), _ms(r["ttft_mean_s"]),
                     f"{r['same_as_plain']}/{r['prompts']}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def peer_table(results: dict) -> str:
    lines = ["| workload | ours plain / theirs | ours draft / their assisted (goal >= 1.5) | speedup: ours draft, "
             "their assisted (goal: ours >= theirs) | best of ours / their assisted | ours n-gram / their "
             "prompt lookup | speedup: ours n-gram, their prompt lookup |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for workload, cmp in results["peers"].items():
        plain = cmp.get("plain_vs_hf_plain")
        draft = cmp.get("draft_chain_vs_hf_assisted")
        ngram = cmp.get("ngram_vs_hf_prompt_lookup")
        cells = [f"{plain['tokens_per_s_ratio']:.2f}x" if plain else "-"]
        if draft:
            cells += [f"{draft['tokens_per_s_ratio']:.2f}x {'(met)' if draft['goal_tokens_per_s'] else '(NOT met)'}",
                      f"{draft['our_speedup']:.2f}x vs {draft['their_speedup']:.2f}x "
                      f"{'(met)' if draft['goal_speedup'] else '(NOT met)'}",
                      f"{draft['best_ours_ratio']:.2f}x"]
        else:
            cells += ["-"] * 3
        if ngram:
            cells += [f"{ngram['tokens_per_s_ratio']:.2f}x",
                      f"{ngram['our_speedup']:.2f}x vs {ngram['their_speedup']:.2f}x"]
        else:
            cells += ["-"] * 2
        lines.append(f"| {workload} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def roofline_text(r: dict) -> str:
    return (f"Memory read bandwidth (sum over a 512 MiB tensor, best of 5): **{r['bandwidth_gb_s']:.1f} GB/s**. "
            f"A batch-1 decode step reads {r['weight_bytes'] / 1e6:.1f} MB of weights and "
            f"{r['kv_bytes'] / 1e6:.2f} MB of KV cache (mean context {r['mean_context_len']:.0f} tokens), so the "
            f"memory-bound ceiling is {r['ceiling_tokens_per_s']:.0f} tokens/s; specdecode plain decoding "
            f"measured {r['plain_tokens_per_s']:.1f} tokens/s, **{100 * r['share']:.0f}% of the ceiling**.")


def plot_speedup(results: dict, path: Path) -> None:
    labels = results["labels"]
    workloads = list(results["workloads"])
    engines = [n for n in results["workloads"][workloads[0]] if n not in ("plain", "hf_plain")]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(workloads)) + 3.5, 4.2))
    width = 0.8 / max(1, len(engines))
    for i, name in enumerate(engines):
        xs = [j + (i - (len(engines) - 1) / 2) * width for j in range(len(workloads))]
        ax.bar(xs, [results["workloads"][w][name]["speedup"] for w in workloads], width,
               label=labels.get(name, name), hatch="//" if name.startswith("hf_") else None)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("speedup over the same library's plain decoding")
    ax.set_title("Speculative decoding speedup, batch 1, greedy")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(rows: list[dict], path: Path) -> None:
    batches = list(dict.fromkeys(r["batch_size"] for r in rows))
    modes = [r["mode"] for r in rows if r["batch_size"] == batches[0] and r["mode"] not in ("summary", "plain")]
    fig, ax = plt.subplots(figsize=(6.0, 4.2))
    for mode in modes:
        ys = [next(r["vs_plain"] for r in rows if r["batch_size"] == b and r["mode"] == mode) for b in batches]
        ax.plot(batches, ys, marker="o", linewidth=2.5 if mode == "adaptive" else 1.2, label=mode)
    ax.axhline(1.0, color="black", linewidth=0.8, label="plain")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s over plain decoding")
    ax.set_title("Where speculation stops paying")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_accepted(results: dict, path: Path) -> None:
    labels = results["labels"]
    rows = {n: r for n, r in results["workloads"]["all"].items() if r.get("accepted_len_counts")}
    fig, ax = plt.subplots(figsize=(6.0, 4.2))
    width = 0.8 / max(1, len(rows))
    for i, (name, r) in enumerate(rows.items()):
        counts = r["accepted_len_counts"]
        total = sum(counts)
        xs = [n + (i - (len(rows) - 1) / 2) * width for n in range(len(counts))]
        ax.bar(xs, [c / total for c in counts], width, label=labels.get(name, name))
    ax.set_xlabel("draft tokens accepted in a step")
    ax.set_ylabel("share of drafting steps")
    ax.set_title("Accepted length, all workloads")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(results: dict) -> str:
    s = results["settings"]
    parts = [
        "# specdecode bench",
        f"Machine: {machine_line(results)}. Whole run: {results['machine'].get('wall_seconds', 0):.0f} s.",
        f"Target `{s['target']}`, draft `{s['draft']}`, {s['dtype']}; {s['prompts']} prompts per workload, "
        f"{s['max_tokens']} new tokens each, greedy, batch 1, EOS ignored; every engine runs every prompt in turn.",
        "## Speed per engine and workload", engine_table(results), DEFINITIONS,
        f"![speedup per engine and workload]({PLOTS['speedup']})",
    ]
    if results.get("peers"):
        parts += ["## Against Hugging Face transformers (same checkpoints, same prompt ids, same run)",
                  peer_table(results),
                  "transformers settings: " + "; ".join(
                      f"{name}: " + ", ".join(f"{k}={v}" for k, v in cfg.items() if k != "mode")
                      for name, cfg in results["peer_settings"].items() if len(cfg) > 1)]
    if results.get("sweep"):
        parts += [f"## Batch-size sweep: plain vs fixed K vs adaptive (decode tokens/s; "
                  f"{s['sweep_prompt_tokens']}-token prompts, {s['sweep_max_tokens']} new tokens per request, "
                  f"median of {s['sweep_repeats']})",
                  markdown_table(results["sweep"]),
                  f"![speedup against batch size]({PLOTS['sweep']})"]
    parts += ["## Roofline", roofline_text(results["roofline"]),
              "## Accepted length", f"![histogram of accepted length]({PLOTS['accepted']})"]
    return "\n\n".join(parts) + "\n"


def write_report(results: dict, out: Path) -> dict[str, Path]:
    """Write results.json, report.md and the plots into `out`; returns their paths by name."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"results": out / "results.json", "report": out / "report.md"}
    paths["results"].write_text(json.dumps(results, indent=1, default=str))
    paths["speedup"] = out / PLOTS["speedup"]
    plot_speedup(results, paths["speedup"])
    if results.get("sweep"):
        paths["sweep"] = out / PLOTS["sweep"]
        plot_sweep(results["sweep"], paths["sweep"])
    paths["accepted"] = out / PLOTS["accepted"]
    plot_accepted(results, paths["accepted"])
    paths["report"].write_text(markdown(results))
    return paths
