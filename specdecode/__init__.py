"""specdecode: lossless speculative decoding for Llama-family language models.

`from specdecode import LLM, SamplingParams` is the vLLM-shaped entry point; both are imported on first use so
that `specdecode --help` does not pay for loading torch.
"""

_EXPORTS = {"LLM": "specdecode.engine.llm", "SamplingParams": "specdecode.sampling"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'specdecode' has no attribute {name!r}")
