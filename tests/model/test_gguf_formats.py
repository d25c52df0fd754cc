"""Every GGUF block format the kernels keep (model/quant.py FORMATS), end to end on tiny Qwen2-shaped files (q/k/v
biases): kept as shipped, run through the fused layers, close to the dequantised model, batch-invariant bit for
bit, and greedy speculation token for token plain decoding; a Q4_K_M-like mix of formats kept whole; a type the
kernels do not keep dequantised with one line."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from specdecode.engine.llm import LLM
from specdecode.model.loading import load_model
from specdecode.model import quant
from specdecode.model.quant import BLOCKS, QuantEmbedding, QuantLinear, quantized_format
from specdecode.model.tokenizer import Tokenizer
from specdecode.sampling import SamplingParams

from .gguf_files import tiny_model, write_gguf

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.usefixtures("built_kernels")

KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
Q4_K_M = {"attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K", "output.weight": "Q6_K"}
"""llama.cpp's Q4_K_M mix over a Q4_K file: v, the MLP's down projection and the untied output head in Q6_K."""
IDS = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 64, 128, 17, 42], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 299, 150]])
TOLERANCE = 5e-2
"""Largest logit error of the kept model, relative to the largest logit of the dequantised one. The kernels round
each block of 32 activations to int8 (as llama.cpp does; test_quant.py checks the products against exactly that
rounding to 3e-5): on these tiny random models that alone moved logits by up to 1.2e-2 of the largest. A matrix
read wrongly moves them by far more (test_the_tolerance_sees_one_wrong_block)."""
SCALE_OFFSETS = {"Q6_K": 208}
"""Where a block's float16 scale d lies (byte 0 in the other kept formats)."""
BIAS_SCALE = 0.02
"""What `written(..., small_biases=True)` multiplies the q/k/v biases by."""
K_QUANT_MEANS = {"Q4_K": 7.5, "Q5_K": 15.5}
"""The mean of a Q4_K / Q5_K quant (4 / 5 bits, unsigned)."""


def centre_k_quants(path: Path) -> None:
    """Make the random Q4_K / Q5_K blocks of a written file zero-mean, as real weights are: each sub-block's min m
    equal to its scale sc and dmin = d x the quants' mean, so w = d sc q - dmin m = d sc (q - mean). (Random
    blocks have w > 0 on average: a model of them predicts one token everywhere, and greedy speculation on it
    proves nothing.) Scale bytes (llama.cpp get_scale_min_k4): 4-7 the sc of sub-blocks 0-3 and the top bits of
    4-7's, 8-11 the same for the mins, 12-15 the low nibbles of sub-blocks 4-7's sc (low) and m (high)."""
    reader = gguf.GGUFReader(path, "r+")
    for tensor in reader.tensors:
        mean = K_QUANT_MEANS.get(tensor.tensor_type.name)
        if mean is None:
            continue
        blocks = tensor.data.reshape(-1, BLOCKS[tensor.tensor_type.name.lower()][1])  # [blocks, bytes], in the file
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
        blocks[:, 2:4] = (d * mean).astype(np.float16).view(np.uint8)
        blocks[:, 8:12] = blocks[:, 4:8]
        blocks[:, 12:16] = (blocks[:, 12:16] & 0x0F) * 0x11
    reader.data.flush()


@pytest.fixture(scope="module")
def written(tiny_models, tmp_path_factory):
    """Write (once per module) a tiny qwen2 GGUF: write(qtype, mixed, tied, small_biases) -> path, its K-quant blocks
    centred. mixed: the Q4_K_M mix over qtype. small_biases: q/k/v biases near 0 instead of tiny_model's near 1,
    which add the same large vector at every position; with an untied head each position then predicts from its
    context instead of one token everywhere."""
    root = tmp_path_factory.mktemp("gguf-formats")
    tokenizer_json = tiny_models["tok"] / "tokenizer.json"
    vocab = Tokenizer(tiny_models["target"]).vocab_size
    made = {}

    def write(qtype: str, mixed: bool = False, tied: bool = True, small_biases: bool = False) -> Path:
        key = (qtype, mixed, tied, small_biases)
        if key not in made:
            model = tiny_model("qwen2", vocab, tied=tied)
            if small_biases:
                with torch.no_grad():
                    for layer in model.model.layers:
                        layer.self_attn.qkv_proj.bias.mul_(BIAS_SCALE)
            name = f"{qtype}{'-M' if mixed else ''}{'-tied' if tied else ''}{'-small-biases' if small_biases else ''}"
            path = write_gguf(root / f"{name}.gguf", model, tokenizer_json, "qwen2", qtype,
                              tensor_types=Q4_K_M if mixed else None)
            centre_k_quants(path)
            made[key] = path
        return made[key]

    return write


def cached_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of one cached forward over ids [B, T] into a fresh cache."""
    with torch.inference_mode():
        return model(ids, cache=model.make_cache(ids.shape[0], 64)).logits


def stepped_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The same, one token a step: T cached forwards of one token each."""
    cache, rows, steps = model.make_cache(ids.shape[0], 64), torch.arange(ids.shape[0]), []
    with torch.inference_mode():
        for t in range(ids.shape[1]):
            steps.append(model(ids[:, t:t + 1], cache=cache).logits)
            cache.advance(rows, 1)
    return torch.cat(steps, dim=1)


def matrices(model) -> list[nn.Module]:
    """The layers' matrices and the output head."""
    out = [model.lm_head]
    for layer in model.model.layers:
        out += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    return out


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_kept_format_runs_fused_close_to_the_dequantised_model(written, qtype):
    """quantization='gguf' keeps every matrix in the file's format (the tied head too) and runs the fused layers,
    batch-invariant; its logits are the dequantised float32 model's to TOLERANCE; and a forward over 12 tokens
    equals 12 one-token cached steps, and a row beside another row equals that row alone, bit for bit (the float
    model's do not: oneDNN's rounding depends on the rows, ~1e-6 here)."""
    fmt = qtype.lower()
    path = written(qtype)
    kept = load_model(path, dtype="float32", quantization="gguf")
    assert quantized_format(kept) == fmt
    assert all(isinstance(m, QuantLinear) and m.formats == [fmt] * len(m.formats) for m in matrices(kept))
    assert isinstance(kept.model.embed_tokens, QuantEmbedding) and kept.model.embed_tokens.fmt == fmt
    assert all(layer.self_attn.qkv_proj.bias is not None for layer in kept.model.layers)  # qwen2's q/k/v biases
    assert kept.fused_layers(kept.make_cache(1, 8)) is not None and kept.batch_invariant

    dense = load_model(path, dtype="float32")
    assert quantized_format(dense) is None and not dense.batch_invariant  # the control is really float weights
    ours, reference = cached_logits(kept, IDS), cached_logits(dense, IDS)
    assert reference.abs().max() > 1.0  # a real signal, not all zeros
    assert (ours - reference).abs().max() < TOLERANCE * reference.abs().max()

    assert torch.equal(stepped_logits(kept, IDS), ours)
    alone = torch.cat([cached_logits(kept, IDS[row:row + 1]) for row in range(IDS.shape[0])])
    assert torch.equal(alone, ours)


def test_a_q4_k_m_mix_is_kept_whole(written, capsys):
    """A Q4_K_M-like file (q/k, o, gate/up, the embedding in Q4_K; v, down and the untied head in Q6_K): q/k/v is
    one stacked matrix of two formats whose v part is the file's Q6_K bytes as shipped, every matrix stays
    quantized (only norms and biases are float, nothing is said about dequantising), and the layers run fused."""
    path = written("Q4_K", tied=False, mixed=True)
    model = load_model(path, dtype="float32", quantization="gguf")
    assert capsys.readouterr().err == ""
    file_tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert file_tensors["blk.0.attn_v.weight"].tensor_type.name == "Q6_K"  # the writer wrote the mix
    assert file_tensors["blk.0.attn_output.weight"].tensor_type.name == "Q4_K"
    assert file_tensors["output.weight"].tensor_type.name == "Q6_K"
    for i, layer in enumerate(model.model.layers):
        qkv = layer.self_attn.qkv_proj
        assert isinstance(qkv, QuantLinear) and qkv.formats == ["q4_k", "q4_k", "q6_k"] and qkv.fmt == "q4_k+q6_k"
        assert qkv.bias is not None
        v_rows = np.asarray(file_tensors[f"blk.{i}.attn_v.weight"].data)
        assert torch.equal(qkv.qweights[2], torch.from_numpy(v_rows))
        assert layer.self_attn.o_proj.fmt == "q4_k" and layer.mlp.gate_up_proj.fmt == "q4_k"
        assert layer.mlp.down_proj.fmt == "q6_k"
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.fmt == "q6_k"
    assert isinstance(model.model.embed_tokens, QuantEmbedding) and model.model.embed_tokens.fmt == "q4_k"
    assert not any(isinstance(m, nn.Linear | nn.Embedding) for m in model.modules())
    floats = [name for name, _ in model.named_parameters()]
    assert floats and all(name.endswith(("norm.weight", ".bias")) for name in floats), floats
    assert model.fused_layers(model.make_cache(1, 8)) is not None and model.batch_invariant
    ours = cached_logits(model, IDS)
    reference = cached_logits(load_model(path, dtype="float32"), IDS)
    assert (ours - reference).abs().max() < TOLERANCE * reference.abs().max()
    assert torch.equal(stepped_logits(model, IDS), ours)


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_the_tolerance_sees_one_wrong_block(written, qtype, tmp_path):
    """Control for TOLERANCE: the dequantised model of a copy whose first block of blk.1.attn_v has its scale
    multiplied by 16 (32 or 256 of the matrix's 32,768 weights) is off the kept original by more than twice it."""
    path = written(qtype)
    copy = tmp_path / "one-wrong-block.gguf"
    copy.write_bytes(path.read_bytes())
    reader = gguf.GGUFReader(copy, "r+")
    v = next(t for t in reader.tensors if t.name == "blk.1.attn_v.weight")
    offset = SCALE_OFFSETS.get(qtype, 0)
    v.data.reshape(-1)[offset:offset + 2].view(np.float16)[0] *= 16
    reader.data.flush()
    ours = cached_logits(load_model(path, dtype="float32", quantization="gguf"), IDS)
    wrong = cached_logits(load_model(copy, dtype="float32"), IDS)
    assert (ours - wrong).abs().max() > 2 * TOLERANCE * wrong.abs().max()


@pytest.mark.parametrize("qtype", ["Q3_K", "Q2_K"])
def test_a_type_the_kernels_do_not_keep_is_dequantised_in_one_line(written, qtype, capsys):
    """Q3_K / Q2_K matrices load dequantised under 'gguf' (and under the engine's 'auto'), saying so in one stderr
    line that names the type; the model runs the unfused float path and still generates."""
    path = written(qtype)
    model = load_model(path, dtype="float32", quantization="gguf")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and f"tensors of type {qtype} are dequantised" in lines[0], lines
    assert quantized_format(model) is None and not model.batch_invariant
    assert model.fused_layers(model.make_cache(1, 8)) is None

    llm = LLM(model=path, max_num_seqs=1)
    lines = capsys.readouterr().err.splitlines()
    assert len([line for line in lines if qtype in line]) == 1, lines
    out = llm.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


SEED_PROMPTS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i", "self.x = x\nself.y ="]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SPECULATION_FILES = {"Q4_K": ("Q4_K", False), "Q6_K": ("Q6_K", False), "Q5_0": ("Q5_0", False),
                     "Q4_K_M": ("Q4_K", True)}
"""name: (qtype, Q4_K_M mix)."""


@pytest.mark.parametrize("name", list(SPECULATION_FILES))
def test_greedy_speculation_is_plain_decoding(written, name, monkeypatch):
    """On kept-quantized files (the engine's default on CPU), greedy decoding with prompt lookup (a chain of 4), with
    a draft model (the same GGUF, kept as shipped too: a chain of 3) and with a tree of two drafts per level emits
    plain decoding's tokens exactly, for three prompts in one batch. Measured: changing the cache commit (one
    rejected draft kept, or a tree's accepted path not moved into place) breaks the comparison on every file. (The
    draft is kept exactly as shipped here, not lightened to Q4_0 as drafts are, so that it is the target itself.)"""
    monkeypatch.setattr(quant, "lighten", lambda model, *args: model)
    qtype, mixed = SPECULATION_FILES[name]
    target = written(qtype, mixed, tied=False, small_biases=True)
    plain = LLM(model=target, max_num_seqs=3)
    assert plain.target.batch_invariant  # kept quantized, fused
    expected_formats = {"q4_k", "q6_k"} if mixed else {qtype.lower()}
    assert set(quantized_format(plain.target).split("+")) == expected_formats
    # Prompts that repeat what the model says (A, its continuation B, A again), so that prompt lookup finds B.
    prompts = [o.prompt_token_ids + o.outputs[0].token_ids + o.prompt_token_ids
               for o in plain.generate(SEED_PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]
    assert all(len(ids) == 24 for ids in reference)
    assert len({token for ids in reference for token in ids}) >= 6  # not one token everywhere: drafts can be wrong
    configs = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "adaptive": False},
               "draft_model": {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3,
                               "adaptive": False},
               "draft_tree": {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3,
                              "num_drafts": 2, "adaptive": False}}
    accepted, drafted = {}, {}
    for method, config in configs.items():
        llm = LLM(model=target, speculative_config=config, max_num_seqs=3)
        if method != "ngram":  # a GGUF draft beside a kept target is kept as shipped too
            assert set(quantized_format(llm.proposer.model).split("+")) == expected_formats
        outputs = llm.generate(prompts, GREEDY)
        for prompt, ref, out in zip(prompts, reference, outputs):
            assert out.outputs[0].token_ids == ref, (method, prompt)
        accepted[method], drafted[method] = llm.total_stats.accepted_tokens, llm.total_stats.draft_tokens
    # The file drafting for itself has every chain draft accepted: its one-token steps give the verifying passes'
    # numbers (batch invariance through the engine). Prompt lookup's drafts and the tree's second branches are
    # partly rejected, so the comparison covers rolled-back chains and trees compacted in the cache too.
    assert accepted["draft_model"] == drafted["draft_model"] > 0, (accepted, drafted)
    assert 0 < accepted["ngram"] < drafted["ngram"] and 0 < accepted["draft_tree"] < drafted["draft_tree"], \
        (accepted, drafted)


def test_qwen3_runs_fused_with_its_q_k_norms(tiny_models, tmp_path):
    """A Qwen3 file (per-head q/k RMSNorm, head_dim != hidden / heads) runs through the fused layer too, close to
    the same weights dequantised through the modules; with its norms' weights changed the logits move (so the
    fused layer really applies them)."""
    vocab = Tokenizer(tiny_models["target"]).vocab_size
    model = tiny_model("qwen3", vocab)
    path = write_gguf(tmp_path / "qwen3-q8_0.gguf", model, tiny_models["tok"] / "tokenizer.json", "qwen3", "Q8_0")
    kept = load_model(path, dtype="float32", quantization="gguf")
    dense = load_model(path, dtype="float32")
    assert kept.model.layers[0].self_attn.q_norm is not None
    assert kept.fused_layers(kept.make_cache(1, 8)) is not None and kept.batch_invariant
    ids = torch.randint(0, vocab, (2, 9))
    a, b = cached_logits(kept, ids), cached_logits(dense, ids)
    assert (a - b).abs().max() < TOLERANCE * b.abs().max()
    with torch.no_grad():
        kept.model.layers[1].self_attn.k_norm.weight.mul_(3.0)
    assert (cached_logits(kept, ids) - a).abs().max() > 2 * TOLERANCE * a.abs().max()


def test_a_draft_with_a_shorter_head_stays_exact(written, monkeypatch):
    """A quantized draft with a large vocabulary scores only DRAFT_VOCAB tokens (here 100 of the tiny models'
    vocabulary, the lowest ids: no shipped ranking for it), the rest at -inf: it never drafts a token beyond them, so
    the file drafting for itself now has drafts rejected, and still greedy decoding and seeded sampling give plain
    decoding's tokens exactly."""
    from specdecode.speculation.proposers import draft_model

    monkeypatch.setattr(draft_model, "DRAFT_VOCAB", 100)
    target = written("Q4_K", tied=False, small_biases=True)
    plain = LLM(model=target, max_num_seqs=3)
    config = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(model=target, speculative_config=config, max_num_seqs=3)
    head = llm.proposer.model.lm_head  # (no shipped ranking for the tiny vocabulary: the lowest ids)
    assert isinstance(head, draft_model.SubsetHead) and isinstance(head.rows, QuantLinear)
    assert head.rows.out_features == 100 and torch.equal(head.ids, torch.arange(100)) and head.vocab_size > 200
    reference = plain.generate(SEED_PROMPTS, GREEDY)
    assert any(t >= 100 for o in reference for t in o.outputs[0].token_ids)  # tokens the draft cannot propose
    outputs = llm.generate(SEED_PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    assert 0 < llm.total_stats.accepted_tokens < llm.total_stats.draft_tokens
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(SEED_PROMPTS, sampled)] == \
        [o.outputs[0].token_ids for o in plain.generate(SEED_PROMPTS, sampled)]
