"""The engine over the paged KV cache: running requests share the blocks of a common beginning (prefilled once per
wave), speculation does not lower that reuse, a pool that runs short preempts and recomputes without changing any
output, and after every scenario the pool's counts match the tables with nothing held (no leaked block)."""
import dataclasses
import random

import pytest
import torch

from specdecode.engine.llm import LLM
from specdecode.errors import ConfigError
from specdecode.sampling import SamplingParams, choice_seed

SYSTEM = "You are a careful assistant. Answer in one line.\n" * 6
QUESTIONS = ["def add(a, b):", "class Point:", "import os", "for i in range(3):", "x = [1, 2]", "while True:",
             "print('hi')", "return None"]


pytestmark = pytest.mark.usefixtures("built_kernels")


def engine(tiny_models, spec=None, **kwargs) -> LLM:
    return LLM(tiny_models["target"], dtype="float32", quantization="q4_1", speculative_config=spec, **kwargs)


def wave(llm: LLM, max_tokens: int = 10) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=max_tokens, ignore_eos=True)] * 4
    return [o.outputs[0].token_ids for o in llm.generate([SYSTEM + q for q in QUESTIONS], params)]


def assert_no_leak(llm: LLM) -> None:
    cache = llm.runner.cache
    assert cache.leak() is None
    assert cache.pool.used == 0, "every block back in the pool once nothing runs"
    proposer_cache = getattr(llm.proposer, "cache", None)
    if proposer_cache is not None and proposer_cache.paged:
        assert proposer_cache.leak() is None and proposer_cache.pool.used == 0


SPECS = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
         "draft_model": "draft"}


@pytest.mark.parametrize("method", list(SPECS))
def test_a_shared_prompt_is_prefilled_once_per_wave_with_speculation_on_or_off(tiny_models, method):
    spec = SPECS[method]
    if spec == "draft":
        spec = {"model": str(tiny_models["draft"]), "num_speculative_tokens": 3, "adaptive": False}
    llm = engine(tiny_models, spec, max_num_seqs=8)
    outputs = wave(llm)
    stats = llm.runner.slots.stats
    system = len(llm.tokenizer.encode(SYSTEM))
    shared = system // 16 * 16  # whole blocks of the system prompt
    # the first request prefills it; the seven others join once its blocks are indexed and reuse all of them
    assert stats.hits >= 7 * shared, (stats, system)
    reference = engine(tiny_models, spec, max_num_seqs=8, block_size=None, enable_prefix_caching=False)
    assert outputs == wave(reference)
    assert_no_leak(llm)
    if method == "draft_model":  # the draft's own cache shares the same beginning
        assert llm.proposer.kept_tokens >= 7 * shared


def test_prefix_reuse_is_the_same_with_speculation_on_and_off(tiny_models):
    hits = {}
    for name, spec in [("off", None), ("ngram", SPECS["ngram"]),
                       ("draft", {"model": str(tiny_models["draft"]), "num_speculative_tokens": 4})]:
        llm = engine(tiny_models, spec, max_num_seqs=8)
        wave(llm, max_tokens=24)
        wave(llm, max_tokens=24)  # a second wave finds the first's blocks (finished requests' too)
        hits[name] = llm.runner.slots.stats.hits / llm.runner.slots.stats.queries
    assert hits["off"] > 0.8
    assert hits["ngram"] == hits["off"] and hits["draft"] == hits["off"], hits


@pytest.mark.parametrize("method", ["plain", "ngram", "draft_model"])
def test_preemption_changes_no_output(tiny_models, method):
    spec = SPECS[method]
    if spec == "draft":
        spec = {"model": str(tiny_models["draft"]), "num_speculative_tokens": 3, "adaptive": False}
    prompts = [SYSTEM[:40 * (i + 1)] + q for i, q in enumerate(QUESTIONS)]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=11, max_tokens=30, ignore_eos=True)] * 4
    reference = engine(tiny_models, spec, max_num_seqs=8, block_size=None)
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    small = engine(tiny_models, spec, max_num_seqs=8, block_size=8)
    small.runner.num_blocks = 60  # room for about two of these requests at once: the rest wait or are preempted
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert got == expected
    assert small.runner.slots.stats.preemptions > 0
    assert_no_leak(small)


def test_choices_share_their_prompt_and_a_pool_of_one_sequence_serves_them_in_turn(tiny_models):
    params = SamplingParams(temperature=0.9, seed=2, n=3, max_tokens=12, ignore_eos=True)
    prompt = SYSTEM + QUESTIONS[0]
    expected = [c.token_ids for c in engine(tiny_models, block_size=None).generate(prompt, params)[0].outputs]
    llm = engine(tiny_models)
    assert [c.token_ids for c in llm.generate(prompt, params)[0].outputs] == expected
    assert_no_leak(llm)
    tight = engine(tiny_models, max_model_len=512, block_size=16)
    tight.runner.num_blocks = 32 + 2  # one sequence of max_model_len and its tree room: the plan's minimum
    assert [c.token_ids for c in tight.generate(prompt, params)[0].outputs] == expected
    assert_no_leak(tight)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_a_16_bit_cache_keeps_speculation_exact_and_sharing_bitwise(tiny_models, kv_cache_dtype):
    """Keys and values stored in 16 bits: half the pool's bytes a position, and still every configuration gives the
    plain slots layout's tokens in that dtype (the kernels round each entry once, the same way wherever it is)."""
    reference = wave(engine(tiny_models, max_num_seqs=8, block_size=None, enable_prefix_caching=False,
                            kv_cache_dtype=kv_cache_dtype))
    for spec in (None, SPECS["ngram"]):
        llm = engine(tiny_models, spec, max_num_seqs=8, kv_cache_dtype=kv_cache_dtype)
        assert wave(llm) == reference
        assert llm.runner.cache.k[0].dtype == getattr(torch, kv_cache_dtype)
        assert llm.runner.slots.stats.hits > 0
        assert_no_leak(llm)
    with pytest.raises(ConfigError, match="kv_cache_dtype must be"):
        engine(tiny_models, kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match="fewer than one sequence of max_model_len 256"):
        engine(tiny_models, max_model_len=256, num_kv_blocks=8)


def test_random_scenarios_leave_no_block_behind(tiny_models):
    """Cancellations, n > 1, long prompts prefilled in chunks, a pool that forces preemption storms, requests
    that share beginnings: driven through the scheduler directly, the pool checked after every scenario."""
    rng = random.Random(0)
    llm = engine(tiny_models, SPECS["ngram"], max_num_seqs=6, block_size=8)
    llm.runner.num_blocks = 70
    llm.runner.ensure_capacity(6, 512, llm.tree_size)
    scheduler = llm.make_scheduler(6)
    for scenario in range(12):
        seqs = []
        for i in range(rng.randint(1, 9)):
            prompt = (SYSTEM * rng.randint(1, 4))[:rng.randint(10, 300)] + rng.choice(QUESTIONS)
            params = SamplingParams(temperature=rng.choice([0, 0.7]), seed=rng.randint(0, 99),
                                    max_tokens=rng.randint(1, 40), ignore_eos=True, n=rng.choice([1, 1, 2]))
            for j in range(params.n):  # a request's choices, as generate() makes them
                one = dataclasses.replace(params, n=1, seed=choice_seed(params.seed, j))
                seqs.append(llm.make_sequence(prompt, one, f"{scenario}-{i}-{j}"))
                scheduler.add(seqs[-1])
        steps = 0
        while scheduler.has_work:
            scheduler.step()
            steps += 1
            if rng.random() < 0.1 and seqs:  # a cancellation, wherever the request is
                scheduler.abort(rng.choice(seqs).request_id)
            assert scheduler.slot_problem() is None
            assert llm.runner.cache.leak() is None
            assert steps < 2000
        assert llm.runner.cache.pool.used == 0, scenario
        assert llm.runner.cache.leak() is None


AUTO = {"method": "auto", "num_speculative_tokens": 5}


@pytest.mark.slow
def test_smollm2_answers_are_the_same_paged_or_not_shared_or_not_preempted_or_not(smollm2):
    """The real model in its default configuration (GGUF, quantized kernels, auto speculation): a wave of chats
    sharing a system prompt, through the slots layout without prefix caching, the paged cache sharing prefixes, and a
    pool so small that requests are preempted and recomputed."""
    messages = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    params = [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=9, max_tokens=64, ignore_eos=True)] * 4

    def answers(**kwargs) -> tuple[list[list[int]], LLM]:
        llm = LLM(smollm2, speculative_config=AUTO, max_num_seqs=8, max_model_len=1024, **kwargs)
        return [o.outputs[0].token_ids for o in llm.chat(messages, params)], llm

    reference, _ = answers(block_size=None, enable_prefix_caching=False)
    shared, llm = answers()
    assert shared == reference
    assert llm.runner.slots.stats.hits > 6 * 16
    assert_no_leak(llm)
    small = LLM(smollm2, speculative_config=AUTO, max_num_seqs=8, max_model_len=1024)
    small.runner.num_blocks = 16  # about two of these chats at once: the rest wait or are preempted
    assert [o.outputs[0].token_ids for o in small.chat(messages, params)] == reference
    assert small.runner.slots.stats.preemptions > 0
    assert_no_leak(small)
