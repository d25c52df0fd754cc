"""`specdecode bench`: plain decoding, every speculative method and transformers' generate() side by side on real
work, in one process and one run.

Workloads: held-out ShareGPT by category (specdecode.bench.categories), a workload file, or the standard-library
code workloads. Each prompt is rendered in the model's chat template (or encoded raw) once, and every engine
decodes the same token ids, batch 1, stopping at EOS or max_tokens, at each temperature (T=0 greedy; T>0 seeded
sampling). Prompts run one at a time with every engine in turn, so a change of load on the machine hits all engines
alike, and speedups are ratios within the run. Then a batch-size sweep (plain vs fixed K vs adaptive,
specdecode.bench.sweep) and a roofline for plain decoding.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from specdecode.bench.categories import (CATEGORIES, Prompt, heldout_workloads, load_workload_file,
                                         stdlib_workloads)
from specdecode.bench.measure import EngineTotals, Trace, trace_generate
from specdecode.bench.roofline import measure_read_bandwidth, roofline
from specdecode.engine.llm import LLM
from specdecode.errors import ConfigError
from specdecode.hardware import cpu_name
from specdecode.model.loading import resolve_device
from specdecode.catalog.registry import MODELS, SMALL_MODEL, resolve_model, shipped_speculator
from specdecode.sampling import SamplingParams
from specdecode.speculation import methods

METHODS = methods.names()
"""Speculative methods of the per-request table (the registry's: vLLM's names), each besides plain decoding."""
PEERS = ("hf_plain", "hf_assisted", "hf_prompt_lookup")
ALL = "all"
"""The key under which every category's prompts are summed."""
LABELS = {"plain": "plain", "draft_model": "draft model", "eagle": "EAGLE-2", "medusa": "Medusa",
          "ngram": "prompt lookup", "lookahead": "Lookahead", "rest": "REST", "suffix": "suffix decoding",
          "auto": "auto (combined tree)", "hf_plain": "transformers plain",
          "hf_assisted": "transformers assisted (our draft)", "hf_prompt_lookup": "transformers prompt lookup"}


@dataclasses.dataclass
class BenchConfig:
    """What `specdecode bench` runs."""

    model: str | None = None
    """Target: a model name, .gguf file or checkpoint directory (None: SmolLM2-135M, whose speculators ship and
    whose figures docs/benchmarks.md holds)."""
    speculators: dict[str, str] = dataclasses.field(default_factory=dict)
    """Method -> speculator directory (draft checkpoint, EAGLE/Medusa heads, REST datastore) overriding the shipped
    one; the draft_model entry is also transformers' assistant."""
    out: Path = Path("bench_results")
    """Where results.json, report.md and the plots go."""
    workload_file: Path | None = None
    """A JSON workload file (specdecode.bench.categories.load_workload_file) instead of held-out ShareGPT."""
    stdlib_workloads: bool = False
    """The standard-library code workloads as raw prompts instead (for models without a chat template)."""
    categories: tuple[str, ...] = CATEGORIES
    """ShareGPT categories to run (those the held-out set has no prompt of are left out)."""
    prompts: int = 8
    """Prompts per category."""
    max_tokens: int = 128
    """Most tokens generated per request (EOS ends a request earlier)."""
    max_prompt_tokens: int = 768
    """Prompts longer than this in the chat template are skipped."""
    temperatures: tuple[float, ...] = (0.0, 1.0)
    """One per-request table per temperature; T>0 samples with seed = prompt index (same seeds for every engine)."""
    methods: tuple[str, ...] | None = None
    """Speculative methods besides plain decoding (None: every method this model has a speculator for)."""
    num_speculative_tokens: int | None = None
    """K of every method (None: each method's default); the adaptive controller's upper bound."""
    adaptive: bool = True
    """Methods choose K per step (the default everywhere); False: they always draft K."""
    fixed_too: bool = False
    """Also run every method at a fixed K (rows `<method> fixed`) next to its adaptive row."""
    peers: bool = True
    """Also run transformers' generate() (plain, assisted with the draft_model speculator, prompt lookup)."""
    ngram_tokens: int = 10
    """transformers' prompt_lookup_num_tokens (its default)."""
    sweep_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """Batch sizes of the plain vs fixed K vs adaptive sweep (empty: no sweep)."""
    sweep_method: str = "ngram"
    """Speculative method of the sweep."""
    sweep_ks: tuple[int, ...] = (1, 2, 3, 4, 5)
    """Fixed draft lengths of the sweep (the largest is adaptive's upper bound there)."""
    sweep_max_tokens: int = 64
    """Tokens per request in the sweep (EOS ignored, so every mode does the same work)."""
    sweep_repeats: int = 3
    """Runs per sweep point; the fastest counts."""
    sweep_prompt_tokens: int = 128
    """Prompt tokens per sweep request (the last ones of each benchmark prompt), so that the prefill of 64-request
    batches, repeated for every mode, does not dominate the sweep's run time."""
    dtype: str = "float32"
    """Weights' dtype for every engine."""
    device: str | None = None
    """cpu, cuda, ... (default: cuda if available)."""
    note: str = ""
    """Free text for the report (e.g. what else ran on the machine)."""
    command: str = ""
    """The command line that started the run, for the report."""

    def __post_init__(self):
        if self.model is None:
            self.model = SMALL_MODEL
        own = self.workload_file is not None or self.stdlib_workloads
        unknown = [] if own else sorted(set(self.categories) - set(CATEGORIES))
        if unknown:
            raise ConfigError(f"unknown categor(ies) {unknown}; choose from {', '.join(CATEGORIES)}")
        if self.methods is None:
            self.methods = tuple(m for m in METHODS if self.has_speculator(m))
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown:
            raise ConfigError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
        for name in ("prompts", "max_tokens", "max_prompt_tokens", "ngram_tokens", "sweep_max_tokens",
                     "sweep_repeats", "sweep_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.temperatures or min(self.temperatures) < 0:
            raise ConfigError(f"temperatures must be >= 0 and at least one, got {self.temperatures}")
        if self.sweep_batch_sizes and (min(self.sweep_batch_sizes) < 1 or not self.sweep_ks or min(self.sweep_ks) < 1):
            raise ConfigError("the batch sweep needs batch sizes >= 1 and at least one K >= 1")
        if self.sweep_batch_sizes and not self.has_speculator(self.sweep_method):
            raise ConfigError(f"the sweep's method {self.sweep_method} has no speculator for this model; pass "
                              f"--sweep-method ngram or a --speculator {self.sweep_method}=DIR")

    @property
    def named(self) -> bool:
        """Whether the target is a registry name, which brings its shipped speculators."""
        return str(self.model) in MODELS and not Path(self.model).exists()

    def has_speculator(self, method: str) -> bool:
        kind = methods.get(method).model
        if kind is None or method in self.speculators:  # (kind None: it needs no speculator)
            return True
        if kind == "datastore":  # the default model's datastore is built on first use
            return self.named
        return self.named and shipped_speculator(self.model, method) is not None

    def draft_dir(self) -> Path | None:
        """The draft checkpoint of the draft_model method (transformers' assistant too)."""
        given = self.speculators.get("draft_model")
        return Path(given) if given else (shipped_speculator(self.model, "draft_model") if self.named else None)

    @classmethod
    def quick(cls, **overrides) -> "BenchConfig":
        """A run of a few minutes: one prompt per category, 24 tokens, T=0 only, a short sweep."""
        settings = dict(prompts=1, max_tokens=24, max_prompt_tokens=512, temperatures=(0.0,),
                        sweep_batch_sizes=(1, 8), sweep_ks=(2, 4), sweep_max_tokens=16, sweep_repeats=1,
                        sweep_prompt_tokens=64)
        return cls(**{**settings, **overrides})


def method_config(method: str, config: BenchConfig, adaptive: bool | None = None, k: int | None = None) -> dict:
    """The speculative_config of a method (its shipped speculator, unless config.speculators names one)."""
    out = {"method": method, "adaptive": config.adaptive if adaptive is None else adaptive}
    if config.speculators.get(method):
        out["model"] = str(config.speculators[method])
    k = k or config.num_speculative_tokens
    if k:
        out["num_speculative_tokens"] = k
    return out


def machine_info(device: torch.device) -> dict:
    info = {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": str(device), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    if hasattr(os, "getloadavg"):
        info["load_average_start"] = os.getloadavg()[0]
    return info


def share_target(llm: LLM, target) -> None:
    """Point an engine at another engine's copy of the same target weights, so that seven engines hold one copy
    (a prepacked float32 SmolLM2 is ~1.1 GB). Safe here: the engines run one request at a time, each with its own
    caches (the target holds weights only), and each was loaded from the same checkpoint in the same dtype."""
    llm.target = llm.runner.target = target
    gc.collect()


Run = Callable[[list[int], int, float, int], Trace]
"""An engine: run(prompt_ids, max_tokens, temperature, seed) -> Trace."""


def _cpu_timed(run: Run) -> Run:
    """The engine, with the process's CPU time during each call noted on its trace (the cost line)."""
    def timed(ids, n, temperature, seed):
        start = time.process_time()
        trace = run(ids, n, temperature, seed)
        trace.cpu_seconds = time.process_time() - start
        return trace
    return timed


def build_engines(config: BenchConfig, log: Callable[[str], None]) -> tuple[dict[str, Run], LLM, dict, dict, dict]:
    """name -> Run for every engine of this run; also the plain LLM, the transformers engines' settings, each
    method's speculative_config as the engine resolved it, and the live per-source counts (source -> [proposed,
    accepted]) of the engines whose proposer combines sources (auto)."""
    sizes = {"max_num_seqs": 1, "max_model_len": config.max_prompt_tokens + config.max_tokens + 96}
    llms = {"plain": LLM(config.model, dtype=config.dtype, device=config.device, speculative_config=None, **sizes)}
    for method in config.methods:
        log(f"loading {method}")
        llms[method] = LLM(config.model, dtype=config.dtype, device=config.device,
                           speculative_config=method_config(method, config), **sizes)
        share_target(llms[method], llms["plain"].target)
    for method in config.methods if config.fixed_too and config.adaptive else ():
        llms[f"{method} fixed"] = LLM(config.model, dtype=config.dtype, device=config.device,
                                      speculative_config=method_config(method, config, adaptive=False), **sizes)
        share_target(llms[f"{method} fixed"], llms["plain"].target)

    def ours(llm: LLM) -> Run:
        return lambda ids, n, temperature, seed: trace_generate(
            llm, ids, SamplingParams(temperature=temperature, max_tokens=n, seed=seed))

    engines = {name: _cpu_timed(ours(llm)) for name, llm in llms.items()}
    resolved = {name: dataclasses.asdict(llm.spec_config) for name, llm in llms.items() if llm.spec_config}
    sources = {name: llm.proposer.counts for name, llm in llms.items()
               if isinstance(getattr(llm.proposer, "counts", None), dict)}
    peer_settings = {}
    if config.peers:
        from specdecode.bench.peers import TransformersEngine

        log("loading transformers")
        target_dir = resolve_model(config.model)
        hf = dict(dtype=llms["plain"].target.dtype, device=llms["plain"].device, ignore_eos=False)
        plain = TransformersEngine("plain", target_dir, **hf)
        peers = {"hf_plain": plain}
        draft = config.draft_dir()
        if draft is not None:
            peers["hf_assisted"] = TransformersEngine("assisted", target_dir, draft, shared_target=plain.model, **hf)
        peers["hf_prompt_lookup"] = TransformersEngine("prompt_lookup", target_dir, shared_target=plain.model,
                                                       prompt_lookup_num_tokens=config.ngram_tokens, **hf)
        for name, peer in peers.items():
            engines[name] = _cpu_timed(peer.generate)
            peer_settings[name] = peer.settings()
    return engines, llms["plain"], peer_settings, resolved, sources


def load_prompts(config: BenchConfig, tokenizer) -> dict[str, list[Prompt]]:
    """The run's prompts by category: the workload file's, else held-out ShareGPT's that fit max_prompt_tokens."""
    def fits(messages: list[dict]) -> bool:
        return len(tokenizer.encode_chat(messages)) <= config.max_prompt_tokens

    if config.workload_file is not None or config.stdlib_workloads:
        prompts = (stdlib_workloads(config.prompts) if config.stdlib_workloads else
                   load_workload_file(config.workload_file, config.prompts))
        prompts = {c: [p for p in ps if len(p.token_ids(tokenizer)) <= config.max_prompt_tokens]
                   for c, ps in prompts.items()}
    else:
        prompts = heldout_workloads(config.prompts, fits, config.categories)
    prompts = {c: ps for c, ps in prompts.items() if ps}
    if not prompts:
        raise ConfigError(f"no prompt fits --max-prompt-tokens {config.max_prompt_tokens}; raise it")
    return prompts


def _strip_eos(ids: list[int], eos: set[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in eos else ids


def run_requests(config: BenchConfig, engines: dict[str, Run], prompt_ids: dict[str, list[list[int]]],
                 temperature: float, eos: set[int], bar) -> dict[str, dict[str, EngineTotals]]:
    """Every prompt of every category through every engine in turn at one temperature; totals per category (and
    ALL) and engine."""
    totals = {c: {name: EngineTotals() for name in engines} for c in [*prompt_ids, ALL]}
    seed = 0
    for category, ids_list in prompt_ids.items():
        for ids in ids_list:
            seed += 1
            for name, run in engines.items():
                bar.set_postfix_str(f"T={temperature:g} {category}: {name}")
                trace = run(ids, config.max_tokens, temperature, seed)
                trace.token_ids = _strip_eos(trace.token_ids, eos)  # engines differ in whether EOS is returned
                totals[category][name].add(trace)
                totals[ALL][name].add(trace)
                bar.update()
    return totals


def summarise(totals: dict[str, EngineTotals]) -> dict[str, dict]:
    """Per engine: its figures, speedup over its own library's plain decoding and over ours (`vs_plain`), and how
    many prompts gave exactly the tokens of specdecode's plain decoding (and of its own library's plain)."""
    out = {}
    reference = totals["plain"].outputs
    for name, t in totals.items():
        row = t.summary()
        own_plain = totals["hf_plain" if name.startswith("hf_") else "plain"]
        row["speedup"] = t.tokens_per_s / own_plain.tokens_per_s if own_plain.tokens_per_s else 0.0
        row["vs_plain"] = t.tokens_per_s / totals["plain"].tokens_per_s if totals["plain"].tokens_per_s else 0.0
        row["prompts"] = len(t.outputs)
        row["same_as_plain"] = sum(a == b for a, b in zip(t.outputs, reference))
        row["same_as_own_plain"] = sum(a == b for a, b in zip(t.outputs, own_plain.outputs))
        out[name] = row
    return out


def compare_peers(rows: dict[str, dict]) -> dict:
    """Ratios of specdecode's tokens/s to transformers' and of the two speedups: plain to plain, draft model to
    assisted generation (same draft), prompt lookup to prompt lookup; best of ours to their assisted."""
    out = {}
    pairs = (("plain", "hf_plain"), ("draft_model", "hf_assisted"), ("ngram", "hf_prompt_lookup"))
    for ours, theirs in pairs:
        if ours in rows and theirs in rows:
            out[f"{ours}_vs_{theirs}"] = {
                "tokens_per_s_ratio": rows[ours]["tokens_per_s"] / rows[theirs]["tokens_per_s"],
                "our_speedup": rows[ours]["speedup"], "their_speedup": rows[theirs]["speedup"]}
    assisted = out.get("draft_model_vs_hf_assisted")
    if assisted:
        best = max((r for n, r in rows.items() if not n.startswith("hf_")), key=lambda r: r["tokens_per_s"])
        assisted["best_ours_ratio"] = best["tokens_per_s"] / rows["hf_assisted"]["tokens_per_s"]
    return out


def sweep_prompt_ids(prompt_ids: dict[str, list[list[int]]], tokens: int) -> list[list[int]]:
    """The sweep's prompts: the last `tokens` tokens of every benchmark prompt, categories interleaved."""
    lists = list(prompt_ids.values())
    out = []
    for i in range(max(map(len, lists))):
        out += [ids[i][-tokens:] for ids in lists if i < len(ids)]
    return out


def run_bench(config: BenchConfig, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> dict:
    """Run everything and return the results (what results.json holds); report.write_report renders them."""
    start = time.perf_counter()
    info = machine_info(resolve_device(config.device))
    engines, plain, peer_settings, resolved, sources = build_engines(config, log)
    if config.peers:
        import transformers

        info["transformers"] = transformers.__version__
    prompts = load_prompts(config, plain.tokenizer)
    prompt_ids = {c: [p.token_ids(plain.tokenizer) for p in ps] for c, ps in prompts.items()}
    first = next(iter(prompt_ids.values()))[0]
    for run in tqdm(engines.values(), desc="warm-up", leave=False):  # one-time costs out of the measurement
        run(first, 8, 0.0, 0)
    eos = set(plain.tokenizer.eos_token_ids)
    n_runs = sum(map(len, prompt_ids.values())) * len(engines) * len(config.temperatures)
    bar = tqdm(total=n_runs, desc="per-request", unit="run")
    tables = {}
    for temperature in config.temperatures:
        totals = run_requests(config, engines, prompt_ids, temperature, eos, bar)
        tables[f"T={temperature:g}"] = {c: summarise(t) for c, t in totals.items()}
    bar.close()
    results = {"machine": info, "settings": dataclasses.asdict(config), "peer_settings": peer_settings,
               "speculative_configs": resolved, "labels": LABELS,
               "prompts": {c: [{"source": p.source, "prompt_tokens": len(ids), "reference_chars": len(p.reference)}
                               for p, ids in zip(ps, prompt_ids[c])] for c, ps in prompts.items()},
               "per_request": tables,
               "sources": {name: {source: {"proposed": p, "accepted": a} for source, (p, a) in counts.items()}
                           for name, counts in sources.items()},
               "peers": {t: {c: compare_peers(rows) for c, rows in table.items()} for t, table in tables.items()}
               if config.peers else {}}

    log("measuring memory bandwidth")
    all_lens = [len(ids) for ids_list in prompt_ids.values() for ids in ids_list]
    greedy = tables[next(iter(tables))][ALL]["plain"]
    context = sum(all_lens) / len(all_lens) + greedy["tokens"] / len(all_lens) / 2  # mean over the decode steps
    results["roofline"] = roofline(plain.target, measure_read_bandwidth(device=plain.device), context,
                                   greedy["tokens_per_s"])
    sweep_prompts = sweep_prompt_ids(prompt_ids, config.sweep_prompt_tokens)
    del engines, plain  # the sweep loads its own engines

    if config.sweep_batch_sizes:
        from specdecode.bench.sweep import adaptive_sweep

        bar = tqdm(total=len(config.sweep_batch_sizes), desc="batch sweep", unit="batch size")
        spec = method_config(config.sweep_method, config, adaptive=True, k=max(config.sweep_ks))
        results["sweep"] = adaptive_sweep(config.model, speculative_config=spec,
                                          batch_sizes=config.sweep_batch_sizes, ks=config.sweep_ks,
                                          max_tokens=config.sweep_max_tokens, repeats=config.sweep_repeats,
                                          prompts=sweep_prompts, dtype=config.dtype, device=config.device,
                                          log=lambda line: (bar.update(), bar.write(line)))
        bar.close()
    if hasattr(os, "getloadavg"):
        info["load_average_end"] = os.getloadavg()[0]
    info["wall_seconds"] = time.perf_counter() - start
    return results
