"""specdecode: lossless speculative decoding for Llama-family language models.

`from specdecode import LLM, SamplingParams` is the vLLM-shaped entry point; both are imported on first use so
that `specdecode --help` does not pay for loading torch.
"""

import os

# OpenMP threads that wait for the next parallel region by sleeping rather than spinning: between two of a decode
# step's products the Python side runs, and spinning workers then only took a core from it (1.5B Q4_K_M on 2 Zen 4
# cores, one M = 1 product: 3.3 -> 2.6 ms; a small one 0.44 -> 0.32 ms). Read by libgomp when it starts, so set
# here, before torch loads; a value the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_EXPORTS = {"LLM": "specdecode.engine.llm", "SamplingParams": "specdecode.sampling"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'specdecode' has no attribute {name!r}")
