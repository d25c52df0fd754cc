"""A method is one registered object: a test-only method (it proposes the last token again) is added here, in this
one file, and the engine, the capacity plan and the CLI's checks take it from the registry like any other."""
import pytest
import torch

from specdecode.engine.llm import LLM
from specdecode.sampling import SamplingParams
from specdecode.speculation import methods
from specdecode.speculation.proposers.base import NO_FEATURES
from specdecode.speculation.tree import DraftTree


class RepeatLast:
    """Drafts the pending token again, as a chain of up to K copies."""

    feature_request = NO_FEATURES
    draft_network = None

    def ensure_cache(self, slots, max_len, pool_positions=None):
        pass

    def cache_shortfall(self, seqs, budgets):
        return 0

    def add(self, seqs):
        pass

    def remove(self, seq):
        pass

    def propose(self, seqs, budgets):
        return [DraftTree.chain(torch.tensor([seq.token_ids[-1]] * budget, dtype=torch.long))
                for seq, budget in zip(seqs, budgets)]

    def observe(self, seqs, trees, results):
        pass

    def observe_target(self, seqs, features):
        pass


@pytest.fixture
def repeat_last():
    method = methods.register(methods.Method("repeat_last", lambda config, context: RepeatLast()),
                              "drafts the last token again")
    yield method
    methods._registered.pop("repeat_last")
    methods.KNOWN.pop("repeat_last")


def test_a_registered_method_runs_exactly(tiny_models, repeat_last):
    prompts = ["aaaa aaaa aaaa", "def add(a, b):", "1 1 1 1 1 1"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(tiny_models["target"], dtype="float32").generate(prompts, params)
    spec = LLM(tiny_models["target"], dtype="float32",
               speculative_config={"method": "repeat_last", "num_speculative_tokens": 3, "adaptive": False})
    outputs = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert spec.total_stats.draft_tokens > 0
    assert spec.spec_config.tree_size == 3 and spec.spec_config.pass_widths == [1, 2, 3, 4]


def test_an_unknown_method_names_the_known_ones():
    from specdecode.errors import ConfigError
    from specdecode.speculation.config import SpeculativeConfig

    with pytest.raises(ConfigError, match="unknown; use one of draft_model, ngram"):
        SpeculativeConfig(method="nope")
