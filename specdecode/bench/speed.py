"""How fast plain decoding and verification run, per dtype and linear backend: tokens/s against transformers and
against the memory roofline, the cost of a pass over K new tokens relative to one, batch-8 throughput.
`specdecode bench --speed` and docs/bench/speed.py run it; speed_report.py renders it.

Everything runs in one process and interleaved (one run of every configuration per round, the fastest run
counts), so that a change of load on a shared machine hits all configurations alike: the ratios are the
figures to trust.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import time
from pathlib import Path

import torch

from specdecode.bench.measure import trace_generate
from specdecode.bench.roofline import (kv_bytes_per_step, macs_per_token, measure_read_bandwidth,
                                       weight_bytes_per_step)
from specdecode.engine.llm import LLM
from specdecode.errors import ConfigError
from specdecode.hardware import cpu_has_native_bf16, cpu_name
from specdecode.model.linear import linear_backend, onednn_supports, prepare_for_inference
from specdecode.model.quant import kernels as quant_kernels
from specdecode.model.quant import quantized_format
from specdecode.model.loading import DTYPES
from specdecode.sampling import SamplingParams

QUESTIONS = ("Explain how a hash table works.", "What are the main causes of inflation?",
             "Write a short story about a robot learning to paint.", "How do vaccines train the immune system?",
             "Compare Python lists and tuples.", "Why is the sky blue?", "Give three tips for a job interview.",
             "Describe the water cycle.")
"""Chat prompts of the batch comparison (the first is the batch-1 prompt)."""

CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}

SPEC_PROMPT = """Add type hints to this function and return the whole function.

```python
def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
```"""
"""A request whose answer copies much of the prompt: where prompt lookup has something to find."""

GOALS = {"plain_fp32_vs_hf_fp32": 1.6, "plain_bf16_vs_hf_fp32": 2.5, "roofline_share": 0.75, "verify_8": 1.4,
         "verify_5": 1.25, "verify_9": 1.5, "verify_16": 2.2,
         "batch_8": 4.0, "plain_vs_llama_cpp_q8_0": 1.0, "plain_vs_llama_cpp_q4_1": 0.8,
         "speculative_vs_llama_cpp_q4_1": 1.3}
"""The speed issues' goals (ratios; verify_K are upper bounds - a pass over K tokens / one - the rest lower
bounds)."""
VERIFY_GOALS = ("verify_5", "verify_8", "verify_9", "verify_16")


@dataclasses.dataclass
class SpeedConfig:
    """What the speed benchmark runs."""

    model: Path
    """Checkpoint: Hugging Face directory or GGUF file."""
    tokens: int = 128
    """Tokens generated per run (greedy, EOS ignored)."""
    rounds: int = 3
    """Interleaved rounds of generation; the fastest run of each configuration counts."""
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    """Weight dtypes to time (bfloat16 is skipped where the CPU has no native bfloat16)."""
    backends: tuple[str, ...] = ("gguf", "onednn", "plain", "int8")
    """Linear backends: "gguf" the GGUF's matrices kept quantized (model/quant.py, float32 activations; the
    default for a GGUF on CPU), else float weights through model/linear.py's backends, "int8" meaning weight-only
    int8 (reduced-precision dtypes only); one this machine or model lacks is skipped."""
    max_verify: int = 16
    """Passes over K = 1..max_verify new tokens are timed."""
    batch: int = 8
    """Batch size whose plain throughput is compared with batch 1."""
    peers: bool = True
    """Also time transformers' generate() in float32, the goals' reference."""
    speculation: bool = True
    """Also time prompt-lookup speculation against plain decoding in the default dtype's fast configurations."""
    device: str = "cpu"
    """Device to run on."""
    llama_cpp: Path | None = None
    """A llama.cpp bin directory (scripts/build_llama_cpp.sh): its plain and lookup decoding beside ours, by
    prompt (the model must then be a GGUF file)."""
    peer_prompts: int = 2
    """Held-out chat prompts per category (bench/categories.py) of the llama.cpp comparison."""
    clock: str = "wall"
    """"wall" (time.perf_counter) or "cpu" (time.thread_time: the CPU time of the one thread that runs
    everything, torch threads being 1; on a machine shared with other jobs it leaves out the time the process
    waits for a core, though not their use of memory bandwidth)."""

    def __post_init__(self):
        unknown = sorted(set(self.dtypes) - set(DTYPES))
        if unknown:
            raise ConfigError(f"unknown dtype(s) {unknown}; choose from {', '.join(DTYPES)}")
        unknown = sorted(set(self.backends) - {"gguf", "onednn", "plain", "int8"})
        if unknown:
            raise ConfigError(f"unknown backend(s) {unknown}; choose from gguf, onednn, plain, int8")
        for name in ("tokens", "rounds", "max_verify", "batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.clock not in CLOCKS:
            raise ConfigError(f"clock must be one of {', '.join(CLOCKS)}, got {self.clock!r}")
        if self.clock == "cpu" and torch.get_num_threads() != 1:
            raise ConfigError("the cpu clock times one thread: set torch threads to 1 (--threads 1)")
        if self.llama_cpp is not None:
            from specdecode.bench.llama_cpp import LlamaCpp

            LlamaCpp(self.llama_cpp)  # fails here, in one line, on a folder without its binaries
            if Path(self.model).suffix != ".gguf":
                raise ConfigError(f"--llama-cpp runs the same GGUF file as ours; {self.model} is not one")

    @property
    def now(self):
        return CLOCKS[self.clock]


def chat_ids(llm: LLM, question: str) -> list[int]:
    """A question in the model's chat template, as token ids."""
    return llm.tokenizer.encode_chat([{"role": "user", "content": question}])


def configurations(config: SpeedConfig) -> list[tuple[str, str]]:
    """(dtype, backend) pairs this machine can run."""
    device = torch.device(config.device)
    pairs = []
    for dtype in config.dtypes:
        if dtype == "bfloat16" and device.type == "cpu" and not cpu_has_native_bf16():
            continue
        for backend in config.backends:
            if backend == "onednn" and not onednn_supports(device, DTYPES[dtype]):
                continue
            if backend == "int8" and dtype == "float32":
                continue  # int8 needs reduced-precision activations (see model/linear.py)
            if backend == "gguf" and (dtype != "float32" or device.type != "cpu" or Path(config.model).suffix != ".gguf"
                                      or quant_kernels() is None):
                continue  # the quantized kernels: a GGUF's matrices, float32 activations, on CPU
            pairs.append((dtype, backend))
    return pairs


def label(dtype: str, backend: str) -> str:
    return f"{dtype} {backend}"


def time_decode(engines: dict, ids: list[int], tokens: int, rounds: int, now=time.perf_counter) -> dict[str, dict]:
    """name -> {tokens_per_s (fastest run), median, runs, token_ids}; engines: name -> run(ids, n) -> Trace."""
    for run in engines.values():
        run(ids, 8)  # warm-up: first-call allocations out of the measurement
    seconds = {name: [] for name in engines}
    outputs = {}
    for _ in range(rounds):
        for name, run in engines.items():
            start = now()
            outputs[name] = run(ids, tokens).token_ids
            seconds[name].append(now() - start)
    out = {}
    for name, runs in seconds.items():
        runs = sorted(runs)
        out[name] = {"tokens_per_s": tokens / runs[0], "median_tokens_per_s": tokens / runs[len(runs) // 2],
                     "seconds": runs, "token_ids": outputs[name]}
    return out


@torch.inference_mode()
def pass_costs(models: dict, ks: list[int], context: int, repeats: int = 5, calls: int = 3,
               now=time.perf_counter) -> dict[str, dict]:
    """name -> K -> seconds of one cached forward over K new tokens (a chain: causal among them, logits for all)
    after `context` committed tokens, for every model and K in ks; interleaved over both, the fastest of
    `repeats` means of `calls` calls."""
    caches, inputs = {}, {}
    for name, model in models.items():
        caches[name] = cache = model.make_cache(1, context + max(ks) + 1)
        generator = torch.Generator().manual_seed(0)
        model(torch.randint(0, model.config.vocab_size, (1, context), generator=generator).to(model.device),
              cache=cache)
        cache.advance(torch.tensor([0]), context)
        inputs[name] = {k: (torch.randint(0, model.config.vocab_size, (1, k), generator=generator).to(model.device),
                            torch.ones(k, k, dtype=torch.bool, device=model.device).tril()[None]) for k in ks}
    best = {name: {k: float("inf") for k in ks} for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
            for k, (ids, mask) in inputs[name].items():
                model(ids, cache=caches[name], tree_mask=mask)  # warm: the first call of a shape allocates
                sync()
                start = now()
                for _ in range(calls):
                    model(ids, cache=caches[name], tree_mask=mask)
                sync()
                best[name][k] = min(best[name][k], (now() - start) / calls)
    return best


def time_batches(llm: LLM, prompts: list[list[int]], tokens: int, rounds: int, now=time.perf_counter) -> dict:
    """Plain generated tokens/s of one prompt alone and of len(prompts) prompts as one batch, interleaved."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    best = {1: float("inf"), len(prompts): float("inf")}
    for _ in range(rounds):
        for n in best:
            start = now()
            llm.generate(prompts[:n], params, use_tqdm=False)
            best[n] = min(best[n], now() - start)
    one, many = tokens / best[1], len(prompts) * tokens / best[len(prompts)]
    return {"batch": len(prompts), "batch1_tokens_per_s": one, "batch_tokens_per_s": many, "ratio": many / one}


def build(config: SpeedConfig, dtype: str, backend: str, speculative_config: dict | None = None) -> LLM:
    """An engine with this dtype and linear backend ("int8": weight-only int8; "gguf": the quantized kernels;
    "auto" with dtype "auto": the engine's defaults)."""
    quantization = "gguf" if backend == "gguf" else "auto" if backend == "auto" else "none"
    llm = LLM(config.model, dtype=dtype, device=config.device, max_num_seqs=max(1, config.batch),
              speculative_config=speculative_config, quantization=quantization)
    if backend in ("onednn", "plain", "int8"):
        int8 = backend == "int8"
        prepare_for_inference(llm.target, "auto" if int8 else backend, quantization="int8" if int8 else None)
    return llm


def time_speculation(config: SpeedConfig, plain: dict[str, LLM], now) -> dict:
    """Plain vs prompt-lookup (`ngram`, K = 8) tokens/s on a prompt that invites copying, per configuration
    (plain: name -> its plain engine), interleaved: speculation composed with each backend and quantization."""
    spec_config = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    engines = {}
    for name, llm in plain.items():
        dtype = str(llm.target.dtype).removeprefix("torch.")
        backend = "gguf" if quantized_format(llm.target) else linear_backend(llm.target)
        ngram = build(config, dtype, backend, spec_config)
        for mode, engine in (("plain", llm), ("ngram", ngram)):
            run = (lambda engine: lambda ids, n: trace_generate(engine, ids, SamplingParams(
                temperature=0, max_tokens=n, ignore_eos=True)))(engine)
            engines[(name, mode)] = (engine, run)
    ids = next(iter(engines.values()))[0].tokenizer.encode_chat([{"role": "user", "content": SPEC_PROMPT}])
    timed = time_decode({k: run for k, (_, run) in engines.items()}, ids, config.tokens, config.rounds, now)
    out = {}
    for (name, mode), (llm, _) in engines.items():
        row = out.setdefault(name, {})
        row[f"{mode}_tokens_per_s"] = timed[(name, mode)]["tokens_per_s"]
        if mode == "ngram":  # (a fresh engine: its totals are this section's alone)
            stats = llm.total_stats
            row["acceptance_rate"] = stats.acceptance_rate if stats.draft_tokens else None
            row["same_tokens"] = timed[(name, "ngram")]["token_ids"] == timed[(name, "plain")]["token_ids"]
    for row in out.values():
        row["speedup"] = row["ngram_tokens_per_s"] / row["plain_tokens_per_s"]
    return {"prompt_tokens": len(ids), "rows": out}


def time_vs_llama_cpp(config: SpeedConfig, log=print) -> dict:
    """Ours (plain, and our default speculation: prompt lookup, adaptive) in the default dtype and fast backend
    against llama.cpp plain on the same GGUF (the reference row), plain on a Q8_0 copy of it and prompt lookup,
    on held-out chat prompts across categories: prompt by prompt, every engine once per round (the fastest of the
    rounds counts), greedy, EOS ignored; each prompt's ids checked against llama-tokenize's."""
    from specdecode.bench.categories import heldout_workloads
    from specdecode.bench.llama_cpp import LlamaCpp, PeerRun, compare
    from specdecode.catalog.registry import cache_dir

    peer = LlamaCpp(config.llama_cpp, threads=torch.get_num_threads())  # as many threads as ours
    gguf = Path(config.model)
    spec_config = {"method": "ngram", "adaptive": True}  # prompt lookup, as llama-lookup drafts (any model's file)
    draft = spec_config.get("num_speculative_tokens", 8)  # ngram's default K: llama-lookup's draft limit alike
    log(f"vs llama.cpp: loading ours (default dtype and backend, plain and {spec_method(spec_config)})")
    ours = {"plain": build(config, "auto", "auto"),
            spec_method(spec_config): build(config, "auto", "auto", spec_config)}
    tokenizer = ours["plain"].tokenizer
    dtype = str(ours["plain"].target.dtype).removeprefix("torch.")
    kept = getattr(ours["plain"], "quantization", None)  # an engine with quantized kernels says which ones it runs
    our_format = (f"{peer.weights_format(gguf) if kept == 'gguf' else kept} kernels, {dtype}" if kept
                  else label(dtype, linear_backend(ours["plain"].target)))
    q8 = peer.requantize(gguf, "Q8_0", cache_dir() / "llama_cpp")
    if q8 is None:
        log("vs llama.cpp: no llama-quantize in the bin directory, so no Q8_0 row")
    params = SamplingParams(temperature=0, max_tokens=config.tokens, ignore_eos=True)

    def mine(mode, llm):
        def run(prompt, ids, text):
            trace = trace_generate(llm, ids, params)
            n, stats = len(trace.token_ids), trace.stats
            return PeerRun("specdecode", mode, our_format, prompt, len(ids), n, (n - 1) / (trace.seconds - trace.ttft),
                           len(ids) / trace.ttft, stats.draft_tokens, stats.accepted_tokens,
                           text=tokenizer.decode(trace.token_ids))
        return run

    def llama(mode, model):
        if mode == "lookup":
            return lambda prompt, ids, text: peer.lookup(model, text, config.tokens, len(ids), draft, prompt)
        return lambda prompt, ids, text: peer.complete(model, text, config.tokens, len(ids), prompt)

    engines = {"llama.cpp plain": llama("plain", gguf)}
    if q8 is not None:
        engines["llama.cpp plain Q8_0"] = llama("plain", q8)
    engines["llama.cpp lookup"] = llama("lookup", gguf)
    engines.update({f"specdecode {mode}": mine(mode, llm) for mode, llm in ours.items()})

    limit = 768 - config.tokens  # bench's prompt limit, less the answer
    workloads = heldout_workloads(config.peer_prompts, fits=lambda m: len(tokenizer.encode_chat(m)) <= limit)
    prompts = [(f"{category}:{i}", p.messages) for category, ps in workloads.items() for i, p in enumerate(ps)]
    for llm in ours.values():
        trace_generate(llm, tokenizer.encode_chat(prompts[0][1]), dataclasses.replace(params, max_tokens=8))
    runs, same_ids = [], {}
    for n, (prompt, messages) in enumerate(prompts):
        text = tokenizer.apply_chat_template(messages)
        ids = tokenizer.encode(text, add_special_tokens=False)  # = encode_chat(messages)
        same_ids[prompt] = peer.tokenize(gguf, text) == ids
        log(f"vs llama.cpp: prompt {n + 1}/{len(prompts)} ({prompt}, {len(ids)} tokens, "
            f"{'same' if same_ids[prompt] else 'DIFFERENT'} ids in llama.cpp)")
        best = {}
        for _ in range(config.rounds):
            for name, run in engines.items():
                r = run(prompt, ids, text)
                if name not in best or r.decode_tokens_per_s > best[name].decode_tokens_per_s:
                    best[name] = r
        runs += best.values()
    reference = next(r.name for r in runs if r.engine == "llama.cpp" and r.mode == "plain")
    log(f"vs llama.cpp: llama-bench passes over K = 1..{config.max_verify} tokens")
    passes = peer.pass_costs(gguf, list(range(1, config.max_verify + 1)))
    return {"bin_dir": str(config.llama_cpp), "reference": reference, "draft": draft, "spec_config": spec_config,
            "pass_costs": passes,
            "same_prompt_ids": same_ids, "rows": compare(runs, reference),
            "runs": [dataclasses.asdict(r) for r in runs]}


def spec_method(spec_config: dict) -> str:
    """A speculative configuration in a few words, e.g. "ngram adaptive"."""
    return f"{spec_config['method']} {'adaptive' if spec_config.get('adaptive', True) else 'fixed'}"


def run_speed(config: SpeedConfig, log=print) -> dict:
    """Run every measurement; returns what speed.json holds."""
    start = time.perf_counter()
    pairs = configurations(config)
    if not pairs:
        raise ConfigError("no dtype/backend configuration can run here; check --dtypes and --backends")
    llms = {}
    for dtype, backend in pairs:
        log(f"loading {label(dtype, backend)}")
        llms[label(dtype, backend)] = build(config, dtype, backend)
    first = next(iter(llms.values()))
    ids = chat_ids(first, QUESTIONS[0])
    params = SamplingParams(temperature=0, max_tokens=config.tokens, ignore_eos=True)

    def ours(llm):
        return lambda prompt, n: trace_generate(llm, prompt, dataclasses.replace(params, max_tokens=n))

    engines = {name: ours(llm) for name, llm in llms.items()}
    info = {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "device": config.device, "native_bf16": cpu_has_native_bf16()}
    if config.peers:
        import transformers

        from specdecode.bench.peers import TransformersEngine

        log("loading transformers float32")
        engines["transformers float32"] = TransformersEngine("plain", config.model, dtype=torch.float32,
                                                             device=config.device).generate
        info["transformers"] = transformers.__version__
    if hasattr(os, "getloadavg"):
        info["load_average_start"] = os.getloadavg()[0]

    log("measuring memory bandwidth")
    bandwidth = measure_read_bandwidth(device=config.device, now=config.now)
    log(f"plain decoding: {config.rounds} interleaved rounds of {len(engines)} engines x {config.tokens} tokens")
    decode = time_decode(engines, ids, config.tokens, config.rounds, config.now)
    bandwidth = max(bandwidth, measure_read_bandwidth(device=config.device, now=config.now))  # again, after: the better of two
    context = len(ids) + config.tokens / 2  # mean context over the decode steps
    for name, llm in llms.items():
        row = decode[name]
        row["backend"] = quantized_format(llm.target) or linear_backend(llm.target)
        row["dtype"] = str(llm.target.dtype).removeprefix("torch.")
        row["bytes_per_step"] = weight_bytes_per_step(llm.target) + kv_bytes_per_step(llm.target, context)
        row["ceiling_tokens_per_s"] = bandwidth / row["bytes_per_step"]
        row["roofline_share"] = row["tokens_per_s"] / row["ceiling_tokens_per_s"]
        row["same_as_first"] = row["token_ids"] == decode[next(iter(llms))]["token_ids"]

    log(f"passes over K = 1..{config.max_verify} tokens")
    ks = list(range(1, config.max_verify + 1))
    verify = {}
    all_costs = pass_costs({name: llm.target for name, llm in llms.items()}, ks, context=int(context),
                           repeats=config.rounds + 2, now=config.now)
    kernels = quant_kernels()
    peak = kernels.int8_peak_macs(0.2) if kernels is not None else 0.0  # the core's int8 multiply-adds a second
    info["int8_peak_gmac_s"] = peak / 1e9
    for name, costs in all_costs.items():
        # the share of each limit a pass reaches: its weights (and cache) read once at the measured bandwidth, and
        # (quantized kernels) its K tokens' multiply-adds at the core's int8 rate
        memory = decode[name]["bytes_per_step"] / bandwidth
        int8 = quantized_format(llms[name].target) is not None and peak > 0
        macs = macs_per_token(llms[name].target)
        verify[name] = {"seconds": costs, "relative": {k: costs[k] / costs[1] for k in ks},
                        "memory_share": {k: memory / costs[k] for k in ks},
                        "arithmetic_share": {k: macs * k / peak / costs[k] for k in ks} if int8 else None}
        decode[name]["forward_ms"] = 1000 * costs[1]
        decode[name]["forward_roofline_share"] = 1 / costs[1] / decode[name]["ceiling_tokens_per_s"]

    batch = {}
    if config.batch > 1:
        prompts = [chat_ids(first, QUESTIONS[i % len(QUESTIONS)]) for i in range(config.batch)]
        for name, llm in llms.items():
            if decode[name]["backend"] != "plain" or len(llms) == 1:
                log(f"batch {config.batch} vs 1: {name}")
                batch[name] = time_batches(llm, prompts, config.tokens, config.rounds, config.now)
    speculation = {}
    if config.speculation:
        # The engines of the default dtype with a fast backend (the others are dropped first: memory).
        default = "bfloat16" if any(p[0] == "bfloat16" for p in pairs) and not any(
            b == "gguf" for _, b in pairs) else pairs[0][0]
        keep = {label(d, b) for d, b in pairs if d == default and (b != "plain" or len(pairs) == 1)}
        plain = {name: llm for name, llm in llms.items() if name in keep}
        del engines, llms, first
        gc.collect()
        log(f"plain vs prompt lookup: {', '.join(plain)}")
        speculation = time_speculation(config, plain, config.now)
    breakdowns = {}
    if config.speculation and any(b == "gguf" for _, b in pairs):
        from specdecode.bench.breakdown import step_breakdowns

        engines = llms = first = plain = None  # (memory)
        gc.collect()
        breakdowns = step_breakdowns(config, SPEC_PROMPT, log)
    vs_llama_cpp = {}
    if config.llama_cpp is not None:
        engines = llms = first = plain = None  # the engines above are done with: memory
        gc.collect()
        vs_llama_cpp = time_vs_llama_cpp(config, log)
    if hasattr(os, "getloadavg"):
        info["load_average_end"] = os.getloadavg()[0]
    info["wall_seconds"] = time.perf_counter() - start
    return {"machine": info, "settings": {**dataclasses.asdict(config), "model": str(config.model),
                                             "llama_cpp": config.llama_cpp and str(config.llama_cpp)},
            "prompt_tokens": len(ids), "bandwidth_gb_s": bandwidth / 1e9, "decode": decode, "verify": verify,
            "batch": batch, "speculation": speculation, "step_breakdown": breakdowns, "vs_llama_cpp": vs_llama_cpp,
            "goals": goals(decode, verify, batch, vs_llama_cpp)}


def goals(decode: dict, verify: dict, batch: dict, vs_llama_cpp: dict | None = None) -> list[dict]:
    """The issues' goals, each with the configuration measured, the figure and whether it is met."""
    out = []
    rows = {(r["engine"], r["mode"], r["format"]): r for r in (vs_llama_cpp or {}).get("rows", [])}
    if rows:
        def median(engine, mode, fmt=None):
            return next((r["decode_tokens_per_s"] for (e, m, f), r in rows.items()
                         if e == engine and m == mode and (fmt is None or fmt in f)), None)

        q41, q80 = median("llama.cpp", "plain", "Q4_1"), median("llama.cpp", "plain", "Q8_0")
        plain = median("specdecode", "plain")
        spec = next((r["decode_tokens_per_s"] for (e, m, _), r in rows.items() if e == "specdecode" and m != "plain"),
                    None)
        for key, ours, theirs, name in (("plain_vs_llama_cpp_q8_0", plain, q80, "specdecode plain"),
                                        ("plain_vs_llama_cpp_q4_1", plain, q41, "specdecode plain"),
                                        ("speculative_vs_llama_cpp_q4_1", spec, q41, "specdecode speculative")):
            if ours and theirs:
                value = ours / theirs  # (medians over prompts: the per-prompt ratios are in the llama.cpp table)
                out.append(dict(goal=key, config=name, value=value, target=GOALS[key], met=value >= GOALS[key]))
    hf = decode.get("transformers float32")
    ours = {n: r for n, r in decode.items() if "backend" in r}
    for dtype, key in (("float32", "plain_fp32_vs_hf_fp32"), ("bfloat16", "plain_bf16_vs_hf_fp32")):
        for name, r in ours.items():
            if hf and r["dtype"] == dtype and (r["backend"] != "plain" or len(ours) == 1):
                ratio = r["tokens_per_s"] / hf["tokens_per_s"]
                out.append(dict(goal=key, config=name, value=ratio, target=GOALS[key], met=ratio >= GOALS[key]))
    for name, r in ours.items():
        if r["backend"] != "plain" or len(ours) == 1:
            out.append(dict(goal="roofline_share", config=name, value=r["roofline_share"],
                            target=GOALS["roofline_share"], met=r["roofline_share"] >= GOALS["roofline_share"]))
    for name, v in verify.items():
        for key in VERIFY_GOALS:
            k = int(key.split("_")[1])
            if k in v["relative"] and (ours[name]["backend"] != "plain" or len(ours) == 1):
                rel = v["relative"][k]
                out.append(dict(goal=key, config=name, value=rel, target=GOALS[key], met=rel <= GOALS[key]))
    for name, b in batch.items():
        out.append(dict(goal=f"batch_{b['batch']}", config=name, value=b["ratio"], target=GOALS["batch_8"],
                        met=b["ratio"] >= GOALS["batch_8"]))
    return out
