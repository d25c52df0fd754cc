"""What the quantized kernels cost in quality: perplexity of a GGUF's model on held-out text through our kernels
(the file's blocks kept, activations rounded to int16 per block of 32) against the same weights dequantised to
float32 (every matrix an nn.Linear of gguf's dequantization; only the embedding lookup is shared). The two differ
only in how the products are computed, so the gap is the kernels' own.

    specdecode bench perplexity --model qwen2.5-coder-1.5b-instruct [--text FILE ...] [--windows 8 --window 512]

With --kv-cache-dtypes float32 float16 bfloat16 it compares instead what storing the KV cache in fewer bytes costs:
perplexity through the kernels with each cache dtype (the first the baseline), over long windows
(`--window 4096`), prefilled in chunks of 512 tokens.

Held-out text by default: CPython's own standard library sources as installed (code a coder model may have seen in
training, but the same for both sides; the figure compared is the ratio). Each window is one uncached forward of
`window` tokens; perplexity is exp(mean NLL of every token after the first of each window).
"""
from __future__ import annotations

import json
import math
import sysconfig
import time
from pathlib import Path

import torch
from torch import nn

DEFAULT_SOURCES = ("json/decoder.py", "textwrap.py", "heapq.py", "bisect.py", "fractions.py", "shlex.py",
                   "graphlib.py", "statistics.py")
"""Standard library files read for the default held-out text (whichever exist)."""


def default_text() -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join((root / name).read_text() for name in DEFAULT_SOURCES if (root / name).is_file())


def dequantised_copy(model: nn.Module) -> nn.Module:
    """`model` with every QuantLinear replaced, in place, by an nn.Linear of its dequantised weights (float32)."""
    from specdecode.model.quant import QuantLinear

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantLinear):
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                linear.weight = nn.Parameter(child.weight.float(), requires_grad=False)
                if child.bias is not None:
                    linear.bias = nn.Parameter(child.bias.detach().float(), requires_grad=False)
                setattr(parent, name, linear)
    model.__dict__.pop("_fused_layers", None)
    return model


CHUNK = 512
"""Tokens per cached forward of a window (a long window's logits would not fit in memory at once)."""


def window_nll(model: nn.Module, ids: torch.Tensor, kv_dtype: torch.dtype | None = None) -> float:
    """Summed NLL of ids[1:] given their prefixes, in cached forwards of CHUNK tokens (ours: the fused layers), the
    cache stored as kv_dtype (default: the model's)."""
    cache = model.make_cache(1, ids.numel(), block_size=16, dtype=kv_dtype)
    total = 0.0
    for start in range(0, ids.numel() - 1, CHUNK):
        chunk = ids[start:start + CHUNK]
        with torch.inference_mode():
            logits = model(chunk.view(1, -1), cache=cache).logits[0].double()  # [T, vocab]
        cache.lengths[0] += chunk.numel()
        targets = ids[start + 1:start + 1 + chunk.numel()]
        logits = logits[:targets.numel()]
        total -= torch.log_softmax(logits, -1).gather(1, targets[:, None]).sum().item()
    return total


def run_cache_dtypes(model_path: Path, text: str, windows: int, window: int, dtypes: list[str], log=print) -> dict:
    """Through the kernels with the KV cache stored in each of `dtypes` (the first is the baseline), the same chunks
    interleaved: each dtype's perplexity, and against the baseline the mean KL divergence of the next-token
    distributions and how often the top token is the same (llama.cpp's perplexity tool's measures)."""
    from specdecode.model.cache import KV_DTYPES
    from specdecode.model.loading import load_model
    from specdecode.model.tokenizer import Tokenizer

    ids = torch.tensor(Tokenizer(model_path).encode(text, add_special_tokens=False))
    count = min(windows, ids.numel() // window)
    model = load_model(model_path, dtype="float32", quantization="gguf")
    nll = dict.fromkeys(dtypes, 0.0)
    kl = dict.fromkeys(dtypes, 0.0)
    same_top = dict.fromkeys(dtypes, 0)
    seconds = dict.fromkeys(dtypes, 0.0)
    scored = 0
    for i in range(count):
        window_ids = ids[i * window:(i + 1) * window]
        caches = {name: model.make_cache(1, window, block_size=16, dtype=KV_DTYPES[name]) for name in dtypes}
        for start in range(0, window - 1, CHUNK):
            chunk = window_ids[start:start + CHUNK]
            targets = window_ids[start + 1:start + 1 + chunk.numel()]
            base = None
            for name in dtypes:
                began = time.perf_counter()
                with torch.inference_mode():
                    logits = model(chunk.view(1, -1), cache=caches[name]).logits[0, :targets.numel()]
                seconds[name] += time.perf_counter() - began
                caches[name].lengths[0] += chunk.numel()
                logp = torch.log_softmax(logits.double(), -1)  # [n, vocab]
                nll[name] -= logp.gather(1, targets[:, None]).sum().item()
                if base is None:
                    base = logp
                kl[name] += (base.exp() * (base - logp)).sum().item()
                same_top[name] += (logp.argmax(-1) == base.argmax(-1)).sum().item()
            scored += targets.numel()
            log(f"window {i + 1}/{count}, {start + chunk.numel()} tokens: " + ", ".join(
                f"{name} {math.exp(nll[name] / scored):.4f}" for name in dtypes))
    results = {name: {"perplexity": math.exp(nll[name] / scored), "nll": nll[name], "tokens": scored,
                      "mean_kl": kl[name] / scored, "same_top_token": same_top[name] / scored,
                      "seconds": seconds[name]} for name in dtypes}
    base = results[dtypes[0]]["perplexity"]
    gaps = {name: r["perplexity"] / base - 1 for name, r in results.items()}
    return {"model": str(model_path), "windows": count, "window": window, "cache_dtypes": results,
            "relative_gap": gaps}


def run(model_path: Path, text: str, windows: int, window: int, log=print) -> dict:
    from specdecode.model.loading import load_model
    from specdecode.model.tokenizer import Tokenizer

    ids = torch.tensor(Tokenizer(model_path).encode(text, add_special_tokens=False))
    count = min(windows, ids.numel() // window)
    chunks = [ids[i * window:(i + 1) * window] for i in range(count)]
    results = {}
    for name in ("kernels", "float32"):
        model = load_model(model_path, dtype="float32", quantization="gguf")
        if name == "float32":
            model = dequantised_copy(model)
        start, total = time.perf_counter(), 0.0
        for i, chunk in enumerate(chunks):
            total += window_nll(model, chunk)
            log(f"{name}: window {i + 1}/{count}, running perplexity {math.exp(total / ((i + 1) * (window - 1))):.4f}")
        results[name] = {"nll": total, "tokens": count * (window - 1),
                         "perplexity": math.exp(total / (count * (window - 1))),
                         "seconds": time.perf_counter() - start}
        del model
    gap = results["kernels"]["perplexity"] / results["float32"]["perplexity"] - 1
    return {"model": str(model_path), "windows": count, "window": window, **results, "relative_gap": gap}


def cmd_bench_perplexity(args) -> int:
    from specdecode.catalog.registry import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    text = "\n\n".join(Path(p).read_text() for p in args.text) if args.text else default_text()
    if args.kv_cache_dtypes:
        report = run_cache_dtypes(resolve_model(args.model), text, args.windows, args.window, args.kv_cache_dtypes)
        print("perplexity by KV cache dtype: " + ", ".join(
            f"{name} {r['perplexity']:.4f} ({100 * report['relative_gap'][name]:+.3f}%, KL {r['mean_kl']:.2e}, "
            f"same top token {100 * r['same_top_token']:.2f}%)"
            for name, r in report["cache_dtypes"].items()) + f" over {report['windows']} x {report['window']} tokens")
    else:
        report = run(resolve_model(args.model), text, args.windows, args.window)
        print(f"perplexity: kernels {report['kernels']['perplexity']:.4f}, float32 "
              f"{report['float32']['perplexity']:.4f}, gap {100 * report['relative_gap']:+.3f}% over "
              f"{report['kernels']['tokens']} tokens")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0
