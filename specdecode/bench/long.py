"""Long prompts: prefill and decode speed against the prompt's length, ours against llama.cpp on the same GGUF and text.

    specdecode bench long [--model NAME] [--lengths 512,1024,...] [--tokens 32] [--threads 1] [--llama-cpp BIN_DIR]

For each length N (shortest first, the engines interleaved): a prompt of N tokens cut from CPython's standard library
sources (code, as editors and agents send it), then `tokens` greedy tokens, end of text ignored. Ours: `LLM.stream`
with no speculation and no prefix cache (each prompt begins as the shorter ones do), the prompt prefilled as one
request alone would be; prefill tokens/s = N / time to the first
token, decode tokens/s = tokens after the first / seconds after it. llama.cpp: `llama-completion` on the same text,
timed by its own perf print. Writes results.json, README.md (a table with the ratios) and long.png (tokens/s against
the prompt's length) to --out.
"""
from __future__ import annotations

import json
import sysconfig
import time
from pathlib import Path

from specdecode.errors import ConfigError

DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)


def source_text(min_chars: int) -> str:
    """CPython's standard library modules (top level, in name order) joined until min_chars are there."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(errors="replace")
        parts.append(text)
        size += len(text)
        if size >= min_chars:
            break
    return "\n\n".join(parts)


def time_ours(llm, ids: list[int], tokens: int, now=time.perf_counter) -> dict:
    """Time to the first token and the decode rate after it, plain greedy, for one prompt of token ids."""
    from specdecode.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = now()
    first = None
    for _ in llm.stream(ids, params):
        if first is None:
            first = now()
    end = now()
    return {"prompt_tokens": len(ids), "ttft_s": first - start, "prefill_tokens_per_s": len(ids) / (first - start),
            "decode_tokens_per_s": (tokens - 1) / (end - first) if end > first else None}


def run_long(model: str, lengths: list[int], tokens: int, threads: int, llama_cpp: Path | None,
             log=print) -> dict:
    import torch

    from specdecode.catalog.registry import resolve_model
    from specdecode.bench.llama_cpp import LlamaCpp
    from specdecode.engine.llm import LLM
    from specdecode.hardware import cpu_name
    from specdecode.model.gguf import find_gguf

    path = resolve_model(model)
    gguf = find_gguf(path) if Path(path).is_dir() else Path(path)
    peer = LlamaCpp(llama_cpp, threads) if llama_cpp else None  # refused here, before anything loads, if incomplete
    torch.set_num_threads(threads)
    # no prefix cache: each length's prompt begins as the shorter ones did, and must be prefilled whole
    llm = LLM(str(path), speculative_config=None, max_num_seqs=1, max_model_len=max(lengths) + tokens + 8,
              threads=threads, enable_prefix_caching=False)
    if max(lengths) + tokens > llm.max_model_len:
        raise ConfigError(f"--lengths go up to {max(lengths)} but the model's context is {llm.max_model_len}")
    ids = llm.tokenizer.encode(source_text(6 * max(lengths)), add_special_tokens=False)
    if len(ids) < max(lengths):
        raise ConfigError(f"the standard library text has {len(ids)} tokens, fewer than --lengths' {max(lengths)}")
    time_ours(llm, ids[:64], 4)  # the first request pays one-off costs (the kernels' first calls): not a length's
    rows = []
    for n in sorted(lengths):
        prompt = ids[:n]
        ours = time_ours(llm, prompt, tokens)
        row = {"length": n, "ours": ours}
        log(f"{n:6d} tokens: ours prefill {ours['prefill_tokens_per_s']:.1f} tok/s (TTFT {ours['ttft_s']:.1f} s), "
            f"decode {ours['decode_tokens_per_s']:.2f} tok/s")
        if peer is not None:
            run = peer.complete(gguf, llm.tokenizer.decode(prompt), tokens, n, prompt=f"long:{n}")
            row["llama.cpp"] = {"prompt_tokens": n, "prefill_tokens_per_s": run.prompt_tokens_per_s,
                                "ttft_s": n / run.prompt_tokens_per_s,
                                "decode_tokens_per_s": run.decode_tokens_per_s}
            log(f"{n:6d} tokens: llama.cpp prefill {run.prompt_tokens_per_s:.1f} tok/s, decode "
                f"{run.decode_tokens_per_s:.2f} tok/s")
        rows.append(row)
    return {"model": str(path), "threads": threads, "tokens": tokens, "cpu": cpu_name(),
            "kv_cache_dtype": str(llm.runner.cache.k[0].dtype).replace("torch.", ""), "rows": rows}


def markdown(results: dict) -> str:
    rows = results["rows"]
    peer = "llama.cpp" in rows[0]
    base = rows[0]["ours"]
    head = ("| prompt tokens | prefill tok/s | vs first row | TTFT s | decode tok/s | vs first row |"
            + (" llama.cpp prefill | ratio | llama.cpp decode | ratio |" if peer else ""))
    lines = [f"# Long prompts: {Path(results['model']).name}", "",
             f"{results['cpu']}, {results['threads']} thread(s), KV cache {results['kv_cache_dtype']}, "
             f"{results['tokens']} greedy tokens after each prompt.", "", head,
             "|" + "---:|" * (head.count("|") - 1)]
    for r in rows:
        o = r["ours"]
        cells = [f"{r['length']:,}", f"{o['prefill_tokens_per_s']:.1f}",
                 f"{o['prefill_tokens_per_s'] / base['prefill_tokens_per_s']:.2f}x", f"{o['ttft_s']:.1f}",
                 f"{o['decode_tokens_per_s']:.2f}", f"{o['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x"]
        if peer:
            p = r["llama.cpp"]
            cells += [f"{p['prefill_tokens_per_s']:.1f}", f"{o['prefill_tokens_per_s'] / p['prefill_tokens_per_s']:.2f}x",
                      f"{p['decode_tokens_per_s']:.2f}", f"{o['decode_tokens_per_s'] / p['decode_tokens_per_s']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "prefill_tokens_per_s", "prefill"), (axes[1], "decode_tokens_per_s", "decode")):
        for engine, style in (("ours", "o-"), ("llama.cpp", "s--")):
            if engine in rows[0]:
                ax.plot([r["length"] for r in rows], [r[engine][key] for r in rows], style,
                        label="specdecode" if engine == "ours" else engine)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{title}, {results['threads']} thread(s)")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle(f"{Path(results['model']).name} on {results['cpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_bench_long(args) -> int:
    results = run_long(args.model, args.lengths, args.tokens, args.threads, args.llama_cpp)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "README.md").write_text(markdown(results))
    plot(results, args.out / "long.png")
    print(markdown(results))
    print(f"wrote {args.out / 'results.json'}, README.md and long.png")
    return 0
