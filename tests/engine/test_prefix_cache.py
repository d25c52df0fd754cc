"""Prefix caching: a free slot's keys and values are reused by a prompt that begins the same way, and outputs are the
same with it on or off (bitwise with the quantized kernels; float32 oneDNN too on these prompts), for plain
decoding and for methods with caches of their own (the draft model, EAGLE's head)."""
import pytest

from specdecode.engine.llm import LLM
from specdecode.engine.prefix_cache import SlotPool
from specdecode.model.cache import common_prefix
from specdecode.sampling import SamplingParams

from tests.compiled import kernels_or_skip
from tests.speculation.test_eagle import one_layer  # noqa: F401  (a fixture: a target and an EAGLE head that fits)

SYSTEM = "def helper(x):\n    return x * 2\n\n" * 6
QUESTIONS = ["class Point:", "import os", "for i in range(3):", "def add(a, b):"]


def test_pool_takes_the_longest_held_prefix_and_evicts_the_oldest():
    pool = SlotPool(3)
    assert pool.take([1, 2, 3]) == (0, 0)  # nothing held: the first empty slot
    assert pool.take([5, 6]) == (1, 0)
    pool.give_back(0, [1, 2, 3, 4])
    pool.give_back(1, [1, 2, 9])
    assert pool.take([1, 2, 3, 4, 7]) == (0, 4)  # slot 0 holds 4 of its tokens, slot 1 only 2
    assert pool.take([1, 2, 3]) == (1, 2)  # at most len - 1: the last prompt token is run for its logits
    pool.give_back(0, [8, 8])
    pool.give_back(1, None)  # a failure: nothing reusable
    assert pool.take([4]) == (2, 0)  # an empty slot before evicting anything
    assert pool.take([4]) == (1, 0)  # then the one that holds nothing
    assert pool.take([8, 8, 8]) == (0, 2)
    pool.give_back(2, [3])
    pool.grow(5)
    assert pool.size == 5 and sorted(pool.free) == [2, 3, 4]
    off = SlotPool(2, enabled=False)
    off.give_back(off.take([1, 2])[0], [1, 2])
    assert off.take([1, 2, 3])[1] == 0
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0


def chat_turns(llm: LLM, turns: int = 3, max_tokens: int = 12) -> list[list[int]]:
    """A conversation whose every turn is the last prompt, its answer and a new question (greedy)."""
    prompt, answers = SYSTEM, []
    for question in QUESTIONS[:turns]:
        prompt += question
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
        answers.append(out.outputs[0].token_ids)
        prompt += out.outputs[0].text + "\n"
    return answers


def shared_system_prompt(llm: LLM) -> list[list[int]]:
    """Two waves of requests with one long system prompt: the second finds it in the slots the first left."""
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)]
    outs = []
    for wave in range(2):
        prompts = [SYSTEM + q + str(wave) for q in QUESTIONS]
        outs += [o.outputs[0].token_ids for o in llm.generate(prompts, params * 2)]
    return outs


QUANTIZATIONS = ["none", "q4_1"]


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("method", ["plain", "draft_model", "ngram"])
def test_outputs_are_the_same_with_prefix_caching_on_and_off(tiny_models, method, quantization):
    if quantization != "none":
        kernels_or_skip()
    config = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
              "draft_model": {"model": str(tiny_models["draft"]), "num_speculative_tokens": 3, "adaptive": False}}
    results = {}
    for on in (True, False):
        llm = LLM(tiny_models["target"], dtype="float32", quantization=quantization, max_num_seqs=4,
                  speculative_config=config[method], enable_prefix_caching=on)
        results[on] = (chat_turns(llm), shared_system_prompt(llm))
        stats = llm.runner.slots.stats
        if on:
            assert stats.hits > 0.5 * stats.queries, "later turns and the second wave must reuse their prefixes"
            if method == "draft_model":
                assert llm.proposer.kept_tokens > 0, "the draft keeps its own keys and values of a prefix too"
        else:
            assert stats.hits == 0
    assert results[True] == results[False]


def test_eagle_keeps_its_own_entries_of_a_reused_prefix(one_layer):  # noqa: F811
    config = {"method": "eagle", "model": str(one_layer / "copy"), "num_speculative_tokens": 3, "adaptive": False}
    results, accepted = {}, {}
    for on in (True, False):
        llm = LLM(str(one_layer / "target"), dtype="float32", max_num_seqs=4, speculative_config=config,
                  enable_prefix_caching=on)
        results[on] = (chat_turns(llm), shared_system_prompt(llm))
        accepted[on] = llm.total_stats.accepted_tokens / llm.total_stats.steps
        assert (llm.runner.slots.stats.hits > 0) == on
    assert results[True] == results[False]
    # The head reads its reused entries rather than starting blind: it accepts as much as without the cache.
    assert accepted[True] >= 0.9 * accepted[False]


def test_eagle_reuses_a_prefix_before_it_ever_drafted(one_layer):  # noqa: F811
    """An adaptive engine whose head has not drafted yet holds no head entries: the target's features that a
    finished request left unread let the next request reuse the whole prefix the target holds, and when drafting
    starts the head reads them (output as without the cache, and acceptance as high)."""
    config = {"method": "eagle", "model": str(one_layer / "copy"), "num_speculative_tokens": 3, "adaptive": True}
    results, accepted = {}, {}
    for on in (True, False):
        llm = LLM(str(one_layer / "target"), dtype="float32", max_num_seqs=4, speculative_config=config,
                  enable_prefix_caching=on)
        llm.controller.fixed_k = 0  # plain steps only: the head reads nothing
        first = chat_turns(llm)
        assert llm.total_stats.draft_tokens == 0 and not llm.proposer.added
        hits = llm.runner.slots.stats.hits
        assert (hits > 0) == on and (hits > 2 * len(SYSTEM) // 4) == on, "most of each prompt is reused"
        llm.controller.fixed_k = 3  # now it drafts, its first entries from features that earlier requests left
        results[on] = (first, chat_turns(llm), shared_system_prompt(llm))
        accepted[on] = llm.total_stats.accepted_tokens / llm.total_stats.steps
    assert results[True] == results[False]
    assert accepted[True] >= 0.9 * accepted[False]


# -- chunked prefill ----------------------------------------------------------------------------------------------

def long_prompt_among_others(llm: LLM) -> list[list[int]]:
    """Two short requests and a long one that gets a slot only when the shorter of them finishes, so that it is
    prefilled while the other decodes."""
    prompts = ["def add(a, b):", "import os", SYSTEM * 2 + "class Point:"]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=2, max_tokens=12, ignore_eos=True)]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture
def small_chunks(monkeypatch):
    import specdecode.engine.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "CHUNKED_PREFILL_ABOVE", 16)
    monkeypatch.setattr(scheduler_module, "MIN_CHUNK", 8)
    monkeypatch.setattr(scheduler_module, "FIRST_CHUNK", 8)


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("method", ["plain", "draft_model"])
def test_chunked_prefill_changes_no_output(tiny_models, small_chunks, method, quantization):
    if quantization != "none":
        kernels_or_skip()
    config = None if method == "plain" else {"model": str(tiny_models["draft"]), "num_speculative_tokens": 3,
                                             "adaptive": False}
    results = {}
    for on in (True, False):
        llm = LLM(tiny_models["target"], dtype="float32", quantization=quantization, max_num_seqs=2,
                  speculative_config=config, enable_chunked_prefill=on, enable_prefix_caching=False)
        results[on] = long_prompt_among_others(llm)
        assert (llm.runner.slots.stats.chunks > 0) == on, "the long prompt must come in chunks"
    assert results[True] == results[False]


def test_chunked_prefill_feeds_eagle_every_chunk(one_layer, small_chunks):  # noqa: F811
    config = {"method": "eagle", "model": str(one_layer / "copy"), "num_speculative_tokens": 3, "adaptive": False}
    results = {}
    for on in (True, False):
        llm = LLM(str(one_layer / "target"), dtype="float32", max_num_seqs=2, speculative_config=config,
                  enable_chunked_prefill=on)
        results[on] = long_prompt_among_others(llm)
        assert (llm.runner.slots.stats.chunks > 0) == on
    assert results[True] == results[False]
