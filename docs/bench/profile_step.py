# Record: how docs/bench/speed_profile.md was made: python docs/bench/profile_step.py --model /path/to/SmolLM2 --dtype bfloat16 --out docs/bench/speed_profile.md
"""Where the time of one plain decode step goes: torch.profiler over cached one-token forwards, by operator,
plus the step timed against its linear layers alone (interleaved, fastest of several rounds).

    python docs/bench/profile_step.py --model DIR [--dtype bfloat16] [--quantization gguf] [--context 100] [--clock cpu]
"""
from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from specdecode.model.linear import PackedLinear
from specdecode.model.loading import load_model
from specdecode.model.quant import QuantLinear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None, help="gguf, q8_0, q4_0, q4_1 or int8 (default: float)")
    parser.add_argument("--context", type=int, default=100, help="committed tokens before the step (default 100)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--out", type=Path, default=None, help="also write the summary (markdown) here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    now = time.thread_time if args.clock == "cpu" else time.perf_counter
    model = load_model(args.model, dtype=args.dtype, device="cpu", quantization=args.quantization)
    cache = model.make_cache(1, args.context + 8)
    linears = [m for m in model.modules() if isinstance(m, PackedLinear | torch.nn.Linear | QuantLinear)]
    inputs = {m.in_features: torch.randn(1, m.in_features, dtype=model.dtype) for m in linears}
    token = torch.tensor([[5]])
    lines = []
    with torch.inference_mode():
        model(torch.randint(0, model.config.vocab_size, (1, args.context)), cache=cache)
        cache.advance(torch.tensor([0]), args.context)
        for _ in range(3):
            model(token, cache=cache)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                model(token, cache=cache)
        top = Counter(e.name for e in prof.events() if e.cpu_parent is None)
        weights = f", weights {args.quantization}" if args.quantization else ""
        lines += [f"One-token forward of `{args.model.name}` in {args.dtype}{weights} after {args.context} tokens, 1 thread: "
                  f"{sum(top.values()) // args.steps} operators per forward "
                  f"({', '.join(f'{n} {c // args.steps}' for n, c in top.most_common(8))}).", "",
                  "```", prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), "```", ""]

        def forward():
            model(token, cache=cache)

        def linears_alone():
            for m in linears:
                m(inputs[m.in_features])

        best = {"forward": float("inf"), "linear layers alone": float("inf")}
        for _ in range(7):
            for name, fn in (("forward", forward), ("linear layers alone", linears_alone)):
                fn()
                start = now()
                for _ in range(5):
                    fn()
                best[name] = min(best[name], (now() - start) / 5)
    rest = best["forward"] - best["linear layers alone"]
    lines.append(f"Timed ({args.clock} clock, fastest of 7 interleaved rounds of 5): forward "
                 f"{1000 * best['forward']:.2f} ms, its {len(linears)} linear layers alone "
                 f"{1000 * best['linear layers alone']:.2f} ms, everything else {1000 * rest:.2f} ms "
                 f"({100 * rest / best['forward']:.0f}%).")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
