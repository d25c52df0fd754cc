# Record: how docs/bench/speed_kernels.md (docs/speed.md) was made: python docs/bench/linear_kernels.py --model /path/to/SmolLM2 --clock cpu --out docs/bench/speed_kernels.md
"""The CPU linear kernels a decoder could use, on the weight shapes of a real checkpoint: the evidence behind
model/linear.py's backend choice and the int8 decision (docs/speed.md).

For every kernel: the time to multiply M tokens by all the layer matrices of the model (q/k/v and gate/up
stacked, as the decoder holds them) plus the output head, for M in 1, 4, 8, 9, 16; interleaved rounds, the
fastest counts; time by the calling thread's CPU clock (--clock cpu, for a shared machine) or the wall clock.

    python docs/bench/linear_kernels.py --model DIR [--clock cpu] [--out docs/bench/speed_kernels.md]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.model.linear import PackedLinear
from specdecode.model.loading import load_model

MS = (1, 4, 8, 9, 16)


def kernels(weights: list[torch.Tensor]) -> dict:
    """name -> (prepared weights, call(x, prepared) -> y, input dtype). weights: float32 [out, in] matrices."""
    def per_channel_int8(w):
        scale = w.abs().amax(dim=1).clamp_min(1e-8) / 127  # [out]
        return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale

    out = {}
    for dtype, tag in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        plain = [w.to(dtype) for w in weights]
        out[f"F.linear {tag}"] = (plain, lambda x, w: F.linear(x, w), dtype)
        out[f"oneDNN prepacked {tag}"] = ([torch.ops.mkldnn._reorder_linear_weight(w) for w in plain],
                                          lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                                          dtype)
    out["MKL prepacked float32 (_mkl_linear)"] = (
        [(torch.ops.mkl._mkl_reorder_linear_weight(w, 1), w) for w in weights],
        lambda x, w: torch.ops.mkl._mkl_linear(x, w[0], w[1], None, 1), torch.float32)
    int8 = [per_channel_int8(w) for w in weights]
    for dtype, tag in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        out[f"int8 weight-only _weight_int8pack_mm, {tag} activations"] = (
            [(q, s.to(dtype)) for q, s in int8], lambda x, w: torch.ops.aten._weight_int8pack_mm(x, w[0], w[1]), dtype)
    dynamic = []
    for w in weights:
        layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        layer.weight.data = w
        dynamic.append(torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(layer), {torch.nn.Linear},
                                                              dtype=torch.qint8)[0])
    out["int8 dynamic W8A8 (fbgemm quantize_dynamic)"] = (dynamic, lambda x, w: w(x), torch.float32)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    now = time.thread_time if args.clock == "cpu" else time.perf_counter
    model = load_model(args.model, dtype="float32", device="cpu")
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear | PackedLinear)]
    total = sum(w.numel() for w in weights)
    del model
    table = kernels(weights)
    best = {name: {m: float("inf") for m in MS} for name in table}
    with torch.inference_mode():
        inputs = {(m, dtype, k): torch.randn(m, k, dtype=dtype) for m in MS for dtype in (torch.float32, torch.bfloat16)
                  for k in {w.shape[1] for w in weights}}
        for _ in range(args.rounds):
            for name, (prepared, call, dtype) in table.items():
                for m in MS:
                    xs = [inputs[(m, dtype, w.shape[1])] for w in weights]
                    start = now()
                    for x, w in zip(xs, prepared):
                        call(x, w)
                    best[name][m] = min(best[name][m], now() - start)
    lines = [f"{len(weights)} matrices, {total / 1e6:.1f} M weights (float32: {4 * total / 1e6:.0f} MB); ms for all "
             f"of them, fastest of {args.rounds} interleaved rounds, {args.clock} clock, 1 thread.", "",
             "| kernel | " + " | ".join(f"M={m}" for m in MS) + f" | M=1 GB/s | M=9 / M=1 |",
             "|---|" + "---:|" * (len(MS) + 2)]
    for name, row in best.items():
        bytes_ = {"float32": 4, "bfloat16": 2}.get(name.split()[-1], 1 if "int8" in name else 4) * total
        lines.append(f"| {name} | " + " | ".join(f"{1000 * row[m]:.1f}" for m in MS)
                     + f" | {bytes_ / row[1] / 1e9:.1f} | {row[9] / row[1]:.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
