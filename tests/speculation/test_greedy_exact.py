"""Greedy speculative decoding emits exactly the tokens of plain greedy decoding (float32 weights, and weights
kept block-quantized: the quantized target is its own reference, model/quant.py)."""
import random
import re

import pytest

from specdecode.engine.llm import LLM
from specdecode.errors import ConfigError, IncompatibleDraftError
from specdecode.sampling import SamplingParams

from tests.compiled import kernels_or_skip

WORDS = ["def", "class", "return", "self", "import", "for", "in", "range", "(", ")", ":", "x", "y", "=", "+",
         "print", "Point", "add", "a", "b", "\n", "    ", "if", "else", "None", "sys", "os"]


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 12))]
        if rng.random() < 0.5:  # repeated text gives prompt lookup something to find
            words = words * 3
        out.append(" ".join(words))
    return out


PROMPTS = prompts(50)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


QUANTIZATIONS = ["none", "q4_1"]
"""Target weights: float, or every matrix in Q4_1 (the default model's format) through the fused kernels."""


@pytest.fixture(scope="module")
def reference(tiny_models):
    from specdecode.model.quant import kernels

    out = {}
    for quantization in QUANTIZATIONS:
        if quantization != "none" and kernels() is None:
            continue
        llm = LLM(str(tiny_models["target"]), dtype="float32", max_num_seqs=8, quantization=quantization)
        out[quantization] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return out


SPEC_CONFIGS = {
    "draft_chain": lambda m: {"method": "draft_model", "model": str(m["draft"]), "num_speculative_tokens": 4,
                              "adaptive": False},
    "draft_tree": lambda m: {"method": "draft_model", "model": str(m["draft"]), "num_speculative_tokens": 3,
                             "num_drafts": 3, "adaptive": False},
    "ngram": lambda m: {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "adaptive": False},
}


@pytest.mark.slow
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("method", list(SPEC_CONFIGS))
def test_greedy_speculation_is_exact(tiny_models, reference, method, batch, quantization):
    if quantization not in reference:
        kernels_or_skip()  # (they did not build: a failure naming the error, or an explicit skip)
    llm = LLM(str(tiny_models["target"]), dtype="float32", speculative_config=SPEC_CONFIGS[method](tiny_models),
              max_num_seqs=batch, quantization=quantization)
    if method.startswith("draft") and quantization != "none":  # beside a quantized target, a quantized draft
        from specdecode.model.quant import quantized_format
        assert quantized_format(llm.proposer.model) == "q8_0"
    if batch == 1:
        outputs = [llm.generate(p, GREEDY)[0] for p in PROMPTS]
    else:
        outputs = llm.generate(PROMPTS, GREEDY)
    for prompt, ref, out in zip(PROMPTS, reference[quantization], outputs):
        assert out.outputs[0].token_ids == ref, prompt
    stats = llm.total_stats
    # The comparison only means something if drafts were both accepted and rejected along the way.
    assert stats.accepted_tokens > 0
    assert stats.accepted_tokens < stats.draft_tokens


def test_statistics_are_consistent(tiny_models):
    llm = LLM(str(tiny_models["target"]), dtype="float32", speculative_config=SPEC_CONFIGS["draft_chain"](tiny_models))
    outputs = llm.generate(PROMPTS[:8], GREEDY)
    for out in outputs:
        m = out.metrics
        assert m.emitted_tokens == len(out.outputs[0].token_ids)
        # One prefill token, then per step the accepted tokens plus one (until max_tokens cuts the last step).
        assert m.emitted_tokens <= 1 + m.steps + m.accepted_tokens
        assert m.accepted_tokens <= m.draft_tokens <= 4 * m.steps
        assert sum(m.accepted_per_pos) == m.accepted_tokens
        assert all(a >= b for a, b in zip(m.accepted_per_pos, m.accepted_per_pos[1:]))
        assert 0 <= m.acceptance_rate <= 1 and m.mean_accepted_len >= 1
        assert m.draft_time > 0 and m.verify_time > 0


def test_draft_with_another_tokenizer_is_refused(tiny_models, tmp_path):
    import json
    import shutil

    shutil.copytree(tiny_models["draft"], tmp_path / "draft")
    tok = json.loads((tmp_path / "draft" / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same tokens, two ids swapped
    (tmp_path / "draft" / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(IncompatibleDraftError, match=re.escape(f"token {a!r} has id")):
        LLM(str(tiny_models["target"]), dtype="float32", speculative_config={"model": str(tmp_path / "draft")})

    cfg = json.loads((tiny_models["draft"] / "tokenizer_config.json").read_text())
    shutil.copy(tiny_models["draft"] / "tokenizer.json", tmp_path / "draft" / "tokenizer.json")
    (tmp_path / "draft" / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "<|pad|>"}))
    with pytest.raises(IncompatibleDraftError, match="special token eos_token"):
        LLM(str(tiny_models["target"]), dtype="float32", speculative_config={"model": str(tmp_path / "draft")})


def test_bad_speculative_config_is_refused(tiny_models):
    with pytest.raises(ConfigError, match="unknown speculative_config key"):
        LLM(str(tiny_models["target"]), dtype="float32", speculative_config={"method": "ngram", "num_spec_tokens": 3})
    with pytest.raises(ConfigError, match="method 'mtp' is unknown"):
        LLM(str(tiny_models["target"]), dtype="float32", speculative_config={"method": "mtp"})
    with pytest.raises(ConfigError, match="needs \"model\""):
        LLM(str(tiny_models["target"]), dtype="float32", speculative_config={"method": "draft_model"})
