"""A seeded sampled request's output does not depend on the rest of its batch: its uniforms are keyed by the
output position they decide, not drawn from a stream whose length depends on the batch's widest tree. With the race
(the default sampler) it does not depend on speculation either: the same text with or without it, adaptive or at any
fixed K."""
import dataclasses

import pytest

import specdecode.speculation.verify as verify_module
from tests.certify.broken import race_positions_off_by_one

from specdecode.engine.llm import LLM
from specdecode.sampling import SamplingParams

PROMPT = "def add(a, b):"
OTHERS = ["class Point:", "for i in range(10):", "import os"]


@pytest.fixture(scope="module")
def llm(tiny_models):
    config = {"model": str(tiny_models["draft"]), "num_speculative_tokens": 3,
              "adaptive": False}  # fixed K: the same drafts each time
    return LLM(tiny_models["target"], dtype="float32", speculative_config=config, max_num_seqs=8)


def tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("mine", [
    SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True, use_speculation=False),  # empty trees
    SamplingParams(temperature=0.9, top_p=0.95, seed=6, max_tokens=11, ignore_eos=True),  # shorter: budgets shrink
    SamplingParams(temperature=1.2, seed=7, max_tokens=30, ignore_eos=True),
], ids=["plain_among_speculating", "finishes_first", "longest"])
def test_seeded_output_is_the_same_alone_and_in_any_batch(llm, mine):
    alone = tokens(llm, [PROMPT], [mine])[0]
    others = [SamplingParams(temperature=1.0, seed=11, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=12, max_tokens=16, ignore_eos=True, use_speculation=False)]
    for batch in ([mine] + others, others[:1] + [mine], [others[1], mine, others[2]]):
        prompts = [PROMPT if p is mine else OTHERS[i % 3] for i, p in enumerate(batch)]
        outputs = tokens(llm, prompts, batch)
        assert outputs[batch.index(mine)] == alone
    assert llm.total_stats.accepted_tokens > 0 and llm.total_stats.draft_tokens > llm.total_stats.accepted_tokens


SEEDED = [SamplingParams(temperature=t, top_p=top_p, seed=seed, max_tokens=30, ignore_eos=True)
          for t, top_p, seed in [(1.0, 1.0, 1), (0.8, 0.9, 2), (1.3, 1.0, 3), (0.6, 1.0, 4)]]
PROMPTS = [PROMPT] + OTHERS


@pytest.fixture(scope="module")
def plain_seeded(tiny_models):
    plain = LLM(tiny_models["target"], dtype="float32", max_num_seqs=4)
    return tokens(plain, PROMPTS, SEEDED)


@pytest.mark.parametrize("config", [
    {"num_speculative_tokens": 3, "adaptive": False},
    {"num_speculative_tokens": 5, "num_drafts": 2, "adaptive": False},
    {"num_speculative_tokens": 4},  # adaptive: K chosen per step
], ids=["draft_K3", "draft_tree", "draft_adaptive"])  # one-hot methods: tests/engine/test_invariance_smollm2.py
def test_seeded_speculation_gives_the_plain_text(tiny_models, plain_seeded, config):
    config = {"model": str(tiny_models["draft"]), **config}
    llm = LLM(tiny_models["target"], dtype="float32", speculative_config=config, max_num_seqs=4)
    assert tokens(llm, PROMPTS, SEEDED) == plain_seeded
    assert [tokens(llm, [p], [sp])[0] for p, sp in zip(PROMPTS, SEEDED)] == plain_seeded
    assert llm.total_stats.accepted_tokens > 0, "drafts must be accepted, or this compares plain with plain"


def test_seeded_identity_catches_a_race_keyed_to_the_wrong_position(tiny_models, plain_seeded, monkeypatch):
    """The negative control: a race that reuses a node's own noise for the token after it changes the text."""
    monkeypatch.setattr(verify_module, "race_positions", race_positions_off_by_one)
    config = {"model": str(tiny_models["draft"]), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(tiny_models["target"], dtype="float32", speculative_config=config, max_num_seqs=4)
    assert tokens(llm, PROMPTS, SEEDED) != plain_seeded


def test_rejection_sampling_text_depends_on_the_drafts(tiny_models):
    """Why the race is the default: rejection sampling is exact in distribution but its text follows the drafts."""
    params = [dataclasses.replace(sp, sampler="rejection") for sp in SEEDED]
    plain = LLM(tiny_models["target"], dtype="float32", max_num_seqs=4)
    config = {"model": str(tiny_models["draft"]), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(tiny_models["target"], dtype="float32", speculative_config=config, max_num_seqs=4)
    assert tokens(llm, PROMPTS, params) != tokens(plain, PROMPTS, params)
