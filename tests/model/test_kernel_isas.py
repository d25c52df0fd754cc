"""The kernels built for other instruction sets than this CPU's give this build's numbers bit for bit: AVX2 without
VNNI (`-march=znver3`: vpmaddubsw + vpmaddwd instead of vpdpbusd) and no AVX2 at all (`-march=x86-64`: the scalar
reference as the kernel). Each build takes a minute or more, so this runs only when asked:

    SPECDECODE_ISA_CHECK=1 python -m pytest tests/model/test_kernel_isas.py
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from specdecode import kernels as compiled
from specdecode.model.quant import BLOCKS, FORMATS, kernels

from .gguf_files import random_blocks

pytestmark = [pytest.mark.skipif(not os.environ.get("SPECDECODE_ISA_CHECK"), reason="SPECDECODE_ISA_CHECK=1 runs it"),
              pytest.mark.skipif(kernels() is None, reason="the quantized kernels cannot be compiled here")]


@pytest.mark.parametrize("march, isa", [("znver3", "avx2"), ("x86-64", "scalar")])
def test_another_instruction_set_gives_the_same_bits(march, isa, tmp_path):
    from torch.utils import cpp_extension

    flags = [flag for flag in compiled.FLAGS if not flag.startswith("-march")] + [f"-march={march}"]
    other = cpp_extension.load(name=f"specdecode_quant_{isa}_check", extra_cflags=flags, extra_ldflags=["-fopenmp"],
                               sources=[str(p) for p in compiled.SOURCES if p.suffix == ".cpp"],
                               build_directory=str(tmp_path), verbose=False)
    assert other.instruction_set() == isa
    rng = np.random.default_rng(0)
    try:
        for k_block in (32, 256):  # the K-quants' activations per 32 (default) and per 256 values
            other.set_k_activation_block(k_block), kernels().set_k_activation_block(k_block)
            for fmt in FORMATS:
                for K in ([256, 1536] if BLOCKS[fmt][0] == 256 else [96, 576, 896]):
                    q = torch.from_numpy(random_blocks(fmt, 45, K, rng))
                    for M in (1, 3, 8, 11, 17):
                        x = torch.randn(M, K)
                        theirs = other.qmatmul(x, q, FORMATS[fmt], True)
                        assert torch.equal(theirs, kernels().qmatmul(x, q, FORMATS[fmt], True)), (fmt, K, M, k_block)
                        assert torch.equal(theirs, other.qmatmul(x, q, FORMATS[fmt], False)), (fmt, K, M, k_block)
    finally:
        kernels().set_k_activation_block(32)


@pytest.mark.parametrize("march, isa", [("znver3", "avx2"), ("x86-64", "scalar")])
def test_attention_on_another_instruction_set_gives_the_same_bits(march, isa, tmp_path):
    from torch.utils import cpp_extension

    flags = [flag for flag in compiled.FLAGS if not flag.startswith("-march")] + [f"-march={march}"]
    other = cpp_extension.load(name=f"specdecode_attention_{isa}_check", extra_cflags=flags,
                               extra_ldflags=["-fopenmp"], build_directory=str(tmp_path), verbose=False,
                               sources=[str(p) for p in compiled.SOURCES if p.suffix == ".cpp"])
    from tests.model.test_q8_cache import packed

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8):
        keys = torch.randn(12, 2, 64, 16, generator=g)
        values = torch.randn(12, 2, 16, 64, generator=g)
        if dtype == torch.int8:  # the 8-bit cache: values and their scales
            keys, values, _, _ = packed(keys, values)
        else:
            keys, values = keys.to(dtype), values.to(dtype)
        tables = torch.randperm(12, generator=g)[:10].view(2, 5)
        for T, tree in ((1, False), (7, False), (5, True)):
            q = torch.randn(2 * T, 6 * 64, generator=g)
            visible = torch.tril(torch.ones(T, T, dtype=torch.bool)).expand(2, T, T).clone() if tree else None
            if tree:
                visible[:, -1, 1] = False  # a node that skips one position: its fresh tiles are gathered
            lengths = torch.tensor([37, 50])
            args = (q, keys, values, tables, lengths, 0, visible, 6, 2, T)
            assert torch.equal(other.attention(*args), kernels().attention(*args)), (dtype, T, tree)
