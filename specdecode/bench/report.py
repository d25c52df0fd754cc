"""Render `specdecode bench` results: results.json, report.md and PNG plots (speedup per engine and workload,
speedup against batch size, histogram of accepted draft lengths)."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

from specdecode.bench.sweep import GOAL, markdown_table  # noqa: E402

PLOTS = {"speedup": "speedup.png", "sweep": "batch_sweep.png", "accepted": "accepted_length.png"}

DEFINITIONS = """\
- **tokens/s**: generated tokens / wall time of the requests (prefill included), prompts one at a time.
- **vs plain**: tokens/s over specdecode's plain decoding; **vs own plain**: over the same library's plain
  decoding; both measured in this run on the same prompts.
- **tokens per target pass**: tokens emitted per target forward (accepted draft tokens + 1); **acceptance**:
  accepted / proposed draft tokens (a tree counts every node).
- **draft / verify / other**: shares of wall time spent proposing, in target passes with verification and
  commit (prefill included), and elsewhere (scheduling, detokenising, Python).
- **p50 / p99 latency**: per generated token after the first. A step that delivers n tokens dt seconds after the
  previous delivery counts n tokens of dt / n each, so speculation's bursts and plain decoding's single tokens
  are measured by one rule. **TTFT**: mean time to the first token.
- **same as plain**: prompts whose tokens equal specdecode plain decoding's, token for token. At T=0 speculation
  is exact, so every specdecode method must match on every prompt (transformers runs the same checkpoint, so it
  matches unless its float rounding flips a near-tie); at T=1 outputs are samples and differ.
- **tokens/s per core**: output tokens per second of the process's CPU time (all its threads), i.e. per core
  kept busy; **CPU-seconds per 1M output tokens** is its inverse, the figure for a budget."""


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


def _label(name: str, labels: dict) -> str:
    """An engine's label; `<method> fixed` rows (fixed K) are labelled after their method."""
    base, _, fixed = name.partition(" ")
    return labels.get(name) or (f"{labels.get(base, base)}, fixed K" if fixed else name)


def _engine_cells(name: str, r: dict, labels: dict) -> list[str]:
    speculative = "steps" in r and name != "plain"  # specdecode's speculative engines
    return [_label(name, labels), f"{r['tokens_per_s']:.1f}", f"{r['vs_plain']:.2f}x", f"{r['speedup']:.2f}x",
            f"{r['mean_accepted_len']:.2f}" if speculative else "-",
            _pct(r["acceptance_rate"]) if speculative else "-",  # None: nothing was drafted
            f"{_pct(r['draft_share'])} / {_pct(r['verify_share'])} / {_pct(r['other_share'])}"
            if "draft_share" in r else "-",
            _ms(r["latency_p50_s"]), _ms(r["latency_p99_s"]), _ms(r["ttft_mean_s"]), str(r["tokens"]),
            f"{r['same_as_plain']}/{r['prompts']}"]


ENGINE_HEADER = ("| engine | tokens/s | vs plain | vs own plain | tokens per target pass | acceptance | "
                 "draft / verify / other | p50 ms | p99 ms | TTFT ms | tokens | same as plain |\n"
                 "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|")


def engine_table(rows: dict[str, dict], labels: dict) -> str:
    """Every engine's figures on one set of prompts."""
    return "\n".join([ENGINE_HEADER] + ["| " + " | ".join(_engine_cells(n, r, labels)) + " |" for n, r in rows.items()])


def category_matrix(table: dict[str, dict[str, dict]], labels: dict, key: str = "vs_plain",
                    fmt: str = "{:.2f}x") -> str:
    """Engines down, categories across: one figure (default: tokens/s over specdecode plain)."""
    categories = list(table)
    engines = list(table[categories[0]])
    lines = ["| engine | " + " | ".join(f"{c} ({table[c]['plain']['prompts']})" for c in categories) + " |",
             "|---|" + "---:|" * len(categories)]
    for name in engines:
        cells = []
        for c in categories:
            value = table[c][name].get(key)
            cells.append("-" if value is None or (key == "mean_accepted_len" and "steps" not in table[c][name])
                         else fmt.format(value))
        lines.append(f"| {_label(name, labels)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def source_table(results: dict) -> str:
    """Draft tokens each source of a combining engine proposed in verified trees, and how many were accepted (a
    token two sources proposed counts for both)."""
    lines = ["| engine | source | proposed | accepted | acceptance |", "|---|---|---:|---:|---:|"]
    for name, counts in results["sources"].items():
        for source, c in counts.items():
            share = f"{c['accepted'] / c['proposed']:.0%}" if c["proposed"] else "-"
            lines.append(f"| {_label(name, results['labels'])} | {source} | {c['proposed']} | {c['accepted']} | "
                         f"{share} |")
    return "\n".join(lines)


def cost_table(rows: dict[str, dict], labels: dict) -> str:
    """The cost line: output tokens per CPU-second (= per core kept busy) and CPU-seconds per million tokens."""
    lines = ["| engine | tokens/s per core | CPU-seconds per 1M output tokens | vs plain |", "|---|---:|---:|---:|"]
    plain = rows["plain"].get("cpu_s_per_million_tokens")
    for name, r in rows.items():
        if "tokens_per_cpu_s" in r:
            lines.append(f"| {_label(name, labels)} | {r['tokens_per_cpu_s']:.1f} | "
                         f"{r['cpu_s_per_million_tokens']:,.0f} | {plain / r['cpu_s_per_million_tokens']:.2f}x |")
    return "\n".join(lines)


def sweep_cost_table(rows: list[dict]) -> str:
    lines = ["| B | plain: tokens/s per core | CPU-s per 1M tokens | adaptive: tokens/s per core | "
             "CPU-s per 1M tokens |",
             "|---|---:|---:|---:|---:|"]
    for b in dict.fromkeys(r["batch_size"] for r in rows):
        of_b = {r["mode"]: r for r in rows if r["batch_size"] == b}
        p, a = of_b["plain"]["tokens_per_cpu_s"], of_b["adaptive"]["tokens_per_cpu_s"]
        lines.append(f"| {b} | {p:.1f} | {1e6 / p:,.0f} | {a:.1f} | {1e6 / a:,.0f} |")
    return "\n".join(lines)


def peer_table(results: dict) -> str:
    lines = ["| T | category | ours plain / theirs | ours draft model / their assisted | speedup: ours draft model, "
             "their assisted | best of ours / their assisted | ours prompt lookup / theirs | speedup: ours, theirs |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for temperature, by_category in results["peers"].items():
        for category, cmp in by_category.items():
            plain = cmp.get("plain_vs_hf_plain")
            draft = cmp.get("draft_model_vs_hf_assisted")
            ngram = cmp.get("ngram_vs_hf_prompt_lookup")
            cells = [f"{plain['tokens_per_s_ratio']:.2f}x" if plain else "-"]
            cells += ([f"{draft['tokens_per_s_ratio']:.2f}x",
                       f"{draft['our_speedup']:.2f}x vs {draft['their_speedup']:.2f}x",
                       f"{draft['best_ours_ratio']:.2f}x"] if draft else ["-"] * 3)
            cells += ([f"{ngram['tokens_per_s_ratio']:.2f}x",
                       f"{ngram['our_speedup']:.2f}x vs {ngram['their_speedup']:.2f}x"]
                      if ngram else ["-"] * 2)
            lines.append(f"| {temperature} | {category} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def roofline_text(r: dict) -> str:
    return (f"Memory read bandwidth (sum over a 512 MiB tensor, best of 5): **{r['bandwidth_gb_s']:.1f} GB/s**. "
            f"A batch-1 decode step reads {r['weight_bytes'] / 1e6:.1f} MB of weights and "
            f"{r['kv_bytes'] / 1e6:.2f} MB of KV cache (mean context {r['mean_context_len']:.0f} tokens), so the "
            f"memory-bound ceiling is {r['ceiling_tokens_per_s']:.0f} tokens/s; specdecode plain decoding "
            f"measured {r['plain_tokens_per_s']:.1f} tokens/s, **{100 * r['share']:.0f}% of the ceiling**.")


def plot_speedup(results: dict, path: Path) -> None:
    """Tokens/s over specdecode plain per engine and category, one panel per temperature."""
    labels = results["labels"]
    tables = results["per_request"]
    fig, axes = plt.subplots(len(tables), 1, figsize=(11.0, 3.6 * len(tables)), squeeze=False)
    for ax, (temperature, table) in zip(axes[:, 0], tables.items()):
        categories = list(table)
        engines = [n for n in table[categories[0]] if n != "plain"]
        width = 0.8 / max(1, len(engines))
        for i, name in enumerate(engines):
            xs = [j + (i - (len(engines) - 1) / 2) * width for j in range(len(categories))]
            ax.bar(xs, [table[c][name]["vs_plain"] for c in categories], width, label=_label(name, labels),
                   hatch="//" if name.startswith("hf_") else None)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(categories)), categories)
        ax.set_ylabel("tokens/s over specdecode plain")
        ax.set_title(f"Per request, batch 1, {temperature}")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(rows: list[dict], path: Path) -> None:
    """Left: decode tokens/s against batch size per mode; right: the same over plain decoding."""
    batches = list(dict.fromkeys(r["batch_size"] for r in rows))
    modes = [r["mode"] for r in rows if r["batch_size"] == batches[0] and r["mode"] != "summary"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11.0, 4.2))
    for mode in modes:
        of_mode = [next(r for r in rows if r["batch_size"] == b and r["mode"] == mode) for b in batches]
        style = dict(marker="o", linewidth=2.5 if mode in ("adaptive", "plain") else 1.2, label=mode)
        left.plot(batches, [r["tokens_per_s"] for r in of_mode], **style)
        if mode != "plain":
            right.plot(batches, [r["vs_plain"] for r in of_mode], **style)
    right.axhline(1.0, color="black", linewidth=0.8, label="plain")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch size")
        ax.legend(fontsize=8)
    left.set_ylabel("decode tokens/s (all sequences)")
    right.set_ylabel("tokens/s over plain decoding")
    left.set_title("Throughput")
    right.set_title("Where speculation stops paying")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_accepted(results: dict, path: Path) -> None:
    labels = results["labels"]
    greedy = next(iter(results["per_request"].values()))["all"]
    rows = {n: r for n, r in greedy.items() if r.get("accepted_len_counts")}
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    width = 0.8 / max(1, len(rows))
    for i, (name, r) in enumerate(rows.items()):
        counts = r["accepted_len_counts"]
        total = sum(counts)
        xs = [n + (i - (len(rows) - 1) / 2) * width for n in range(len(counts))]
        ax.bar(xs, [c / total for c in counts], width, label=_label(name, labels))
    ax.set_xlabel("draft tokens accepted in a drafting step")
    ax.set_ylabel("share of drafting steps")
    ax.set_title(f"Accepted length, all categories, {next(iter(results['per_request']))}")
    if rows:  # none when nothing drafted (adaptive engines on a machine where drafting never pays)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def workload_lines(results: dict) -> str:
    lines = ["| category | prompts | mean prompt tokens | sources |", "|---|---:|---:|---|"]
    for category, prompts in results["prompts"].items():
        mean = sum(p["prompt_tokens"] for p in prompts) / len(prompts)
        sources = ", ".join(p["source"] for p in prompts[:4]) + (", ..." if len(prompts) > 4 else "")
        lines.append(f"| {category} | {len(prompts)} | {mean:.0f} | {sources} |")
    return "\n".join(lines)


def source_line(settings: dict) -> str:
    """Where the prompts came from."""
    if settings.get("workload_file"):
        return f"Prompts and categories from `{settings['workload_file']}`."
    if settings.get("stdlib_workloads"):
        return "Prompts: the code workloads from held-out standard-library files (`specdecode/bench/workloads.py`)."
    return "Categories by the rules in `specdecode/bench/categories.py` (held-out ShareGPT; translation: none present)."


def markdown(results: dict) -> str:
    s = results["settings"]
    labels = results["labels"]
    modes = "adaptive (K chosen per step, the default)" if s["adaptive"] else "fixed K"
    parts = [
        "# specdecode bench",
        f"Command: `{s.get('command') or 'specdecode bench'}`",
        f"Machine: {machine_line(results)}. Whole run: {results['machine'].get('wall_seconds', 0):.0f} s.",
        f"Target `{s['model'] or 'smollm2-135m-instruct'}` ({s['dtype']}); methods {', '.join(s['methods'])}, "
        f"each {modes}; up to {s['max_tokens']} new tokens per request (EOS ends it), batch 1; every engine runs "
        f"every prompt in turn, so speedups are ratios within this run.",
        "## Workloads", workload_lines(results),
        source_line(s),
    ]
    for temperature, table in results["per_request"].items():
        parts += [f"## Per request, {temperature}: all categories", engine_table(table["all"], labels),
                  f"### {temperature}: tokens/s over specdecode plain, per category", category_matrix(table, labels),
                  f"### {temperature}: tokens per target pass, per category",
                  category_matrix(table, labels, "mean_accepted_len", "{:.2f}")]
    if results.get("sources"):
        parts += ["## Sources of the combined trees (every temperature, warm-up included)", source_table(results)]
    parts += [DEFINITIONS, f"![speedup per engine and category]({PLOTS['speedup']})"]
    if results.get("peers"):
        parts += ["## Against Hugging Face transformers (same checkpoints, same prompt ids, same run)",
                  peer_table(results),
                  "transformers settings: " + "; ".join(
                      f"{name}: " + ", ".join(f"{k}={v}" for k, v in cfg.items() if k != "mode")
                      for name, cfg in results["peer_settings"].items())]
    first = next(iter(results["per_request"]))
    parts += ["## Cost", f"Process CPU time during each engine's requests ({first}, all categories; "
              f"{results['machine']['torch_threads']} torch thread(s)):",
              cost_table(results["per_request"][first]["all"], labels)]
    if results.get("sweep"):
        from specdecode.bench.sweep import fixed_k_stops_paying

        stop = fixed_k_stops_paying(results["sweep"])
        cpu_stop = fixed_k_stops_paying(results["sweep"], "cpu_best_fixed_vs_plain")
        parts += [f"Batch sweep, decode only ({s['sweep_method']}):", sweep_cost_table(results["sweep"]),
                  f"## Batch sizes: plain vs fixed K vs adaptive ({s['sweep_method']}; decode tokens/s, "
                  f"{s['sweep_prompt_tokens']}-token prompts, {s['sweep_max_tokens']} new tokens per request, EOS "
                  f"ignored, fastest of {s['sweep_repeats']})",
                  markdown_table(results["sweep"]),
                  "Fixed K stops paying (no fixed K beats plain from there on): wall clock "
                  + (f"from batch size **{stop}**" if stop else "nowhere measured") + ", CPU clock "
                  + (f"from batch size **{cpu_stop}**." if cpu_stop else "nowhere measured."),
                  f"Goal: adaptive >= {GOAL}x the better of plain and the best fixed K at every batch size. Wall clock: "
                  "the fastest run; CPU clock: the process's CPU time of the run that used least (other jobs on a "
                  "shared machine stretch wall time much more than CPU time).",
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
