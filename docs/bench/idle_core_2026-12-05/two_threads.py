"""Issue 48 item 3, the measurement before building anything: do the 2 vCPUs behave as separate cores on one product?
Times the 1.5B's largest quantized matrices (a layer's gate_up and down, as loaded by specdecode) at M = 1 and M = 5
with 1 and 2 torch threads, interleaved rounds, median.

    python docs/bench/idle_core_2026-12-05/two_threads.py --rounds 15
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from specdecode.catalog.registry import model_path
from specdecode.model.loading import load_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    model = load_model(model_path("qwen2.5-coder-1.5b-instruct"), dtype=torch.float32, quantization="gguf")
    mlp = model.model.layers[0].mlp
    mats = {"gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
    times = {}
    with torch.no_grad():
        for _ in range(args.rounds):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for name, m in mats.items():
                    for M in (1, 5):
                        x = torch.randn(M, m.in_features)
                        m(x)
                        t = time.perf_counter()
                        for _ in range(10):
                            m(x)
                        times.setdefault(f"{name} M={M} threads={threads}", []).append((time.perf_counter() - t) / 10)
    med = {k: 1000 * statistics.median(v) for k, v in times.items()}
    out = {"ms_median": med, "ms_min": {k: 1000 * min(v) for k, v in times.items()},
           "rounds": args.rounds, "command": " ".join(sys.argv)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
