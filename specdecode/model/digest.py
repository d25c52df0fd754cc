"""A digest that names a model's weights, whatever file format they came from: speculators record the digest of
the target they were trained for, and are refused on any other."""
from __future__ import annotations

import hashlib

import torch


def weights_digest(model) -> str:
    """sha256 over the target's parameter names and values rounded to bfloat16: names the weights a speculator
    was trained for, whatever file format they came from and whether they were loaded in float32 or bfloat16.
    A tensor-parallel target (parallel/driver.py) carries the digest of its whole weights, taken before sharding."""
    if getattr(model, "unsharded_digest", None):
        return model.unsharded_digest
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        digest.update(name.encode())
        digest.update(tensor.detach().to(torch.bfloat16).cpu().contiguous().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()
