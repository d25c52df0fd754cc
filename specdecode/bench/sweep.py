"""Batch-size sweep: plain decoding vs every fixed draft length vs adaptive speculation, in generated tokens/s.

For each batch size B, B greedy requests of `max_tokens` tokens each (EOS ignored, so every mode does the same
work) run as one continuous batch, and again with the next prompts until at least MIN_REQUESTS requests ran (so
that batch 1 is not one prompt's figure); each mode runs `repeats` times, interleaved with the other modes so that load
from elsewhere on the machine spreads over all of them, and the fastest run counts (the work is deterministic, and
interference from other processes only ever slows a run down). The adaptive controller starts fresh from its
start-up calibration and then keeps what it learns across its own runs, as a server does across requests. Proposers
that remember finished requests (suffix decoding, and auto through it) forget them before each run: every mode
runs the same prompts, and a run must not be served the answers of the run before.
"""
from __future__ import annotations

import copy
import time
from pathlib import Path

from specdecode.bench.workloads import load_workload
from specdecode.engine.llm import LLM
from specdecode.sampling import SamplingParams
from specdecode.speculation.control import SpecController


def _timed_generate(llm: LLM, prompts: list, max_tokens: int) -> dict:
    """Seconds of the whole batch and of its decode steps alone (wall and the process's CPU time), and the
    speculation counters it moved."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    proposer = llm.runner.proposer
    if hasattr(proposer, "forget_finished"):
        proposer.forget_finished()
    seqs = [llm.make_sequence(p, params) for p in prompts]
    before = llm.total_stats.as_dict()
    start = time.perf_counter()
    iterations = llm._run(seqs)
    next(iterations)  # every sequence has a slot, so the first iteration is the batch's prefill
    decode_start, cpu_start = time.perf_counter(), time.process_time()
    for _ in iterations:
        pass
    end, cpu_end = time.perf_counter(), time.process_time()
    after = llm.total_stats.as_dict()
    out = {k: after[k] - before[k] for k in ("steps", "draft_tokens", "accepted_tokens")}
    out.update(seconds=end - start, decode_seconds=end - decode_start, decode_cpu_seconds=cpu_end - cpu_start)
    return out


GOAL = 0.98
"""Adaptive must reach this share of the better of plain decoding and the best fixed K at every batch size."""
MIN_REQUESTS = 8
"""Requests per batch size at least: below it a batch size runs several batches of distinct prompts in turn."""


def adaptive_sweep(target: str | Path | None, draft: str | Path | None = None, batch_sizes=(1, 2, 4, 8, 16, 32),
                   ks=(1, 2, 3, 4, 5), max_tokens: int = 64, repeats: int = 3, workload: str = "completion",
                   prompts: list | None = None, dtype: str = "auto", device: str | None = None,
                   log=print, speculative_config: dict | None = None) -> list[dict]:
    """Rows {batch_size, mode, tokens_per_s, e2e_tokens_per_s, ms_per_token, vs_plain, e2e_vs_plain,
    tokens_per_cpu_s, cpu_vs_plain, mean_draft_len, acceptance_rate}, mode being "plain", "K=k" or "adaptive", plus one
    {batch_size, mode: "summary", ...} row per batch size with the goal checks. tokens_per_s counts the decode
    steps (after the batch's prefill, which is the same work in every mode); e2e_tokens_per_s the whole batch,
    prefill included; ms_per_token is one request's decode time per token.
    Speculation: speculative_config (its K is replaced by each fixed K), else a draft model `draft`.
    Prompts (text or token ids): `prompts`, else the bench workload named `workload`, cycled to fill each batch."""
    prompts = prompts or load_workload(workload)
    max_batch = max(batch_sizes)
    longest = max(len(p) if isinstance(p, list) else len(p.encode()) + 1 for p in prompts)  # a token has >= 1 byte
    sizes = {"max_num_seqs": max_batch, "max_model_len": longest + max_tokens + 2 * max(ks) + 64}
    plain = LLM(target, dtype=dtype, device=device, speculative_config=None, **sizes)
    config = dict(speculative_config or {"method": "draft_model", "model": str(draft)})
    config.update(num_speculative_tokens=max(ks), adaptive=True)
    spec = LLM(target, dtype=dtype, device=device, speculative_config=config, **sizes)
    adaptive = spec.controller
    # Fixed-K runs get a controller of their own (same start-up calibration), so that they teach the adaptive one
    # nothing: it learns from its own runs only, as a running server would.
    fixed = SpecController(copy.deepcopy(adaptive.costs), adaptive.max_k, adaptive.nodes_per_level,
                           widths=adaptive.widths)
    for llm in (plain, spec):  # first calls pay one-time costs (allocations, lazy imports)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    adaptive.reset()

    def run(mode: str, batch: list[str]) -> dict:
        if mode == "plain":
            return _timed_generate(plain, batch, max_tokens)
        spec.controller = adaptive if mode == "adaptive" else fixed
        fixed.fixed_k = None if mode == "adaptive" else int(mode[2:])
        return _timed_generate(spec, batch, max_tokens)

    modes = ["plain"] + [f"K={k}" for k in ks] + ["adaptive"]
    rows = []
    for b in batch_sizes:
        groups = [[prompts[(g * b + i) % len(prompts)] for i in range(b)] for g in range(-(-MIN_REQUESTS // b))]
        samples: dict[str, list[dict]] = {m: [] for m in modes}
        for _ in range(repeats):
            for mode in modes:  # one sample: every group in turn
                parts = [run(mode, batch) for batch in groups]
                samples[mode].append({k: sum(p[k] for p in parts) for k in parts[0]})
        done = len(groups) * b * (max_tokens - 1)  # decoded tokens of one sample (the first comes from the prefill)
        by_mode = {}
        for mode in modes:
            runs = samples[mode]
            steps = sum(r["steps"] for r in runs)  # sequence-steps
            drafted = sum(r["draft_tokens"] for r in runs)
            accepted = sum(r["accepted_tokens"] for r in runs)
            fastest = min(r["decode_seconds"] for r in runs)
            by_mode[mode] = {
                "batch_size": b, "mode": mode, "requests": len(groups) * b,
                "tokens_per_s": done / fastest,
                "ms_per_token": 1000 * fastest / (len(groups) * (max_tokens - 1)),
                "e2e_tokens_per_s": len(groups) * b * max_tokens / min(r["seconds"] for r in runs),
                # CPU clock: the process's CPU time, which other jobs on a shared machine barely move
                "tokens_per_cpu_s": done / max(1e-9, min(r["decode_cpu_seconds"] for r in runs)),
                "mean_draft_len": drafted / steps if steps else 0.0,
                "acceptance_rate": accepted / drafted if drafted else None}
        plain_tps = by_mode["plain"]["tokens_per_s"]
        for row in by_mode.values():
            row["vs_plain"] = row["tokens_per_s"] / plain_tps
            row["cpu_vs_plain"] = row["tokens_per_cpu_s"] / by_mode["plain"]["tokens_per_cpu_s"]
            row["e2e_vs_plain"] = row["e2e_tokens_per_s"] / by_mode["plain"]["e2e_tokens_per_s"]
            rows.append(row)
        best_fixed = max((by_mode[f"K={k}"] for k in ks), key=lambda r: r["tokens_per_s"])
        best = max(best_fixed["tokens_per_s"], plain_tps)
        adaptive_tps = by_mode["adaptive"]["tokens_per_s"]
        summary = {"batch_size": b, "mode": "summary", "best_fixed": best_fixed["mode"],
                   "best_fixed_vs_plain": best_fixed["tokens_per_s"] / plain_tps,
                   "adaptive_vs_plain": adaptive_tps / plain_tps, "adaptive_vs_best": adaptive_tps / best,
                   "goal_met": adaptive_tps >= GOAL * best,
                   **_cpu_goal(by_mode, ks),
                   "adaptive_e2e_vs_plain": by_mode["adaptive"]["e2e_vs_plain"]}
        rows.append(summary)
        log(f"B={b}: plain {plain_tps:.1f} tok/s, best fixed {best_fixed['mode']} "
            f"{best_fixed['tokens_per_s']:.1f}, adaptive {adaptive_tps:.1f} "
            f"({summary['adaptive_vs_plain']:.2f}x plain, {summary['adaptive_vs_best']:.2f}x best)")
    return rows


def _cpu_goal(by_mode: dict[str, dict], ks) -> dict:
    """The same checks on the CPU clock."""
    cpu = {m: r["tokens_per_cpu_s"] for m, r in by_mode.items()}
    best_fixed = max((f"K={k}" for k in ks), key=cpu.get)
    best = max(cpu[best_fixed], cpu["plain"])
    return {"cpu_best_fixed": best_fixed, "cpu_best_fixed_vs_plain": cpu[best_fixed] / cpu["plain"],
            "cpu_adaptive_vs_plain": cpu["adaptive"] / cpu["plain"], "cpu_adaptive_vs_best": cpu["adaptive"] / best,
            "cpu_goal_met": cpu["adaptive"] >= GOAL * best}


def fixed_k_stops_paying(rows: list[dict], key: str = "best_fixed_vs_plain") -> int | None:
    """The smallest batch size from which on no fixed K beats plain decoding (None: some K pays at every size);
    key "cpu_best_fixed_vs_plain" for the CPU clock."""
    summaries = [r for r in rows if r["mode"] == "summary"]
    for i, r in enumerate(summaries):
        if all(s[key] < 1 for s in summaries[i:]):
            return r["batch_size"]
    return None


def markdown_table(rows: list[dict]) -> str:
    """One line per batch size: decode tokens/s (wall clock) of every mode, ms per token of plain and adaptive,
    adaptive's mean draft length, its ratios and the goal check on the wall clock and on the CPU clock."""
    modes = [r["mode"] for r in rows if r["batch_size"] == rows[0]["batch_size"] and r["mode"] != "summary"]
    lines = ["| B | " + " | ".join(modes) + " | ms/token plain / adaptive | adaptive mean K | adaptive / plain | "
             "adaptive / best | goal | CPU clock: adaptive / plain | adaptive / best | goal |",
             "|---" * (len(modes) + 9) + "|"]
    for b in dict.fromkeys(r["batch_size"] for r in rows):
        of_b = {r["mode"]: r for r in rows if r["batch_size"] == b}
        summary = of_b["summary"]
        cells = [f"{of_b[m]['tokens_per_s']:.1f}" for m in modes]
        lines.append(f"| {b} | " + " | ".join(cells) + f" | {of_b['plain']['ms_per_token']:.1f} / "
                     f"{of_b['adaptive']['ms_per_token']:.1f} | {of_b['adaptive']['mean_draft_len']:.2f} | "
                     f"{summary['adaptive_vs_plain']:.3f} | {summary['adaptive_vs_best']:.3f} | "
                     f"{'yes' if summary['goal_met'] else 'NO'} | {summary['cpu_adaptive_vs_plain']:.3f} | "
                     f"{summary['cpu_adaptive_vs_best']:.3f} | {'yes' if summary['cpu_goal_met'] else 'NO'} |")
    return "\n".join(lines)
