"""`specdecode bench`: every engine side by side on the shipped workloads, in one process and one run.

Engines: specdecode plain decoding and each speculative method, and (optionally) transformers' generate() plain,
assisted and with prompt lookup, on the same checkpoints and the same prompt token ids; greedy, batch 1, EOS
ignored so that all of them make the same number of tokens. Prompts run one at a time with every engine in turn,
so that a change of load on the machine hits all engines alike. Then a batch-size sweep (plain vs fixed K vs
adaptive, specdecode.bench.sweep) and a roofline for plain decoding.
"""
from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from specdecode.bench.measure import EngineTotals, Trace, trace_generate
from specdecode.bench.roofline import measure_read_bandwidth, roofline
from specdecode.bench.workloads import WORKLOADS, load_workload
from specdecode.engine.llm import LLM
from specdecode.errors import ConfigError
from specdecode.hardware import cpu_name
from specdecode.model.loading import resolve_device
from specdecode.sampling import SamplingParams

METHODS = ("draft_chain", "draft_tree", "ngram", "adaptive")
PEERS = ("hf_plain", "hf_assisted", "hf_prompt_lookup")
ALL = "all"
"""The key under which every workload's prompts are summed."""


@dataclasses.dataclass
class BenchConfig:
    """What `specdecode bench` runs."""

    target: Path
    """Target checkpoint directory."""
    draft: Path | None
    """Draft checkpoint directory (None: only the methods that need no draft model)."""
    out: Path = Path("bench_results")
    """Where results.json, report.md and the plots go."""
    workloads: tuple[str, ...] = WORKLOADS
    """Shipped workloads to run (specdecode.bench.workloads)."""
    prompts: int = 8
    """Prompts per workload."""
    max_tokens: int = 128
    """Tokens generated per prompt (EOS ignored)."""
    methods: tuple[str, ...] = METHODS
    """Speculative methods, besides plain decoding, that always runs."""
    num_speculative_tokens: int = 4
    """K of the draft-model methods (the adaptive controller's upper bound)."""
    num_drafts: int = 2
    """Chains of the draft_tree method."""
    ngram_tokens: int = 8
    """K of n-gram prompt lookup (transformers' prompt_lookup_num_tokens gets the same)."""
    peers: bool = True
    """Also run transformers' generate() (plain, assisted, prompt lookup)."""
    adaptive: bool = True
    """draft_chain, draft_tree and ngram choose K per step (the default everywhere); False: they always draft K."""
    sweep_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    """Batch sizes of the plain vs fixed K vs adaptive sweep (empty: no sweep)."""
    sweep_ks: tuple[int, ...] = (1, 2, 3, 4, 5)
    """Fixed draft lengths of the sweep (the largest is adaptive's upper bound there)."""
    sweep_max_tokens: int = 64
    """Tokens per request in the sweep."""
    sweep_repeats: int = 3
    """Runs per sweep point; the median counts."""
    sweep_prompt_tokens: int = 64
    """Prompt tokens per sweep request (the last ones of each completion prompt); short prompts keep the
    prefill of 32-request batches, repeated for every mode, from dominating the sweep's run time."""
    dtype: str = "float32"
    """Weights' dtype for every engine."""
    device: str | None = None
    """cpu, cuda, ... (default: cuda if available)."""
    note: str = ""
    """Free text for the report (e.g. what else ran on the machine)."""

    def __post_init__(self):
        unknown = sorted(set(self.workloads) - set(WORKLOADS))
        if unknown:
            raise ConfigError(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown:
            raise ConfigError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
        for name in ("prompts", "max_tokens", "num_speculative_tokens", "num_drafts", "ngram_tokens",
                     "sweep_max_tokens", "sweep_repeats", "sweep_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sweep_batch_sizes and (self.draft is None or min(self.sweep_batch_sizes) < 1 or not self.sweep_ks):
            raise ConfigError("the batch sweep needs a draft model, batch sizes >= 1 and at least one K")

    @classmethod
    def quick(cls, **overrides) -> "BenchConfig":
        """A run of a few minutes: fewer prompts and tokens, one sweep run per point, two fixed K."""
        settings = dict(prompts=3, max_tokens=48, sweep_ks=(2, 4), sweep_max_tokens=32, sweep_repeats=1)
        return cls(**{**settings, **overrides})


def method_config(method: str, config: BenchConfig) -> dict:
    """The speculative_config of a method."""
    k = config.num_speculative_tokens
    draft = {"method": "draft_model", "model": str(config.draft), "num_speculative_tokens": k,
             "adaptive": config.adaptive}
    return {"draft_chain": draft,
            "draft_tree": {**draft, "num_drafts": config.num_drafts},
            "ngram": {"method": "ngram", "num_speculative_tokens": config.ngram_tokens, "prompt_lookup_max": 4,
                      "prompt_lookup_min": 2, "adaptive": config.adaptive},
            "adaptive": {**draft, "adaptive": True}}[method]


def engine_labels(config: BenchConfig) -> dict[str, str]:
    k = config.num_speculative_tokens
    at_most = "<=" if config.adaptive else "="  # adaptive: K is the upper bound
    return {"plain": "specdecode plain", "draft_chain": f"specdecode draft model, chain K{at_most}{k}",
            "draft_tree": f"specdecode draft model, tree {config.num_drafts}x{k}{' adaptive' * config.adaptive}",
            "ngram": f"specdecode n-gram lookup K{at_most}{config.ngram_tokens}",
            "adaptive": f"specdecode adaptive draft model (K<={k})", "hf_plain": "transformers plain",
            "hf_assisted": "transformers assisted (same draft)",
            "hf_prompt_lookup": f"transformers prompt lookup ({config.ngram_tokens} tokens)"}


def machine_info(device: torch.device) -> dict:
    info = {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": str(device), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    if hasattr(os, "getloadavg"):
        info["load_average_start"] = os.getloadavg()[0]
    return info


def fit_prompt(ids: list[int], llm: LLM, max_tokens: int, tree: int) -> list[int]:
    """The prompt's last tokens, as many as leave room for max_tokens and a draft tree in the context."""
    room = llm.max_model_len - max_tokens - tree - 2
    if room < 1:
        raise ConfigError(f"max_tokens {max_tokens} does not fit the model's context of {llm.max_model_len}")
    return ids[-room:]


def build_engines(config: BenchConfig, log: Callable[[str], None]) -> tuple[dict[str, Callable], LLM, dict]:
    """name -> run(prompt_ids, max_tokens) -> Trace for every engine of this run; also the plain LLM and the
    transformers engines' settings."""
    has_draft = config.draft is not None
    methods = [m for m in config.methods if has_draft or m == "ngram"]
    llms = {"plain": LLM(config.target, dtype=config.dtype, device=config.device, max_num_seqs=1)}
    for method in methods:
        log(f"loading {method}")
        llms[method] = LLM(config.target, dtype=config.dtype, device=config.device, max_num_seqs=1,
                           speculative_config=method_config(method, config))

    def ours(llm: LLM) -> Callable[[list[int], int], Trace]:
        return lambda ids, n: trace_generate(llm, ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))

    engines = {name: ours(llm) for name, llm in llms.items()}
    peer_settings = {}
    if config.peers:
        from specdecode.bench.peers import TransformersEngine

        log("loading transformers")
        hf_dtype = llms["plain"].target.dtype
        plain = TransformersEngine("plain", config.target, dtype=hf_dtype, device=llms["plain"].device)
        peers = {"hf_plain": plain}
        if has_draft:
            peers["hf_assisted"] = TransformersEngine("assisted", config.target, config.draft, dtype=hf_dtype,
                                                      device=plain.device, shared_target=plain.model)
        peers["hf_prompt_lookup"] = TransformersEngine("prompt_lookup", config.target,
                                                       prompt_lookup_num_tokens=config.ngram_tokens, dtype=hf_dtype,
                                                       device=plain.device, shared_target=plain.model)
        for name, peer in peers.items():
            engines[name] = peer.generate
            peer_settings[name] = peer.settings()
    return engines, llms["plain"], peer_settings


def run_workloads(config: BenchConfig, engines: dict[str, Callable], plain: LLM,
                  ) -> tuple[dict[str, dict[str, EngineTotals]], dict[str, list[int]]]:
    """Every prompt of every workload through every engine; totals per workload (and ALL) and engine."""
    tree = max(config.num_speculative_tokens * config.num_drafts, config.ngram_tokens)
    prompts = {w: [fit_prompt(plain.tokenizer.encode(p), plain, config.max_tokens, tree)
                   for p in load_workload(w, config.prompts)] for w in config.workloads}
    first = next(iter(prompts.values()))[0]
    for run in tqdm(engines.values(), desc="warm-up", leave=False):  # one-time costs out of the measurement
        run(first, 16)
    totals = {w: {name: EngineTotals() for name in engines} for w in [*config.workloads, ALL]}
    bar = tqdm(total=sum(map(len, prompts.values())) * len(engines), desc="bench", unit="run")
    for workload, ids_list in prompts.items():
        for ids in ids_list:
            for name, run in engines.items():
                bar.set_postfix_str(f"{workload}: {name}")
                trace = run(ids, config.max_tokens)
                totals[workload][name].add(trace)
                totals[ALL][name].add(trace)
                bar.update()
    bar.close()
    return totals, {w: [len(ids) for ids in ids_list] for w, ids_list in prompts.items()}


def summarise(totals: dict[str, EngineTotals]) -> dict[str, dict]:
    """Per engine: its figures, speedup over its own library's plain decoding, and how many prompts gave
    exactly the tokens of specdecode's plain decoding (and of its own library's plain decoding)."""
    out = {}
    reference = totals["plain"].outputs
    for name, t in totals.items():
        row = t.summary()
        own_plain = totals["hf_plain" if name.startswith("hf_") else "plain"]
        row["speedup"] = t.tokens_per_s / own_plain.tokens_per_s if own_plain.tokens_per_s else 0.0
        row["prompts"] = len(t.outputs)
        row["same_as_plain"] = sum(a == b for a, b in zip(t.outputs, reference))
        row["same_as_own_plain"] = sum(a == b for a, b in zip(t.outputs, own_plain.outputs))
        out[name] = row
    return out


def compare_peers(rows: dict[str, dict]) -> dict:
    """Ratios of specdecode's tokens/s to transformers' and of the two speedups, with the issue's goals:
    our draft-model tokens/s >= 1.5x transformers' assisted generation, our speedup >= theirs."""
    out = {}
    pairs = (("plain", "hf_plain"), ("draft_chain", "hf_assisted"), ("ngram", "hf_prompt_lookup"))
    for ours, theirs in pairs:
        if ours in rows and theirs in rows:
            out[f"{ours}_vs_{theirs}"] = {
                "tokens_per_s_ratio": rows[ours]["tokens_per_s"] / rows[theirs]["tokens_per_s"],
                "our_speedup": rows[ours]["speedup"], "their_speedup": rows[theirs]["speedup"]}
    assisted = out.get("draft_chain_vs_hf_assisted")
    if assisted:
        best = max((r for n, r in rows.items() if not n.startswith("hf_") and n != "plain"),
                   key=lambda r: r["tokens_per_s"])
        assisted["best_ours_ratio"] = best["tokens_per_s"] / rows["hf_assisted"]["tokens_per_s"]
        assisted["goal_tokens_per_s"] = assisted["tokens_per_s_ratio"] >= 1.5
        assisted["goal_speedup"] = assisted["our_speedup"] >= assisted["their_speedup"]
    return out


def run_bench(config: BenchConfig, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> dict:
    """Run everything and return the results (what results.json holds); report.write_report renders them."""
    start = time.perf_counter()
    info = machine_info(resolve_device(config.device))
    engines, plain, peer_settings = build_engines(config, log)
    if config.peers:
        import transformers

        info["transformers"] = transformers.__version__
    totals, prompt_lens = run_workloads(config, engines, plain)
    workloads = {w: summarise(t) for w, t in totals.items()}
    results = {"machine": info, "settings": dataclasses.asdict(config), "peer_settings": peer_settings,
               "labels": engine_labels(config), "workloads": workloads,
               "peers": {w: compare_peers(rows) for w, rows in workloads.items()} if config.peers else {}}

    log("measuring memory bandwidth")
    all_lens = [n for lens in prompt_lens.values() for n in lens]
    context = sum(all_lens) / len(all_lens) + config.max_tokens / 2  # mean over the decode steps
    results["roofline"] = roofline(plain.target, measure_read_bandwidth(device=plain.device), context,
                                   workloads[ALL]["plain"]["tokens_per_s"])
    sweep_tree = max(config.sweep_ks, default=0)
    sweep_prompts = [fit_prompt(plain.tokenizer.encode(p), plain, config.sweep_max_tokens, sweep_tree)
                     [-config.sweep_prompt_tokens:] for p in load_workload("completion")]
    del engines, plain  # the sweep loads its own engines

    if config.sweep_batch_sizes:
        from specdecode.bench.sweep import adaptive_sweep

        bar = tqdm(total=len(config.sweep_batch_sizes), desc="batch sweep", unit="batch size")
        results["sweep"] = adaptive_sweep(config.target, config.draft, batch_sizes=config.sweep_batch_sizes,
                                          ks=config.sweep_ks, max_tokens=config.sweep_max_tokens,
                                          repeats=config.sweep_repeats, prompts=sweep_prompts, dtype=config.dtype,
                                          device=config.device, log=lambda line: (bar.update(), bar.write(line)))
        bar.close()
    if hasattr(os, "getloadavg"):
        info["load_average_end"] = os.getloadavg()[0]
    info["wall_seconds"] = time.perf_counter() - start
    return results
