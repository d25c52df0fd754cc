"""A draft whose output head scores only a subset of the vocabulary (FR-Spec): its logits equal the whole head's on
the subset and are -inf elsewhere, and decoding with it stays exactly the target's (greedy, and seeded sampling)."""
import random

import pytest
import torch

from specdecode.catalog.token_ranks import ranked_tokens, vocabulary_fingerprint
from specdecode.engine.llm import LLM
from specdecode.sampling import SamplingParams
from specdecode.speculation.proposers import draft_model
from specdecode.speculation.proposers.draft_model import SubsetHead, draft_head


@pytest.mark.parametrize("quantized", [False, True])
def test_subset_head_scores_only_its_tokens(quantized):
    from specdecode.model.quant import QuantLinear, kernels
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 300, bias=False)
    if quantized:
        if kernels() is None:
            pytest.skip("the quantized kernels cannot be compiled here")
        head = QuantLinear.from_linear(head, "q8_0")
    ids = random.Random(0).sample(range(300), 40)
    sub = draft_head(head, ids)
    assert isinstance(sub, SubsetHead)
    x = torch.randn(3, 64)
    full, part = head(x), sub(x)  # [3, 300] each
    assert part.shape == full.shape
    inside = torch.zeros(300, dtype=torch.bool)
    inside[ids] = True
    assert torch.equal(part[:, inside], full[:, inside])
    assert torch.isinf(part[:, ~inside]).all() and (part[:, ~inside] < 0).all()
    assert draft_head(head, list(range(300))) is head  # nothing to cut


def test_the_shipped_ranking_is_found_by_its_vocabulary_only():
    assert ranked_tokens(vocabulary_fingerprint({"a": 0, "b": 1})) is None


@pytest.fixture
def restricted(monkeypatch):
    """Quantized drafts keep 60 tokens: a random set, not the lowest ids (the ranking path)."""
    from specdecode.model.quant import kernels
    if kernels() is None:
        pytest.skip("the quantized kernels cannot be compiled here")
    chosen = {}

    def frequent_tokens(tokenizer, vocab_size, n):
        chosen["ids"] = random.Random(1).sample(range(vocab_size), n)
        return chosen["ids"]

    monkeypatch.setattr(draft_model, "DRAFT_VOCAB", 60)
    monkeypatch.setattr(draft_model, "frequent_tokens", frequent_tokens)
    return chosen


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_restricted_draft_keeps_the_output_exact(tiny_models, restricted, temperature):
    prompts = ["def add(a, b):", "class Point:", "for i in range(10):", "import os\nimport sys"]
    params = [SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=7 + i)
              for i in range(len(prompts))]
    plain = LLM(str(tiny_models["target"]), dtype="float32", quantization="q4_1", max_num_seqs=4)
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    config = {"method": "draft_model", "model": str(tiny_models["draft"]), "num_speculative_tokens": 3,
              "adaptive": False}
    llm = LLM(str(tiny_models["target"]), dtype="float32", quantization="q4_1", speculative_config=config,
              max_num_seqs=4)
    assert isinstance(llm.proposer.model.lm_head, SubsetHead)
    assert llm.proposer.model.lm_head.ids.tolist() == sorted(restricted["ids"])
    proposed = set()
    propose = llm.proposer.propose

    def recording(seqs, budgets):
        trees = propose(seqs, budgets)
        proposed.update(t for tree in trees for t in tree.tokens.tolist())
        return trees

    llm.proposer.propose = recording
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outputs == reference
    stats = llm.total_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert proposed and proposed <= set(restricted["ids"])  # the draft only ever proposes its own tokens,
    assert set(t for out in outputs for t in out) - set(restricted["ids"])  # while the target emits others too
