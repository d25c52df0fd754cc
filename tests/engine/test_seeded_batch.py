"""A seeded sampled request's output does not depend on the rest of its batch: its uniforms are keyed by the
output position they decide, not drawn from a stream whose length depends on the batch's widest tree."""
import pytest

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
