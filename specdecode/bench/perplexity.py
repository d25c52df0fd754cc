"""What the quantized kernels cost in quality: perplexity of a GGUF's model on held-out text through our kernels
(the file's blocks kept, activations rounded to int16 per block of 32) against the same weights dequantised to
float32 (every matrix an nn.Linear of gguf's dequantization; only the embedding lookup is shared). The two differ
only in how the products are computed, so the gap is the kernels' own.

    specdecode bench perplexity --model qwen2.5-coder-1.5b-instruct [--text FILE ...] [--windows 8 --window 512]

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


def window_nll(model: nn.Module, ids: torch.Tensor) -> float:
    """Summed NLL of ids[1:] given their prefixes, in one cached forward (ours: the fused layers)."""
    cache = model.make_cache(1, ids.numel())
    with torch.inference_mode():
        logits = model(ids.view(1, -1), cache=cache).logits[0, :-1].double()  # [T - 1, vocab]
    return -torch.log_softmax(logits, -1).gather(1, ids[1:, None]).sum().item()


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
    report = run(resolve_model(args.model), text, args.windows, args.window)
    print(f"perplexity: kernels {report['kernels']['perplexity']:.4f}, float32 {report['float32']['perplexity']:.4f}, "
          f"gap {100 * report['relative_gap']:+.3f}% over {report['kernels']['tokens']} tokens")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0
