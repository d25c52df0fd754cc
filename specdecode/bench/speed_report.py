"""Render the speed benchmark (speed.py): speed.json, speed.md (tables, goals) and speed.png (plots)."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

GOAL_NAMES = {"plain_fp32_vs_hf_fp32": "plain float32 / transformers float32 (tokens/s)",
              "plain_bf16_vs_hf_fp32": "plain bfloat16 / transformers float32 (tokens/s)",
              "roofline_share": "plain decode share of the memory roofline",
              "verify_5": "pass over 5 tokens / pass over 1 (upper bound)",
              "verify_8": "pass over 8 tokens / pass over 1 (upper bound)",
              "verify_9": "pass over 9 tokens / pass over 1 (upper bound)",
              "verify_16": "pass over 16 tokens / pass over 1 (upper bound)",
              "batch_8": "batch-8 plain throughput / batch 1",
              "plain_vs_llama_cpp_q8_0": "plain / llama.cpp plain Q8_0 (median decode tokens/s)",
              "plain_vs_llama_cpp_q4_1": "plain / llama.cpp plain Q4_1 (median decode tokens/s)",
              "speculative_vs_llama_cpp_q4_1": "default speculation / llama.cpp plain Q4_1 (median decode tokens/s)"}


CLOCK_NAMES = {"wall": "wall clock", "cpu": "CPU time of the one thread that runs everything (time.thread_time: "
                "the machine is shared, and this leaves out the time spent waiting for a core)"}


def machine_line(results: dict) -> str:
    m = results["machine"]
    line = (f"{m['cpu']} ({m['cpu_count']} cores, native bfloat16: {'yes' if m['native_bf16'] else 'no'}), "
            f"device {m['device']}, torch {m['torch']} with {m['torch_threads']} thread(s)")
    if "transformers" in m:
        line += f", transformers {m['transformers']}"
    if "load_average_start" in m:
        line += f"; load average {m['load_average_start']:.1f} at the start, {m['load_average_end']:.1f} at the end"
    return line + f"; {m['wall_seconds']:.0f} s in all."


def decode_table(results: dict) -> str:
    hf = results["decode"].get("transformers float32")
    lines = ["| configuration | tokens/s (best) | median | vs transformers fp32 | forward ms (1 token) "
             "| bytes/step | roofline tokens/s | share (engine) | share (forward) | same tokens as first |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results["decode"].items():
        ratio = f"{r['tokens_per_s'] / hf['tokens_per_s']:.2f}x" if hf else "-"
        if "backend" in r:
            cells = [f"{r['forward_ms']:.2f}", f"{r['bytes_per_step'] / 1e6:.0f} MB", f"{r['ceiling_tokens_per_s']:.0f}",
                     f"{100 * r['roofline_share']:.0f}%", f"{100 * r['forward_roofline_share']:.0f}%",
                     "yes" if r["same_as_first"] else "no"]
        else:
            cells = ["-"] * 6
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['median_tokens_per_s']:.1f} | {ratio} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def verify_table(results: dict) -> str:
    """Ours by K, and llama.cpp's `llama-bench -p K` beside them when the run had a llama.cpp build."""
    names = list(results["verify"])
    ks = sorted(int(k) for k in next(iter(results["verify"].values()))["relative"])
    theirs = (results.get("vs_llama_cpp") or {}).get("pass_costs") or {}
    head = [f"{n} (ms, x one; memory, int8 limits)" for n in names] + (
        ["llama.cpp llama-bench -p K (ms, x one)"] if theirs else [])
    lines = ["| K | " + " | ".join(head) + " |", "|---:|" + "---:|" * len(head)]

    def limits(v: dict, k: int) -> str:  # the shares of the memory and arithmetic limits the pass reaches
        memory, arithmetic = v.get("memory_share"), v.get("arithmetic_share")
        if memory is None:
            return ""
        return f"; {100 * _get(memory, k):.0f}%, " + (f"{100 * _get(arithmetic, k):.0f}%" if arithmetic else "-")

    for k in ks:
        cells = [f"{1000 * _get(results['verify'][n]['seconds'], k):.2f} ms, "
                 f"{_get(results['verify'][n]['relative'], k):.2f}x" + limits(results["verify"][n], k) for n in names]
        if theirs:
            cells.append(f"{1000 * _get(theirs, k):.2f} ms, {_get(theirs, k) / _get(theirs, 1):.2f}x"
                         if k in theirs or str(k) in theirs else "-")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _get(d: dict, k: int):
    return d[k] if k in d else d[str(k)]  # int keys in memory, str keys after JSON


def goals_table(results: dict) -> str:
    lines = ["| goal | configuration | measured | target | met |", "|---|---|---:|---:|---|"]
    for g in results["goals"]:
        share = g["goal"] == "roofline_share"
        value = f"{100 * g['value']:.0f}%" if share else f"{g['value']:.2f}x"
        target = f"{'<=' if g['goal'].startswith('verify_') else '>='} " + (f"{100 * g['target']:.0f}%" if share
                                                                     else f"{g['target']}x")
        lines.append(f"| {GOAL_NAMES.get(g['goal'], g['goal'])} | {g['config']} | {value} | {target} | "
                     f"{'yes' if g['met'] else '**no**'} |")
    return "\n".join(lines)


def batch_table(results: dict) -> str:
    lines = ["| configuration | batch 1 tokens/s | batch N tokens/s | N | ratio |", "|---|---:|---:|---:|---:|"]
    for name, b in results["batch"].items():
        lines.append(f"| {name} | {b['batch1_tokens_per_s']:.1f} | {b['batch_tokens_per_s']:.1f} | {b['batch']} | "
                     f"{b['ratio']:.2f}x |")
    return "\n".join(lines)


def speculation_table(results: dict) -> str:
    spec = results["speculation"]
    lines = [f"Prompt lookup (`ngram`, K = 8) against plain decoding on a {spec['prompt_tokens']}-token request whose "
             "answer copies the prompt (add type hints to a function), per configuration:", "",
             "| configuration | plain tokens/s | ngram tokens/s | speedup | acceptance | same tokens |",
             "|---|---:|---:|---:|---:|---|"]
    for name, r in spec["rows"].items():
        acceptance = "-" if r["acceptance_rate"] is None else f"{100 * r['acceptance_rate']:.0f}%"
        lines.append(f"| {name} | {r['plain_tokens_per_s']:.1f} | {r['ngram_tokens_per_s']:.1f} | {r['speedup']:.2f}x "
                     f"| {acceptance} | {'yes' if r['same_tokens'] else 'no'} |")
    return "\n".join(lines)


def llama_cpp_table(results: dict) -> str:
    peer = results["vs_llama_cpp"]
    same = peer["same_prompt_ids"]
    lines = [f"Greedy decoding of {len(same)} held-out chat prompts across categories, "
             f"{results['settings']['tokens']} tokens each, one thread, every engine once per round, prompt by prompt "
             f"(the fastest of {results['settings']['rounds']} rounds counts). Prompt token ids identical in "
             f"llama.cpp (llama-tokenize of our rendered chat template): **{sum(same.values())}/{len(same)}** prompts. "
             "Decode tokens/s = tokens after the first / seconds after the first token (llama.cpp: its eval and "
             "sampling time; llama-lookup: its decode time); ratios are per prompt, to "
             f"`{peer['reference']}`; llama.cpp lookup drafts at most {peer['draft']} tokens, ours is "
             f"`{peer['spec_config']}`. *Same text*: prompts whose greedy text is the reference's (over the shorter), "
             "and the median number of leading characters the two share.", "",
             f"| engine | mode | format | decode tokens/s (median) | vs {peer['reference']} (median) | range | "
             "prompt tokens/s (median) | acceptance | same text |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in peer["rows"]:
        acceptance = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
        lines.append(f"| {r['engine']} | {r['mode']} | {r['format']} | {r['decode_tokens_per_s']:.1f} | "
                     f"{r['ratio_median']:.2f}x | {r['ratio_min']:.2f}-{r['ratio_max']:.2f}x | "
                     f"{r['prompt_tokens_per_s']:.0f} | {acceptance} | {r['same_text']}/{r['prompts']} "
                     f"({r['shared_chars']:.0f} chars) |")
    names = [r["name"] for r in peer["rows"]]
    by_prompt: dict[str, dict] = {}
    for run in peer["runs"]:
        by_prompt.setdefault(run["prompt"], {})[f"{run['engine']} {run['mode']} {run['format']}"] = run
    lines += ["", "Decode tokens/s by prompt:", "",
              "| prompt | prompt tokens | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for prompt, row in by_prompt.items():
        cells = [f"{row[n]['decode_tokens_per_s']:.1f}" if n in row else "-" for n in names]
        first = next(iter(row.values()))
        lines.append(f"| {prompt}{'' if same[prompt] else ' (ids differ)'} | {first['prompt_tokens']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(results: dict) -> str:
    s = results["settings"]
    parts = [
        "# Speed: plain decoding and verification",
        f"Model `{Path(s['model']).name}`, {s['tokens']} tokens per run (greedy, EOS ignored), prompt of "
        f"{results['prompt_tokens']} tokens (a chat question), batch 1 unless said; {s['rounds']} interleaved "
        f"rounds, the fastest run of each configuration counts; times by the {CLOCK_NAMES[s['clock']]}. "
        f"Machine: {machine_line(results)}",
        "## Goals", goals_table(results),
        "## Plain decoding",
        f"Memory read bandwidth measured in the same run: **{results['bandwidth_gb_s']:.1f} GB/s** (the better of two "
        "measurements, before and after decoding). Roofline tokens/s = bandwidth / bytes read per step (weights "
        "once, the input embedding one row, KV cache at the mean context). *Share (engine)*: tokens/s of whole "
        "generate() calls (prefill, sampling and the step loop included) over the roofline; *share (forward)*: one "
        "cached forward of one token alone.",
        decode_table(results),
        "## Cost of a pass over K new tokens",
        "One cached forward over K new tokens (a chain: causal among them, logits for all K; what verifying K-1 "
        "drafted tokens plus the pending one costs) at the mean context, relative to K = 1. The two limits: the "
        "share of the memory bound the pass reaches (bytes read per step / the measured bandwidth, over its time) "
        "and, with quantized kernels, of the arithmetic bound (its K tokens' multiply-adds / the core's int8 "
        f"multiply-add rate, {results['machine'].get('int8_peak_gmac_s', 0):.0f} GMAC/s measured in the run, over "
        "its time).",
        verify_table(results),
    ]
    if results["batch"]:
        parts += ["## Batch throughput", "Plain decoding of N chat prompts in one batch against one prompt alone "
                  "(generated tokens/s, interleaved).", batch_table(results)]
    if results.get("speculation"):
        parts += ["## Speculation in each configuration", speculation_table(results)]
    if results.get("step_breakdown"):
        from specdecode.bench.breakdown import breakdown_lines

        lines = [line for name, shares in results["step_breakdown"].items() for line in breakdown_lines(name, shares)]
        parts += ["## Where a speculative step's time goes",
                  "Each part's time a step and share (specdecode/bench/breakdown.py): the target pass's layers split by "
                  "the kernels' own clock, then the step's other parts and the scheduler around it.",
                  "```\n" + "\n".join(lines) + "\n```"]
    if results.get("vs_llama_cpp"):
        parts += [f"## vs {results['vs_llama_cpp']['reference']}", llama_cpp_table(results)]
    return "\n\n".join(parts) + "\n"


def plot(results: dict, path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(results["decode"])
    rows = [results["decode"][n] for n in names]
    left.bar(range(len(names)), [r["tokens_per_s"] for r in rows],
             color=["tab:gray" if "backend" not in r else "tab:blue" for r in rows])
    for i, r in enumerate(rows):
        if "ceiling_tokens_per_s" in r:
            left.hlines(r["ceiling_tokens_per_s"], i - 0.4, i + 0.4, colors="tab:red", linestyles="--",
                        label="memory roofline" if i == 0 else None)
    left.set_xticks(range(len(names)), names, rotation=20, ha="right")
    left.set_ylabel("tokens/s (batch 1, greedy)")
    left.set_title("Plain decoding")
    left.legend()
    for name, v in results["verify"].items():
        ks = sorted(int(k) for k in v["relative"])
        right.plot(ks, [_get(v["relative"], k) for k in ks], marker="o", label=name)
    right.axhline(1.4, color="black", linewidth=0.8, linestyle=":", label="goal at K = 8: 1.4x")
    right.set_xlabel("new tokens per pass (K)")
    right.set_ylabel("cost relative to one token")
    right.set_title("Cost of verifying K tokens")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_speed_report(results: dict, out: Path, stem: str = "speed") -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "report": out / f"{stem}.md", "plot": out / f"{stem}.png"}
    slim = {**results, "decode": {n: {k: v for k, v in r.items() if k != "token_ids"}
                                  for n, r in results["decode"].items()}}
    paths["json"].write_text(json.dumps(slim, indent=2) + "\n")
    paths["report"].write_text(markdown(results))
    plot(results, paths["plot"])
    return paths
