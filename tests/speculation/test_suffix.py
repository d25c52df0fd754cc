"""Suffix decoding: the shared suffix tree's counts against brute force over every window it holds (requests in
flight and finished ones, after evictions), frequency-ranked draft trees, eviction of the oldest finished request,
option errors, greedy output identical to plain decoding alone and in a batch, drafts accepted across requests, and
lossless sampling (chi-square on an 8-token model; `certify` at T=1 and T=0.7/top-p 0.9)."""
import random
from collections import Counter

import pytest

from specdecode.certify.run import CertifyConfig, certify
from specdecode.engine.llm import LLM
from specdecode.errors import ConfigError
from specdecode.sampling import SamplingParams
from specdecode.speculation.proposers.suffix import SuffixTree, draft_tree

from tests.certify.models import make_pair

from .heads_fixtures import chi_square_p, node_paths
from .test_lossless_sampling import BOTH


def windows(tree: SuffixTree) -> list[list[int]]:
    """Every window the tree should hold: the next max_depth tokens (fewer at the end) from each position."""
    held = [r.tokens for r in list(tree.live.values()) + list(tree.finished.values())]
    return [tokens[j:j + tree.max_depth] for tokens in held for j in range(len(tokens))]


def brute_continuations(held_windows, context) -> Counter:
    m = len(context)
    return Counter(w[m] for w in held_windows if len(w) > m and w[:m] == context)


def test_counts_match_brute_force_through_growth_and_eviction():
    rng = random.Random(0)
    for _ in range(300):
        depth, vocab = rng.randrange(2, 9), rng.randrange(2, 5)
        tree = SuffixTree(depth, max_tokens=rng.randrange(0, 60))
        live: dict[str, list[int]] = {}
        for _ in range(rng.randrange(1, 50)):
            action = rng.random()
            if action < 0.15 or not live:  # a request joins with a prompt
                key = f"r{rng.randrange(5)}"
                live[key] = [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
                tree.add(key, live[key])
            elif action < 0.3:  # one finishes (and maybe evicts older ones)
                key = rng.choice(list(live))
                tree.finish(key)
                del live[key]
            else:  # one emits a few tokens
                key = rng.choice(list(live))
                live[key] += [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
                tree.extend(key, live[key])
        assert sum(len(r.tokens) for r in tree.finished.values()) <= tree.max_tokens or not tree.finished
        held = windows(tree)
        for _ in range(40):
            context = [rng.randrange(vocab) for _ in range(rng.randrange(1, depth))]
            location = tree.locate(context)
            occurs = any(w[:len(context)] == context for w in held)
            assert (location is not None) == occurs, context
            if location is not None:
                got = Counter({t: n for t, n, _ in tree.continuations(*location) if n})
                assert got == brute_continuations(held, context), context
        for key in list(tree.live):  # everything finished and evicted: nothing is left
            tree.finish(key)
        tree.max_tokens = 0
        tree.evict()
        assert not tree.root.children and tree.tokens_held == 0


def test_draft_tree_ranks_continuations_by_frequency():
    tree = SuffixTree(max_depth=8, max_tokens=1000)
    for i, tokens in enumerate([[1, 2, 3, 4, 5]] * 3 + [[1, 2, 3, 6, 7]] + [[1, 2, 9]]):
        tree.add(str(i), tokens)
        tree.finish(str(i))
    tree.add("now", [0, 1, 2])
    location, length = tree.match("now", room=8)
    assert length == 2  # "1 2" (the pending "2" included) occurred before; "0 1 2" did not
    tokens, parents = draft_tree(tree, location, depth=3, nodes=10, min_prob=0.1)
    # 3 follows 4 of 5 times (0.8), then 4 (0.6) or 6 (0.2), then 5 after 4 (0.6) and 7 after 6 (0.2); 9 is 0.2
    assert node_paths(tokens, parents) == {(3,), (3, 4), (3, 4, 5), (3, 6), (3, 6, 7), (9,)}
    assert tokens[:3] == [3, 4, 5] and all(p < i for i, p in enumerate(parents))
    assert draft_tree(tree, location, depth=3, nodes=2, min_prob=0.1)[0] == [3, 4]
    assert draft_tree(tree, location, depth=3, nodes=10, min_prob=0.5)[0] == [3, 4, 5]


def test_the_oldest_finished_request_is_evicted_first_and_requests_in_flight_never():
    tree = SuffixTree(max_depth=16, max_tokens=10)
    tree.add("a", [10, 11, 12, 13, 14])
    tree.add("live", [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51])
    tree.finish("a")
    tree.add("b", [20, 21, 22, 23, 24])
    tree.finish("b")
    assert tree.locate([11, 12, 13]) is not None and tree.locate([21, 22]) is not None  # 10 finished tokens: both
    tree.add("c", [30, 31, 32, 33])
    tree.finish("c")
    assert tree.locate([11]) is None and tree.locate([10, 11]) is None  # a (the oldest) is gone
    assert tree.locate([21, 22, 23]) is not None and tree.locate([31, 32]) is not None
    assert tree.finished_tokens == 9 and tree.locate([45, 46, 47]) is not None  # the request in flight stays
    tree.extend("live", tree.live["live"].tokens + [52])
    assert tree.locate([50, 51, 52]) is not None


@pytest.mark.parametrize("option,value,message", [
    ("suffix_max_depth", 1, "suffix_max_depth must be an integer >= 2"),
    ("suffix_max_tokens", -1, "suffix_max_tokens must be an integer >= 0"),
    ("suffix_min_prob", 0.0, r"suffix_min_prob must be a number in \(0, 1\]"),
    ("suffix_min_prob", 1.5, r"suffix_min_prob must be a number in \(0, 1\]"),
    ("suffix_spec_factor", 0, "suffix_spec_factor must be a number > 0"),
    ("num_tree_nodes", 0, "num_tree_nodes must be a positive integer"),
])
def test_bad_options_fail_with_one_line_naming_the_option(tiny_models, option, value, message):
    with pytest.raises(ConfigError, match=message) as error:
        LLM(str(tiny_models["target"]), dtype="float32", speculative_config={"method": "suffix", option: value})
    assert "\n" not in str(error.value)


def test_an_unknown_option_is_refused(tiny_models):
    with pytest.raises(ConfigError, match="unknown speculative_config key"):
        LLM(str(tiny_models["target"]), speculative_config={"method": "suffix", "suffix_depth": 8})


PROMPTS = ["def add(a, b):", "class Point:", "for i in range(10):", "print("]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_outputs(tiny_models):
    return LLM(str(tiny_models["target"]), dtype="float32").generate(PROMPTS, GREEDY)


def suffix_llm(tiny_models, batch: int, **options) -> LLM:
    config = {"method": "suffix", "num_speculative_tokens": 6, "adaptive": False, **options}
    return LLM(str(tiny_models["target"]), dtype="float32", speculative_config=config, max_num_seqs=batch)


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_is_exact_alone_and_in_a_batch(tiny_models, plain_outputs, batch):
    llm = suffix_llm(tiny_models, batch)
    for _ in range(2):  # the second round drafts from the first round's answers as well
        for prompt, want, got in zip(PROMPTS, plain_outputs, llm.generate(PROMPTS, GREEDY)):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids, prompt
    stats = llm.total_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert len(stats.accepted_per_pos) >= 3


def test_a_repeated_answer_is_drafted_from_the_earlier_request(tiny_models, plain_outputs):
    """The second request's answer is the first's: it is drafted from the first request's output, which prompt
    lookup (its own tokens only) does not see."""
    llm = suffix_llm(tiny_models, 1, suffix_min_prob=0.5)
    first = llm.generate(PROMPTS[1], GREEDY)[0]
    second = llm.generate(PROMPTS[1], GREEDY)[0]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids == plain_outputs[1].outputs[0].token_ids
    answer = len(second.outputs[0].token_ids)
    assert second.metrics.accepted_tokens >= 0.8 * answer, second.metrics
    assert second.metrics.steps <= answer / 4 and first.metrics.steps > 2 * second.metrics.steps
    # with the first request evicted (a zero budget of finished tokens) the second drafts from itself only
    forgetful = suffix_llm(tiny_models, 1, suffix_min_prob=0.5, suffix_max_tokens=0)
    forgetful.generate(PROMPTS[1], GREEDY)
    alone = forgetful.generate(PROMPTS[1], GREEDY)[0]
    assert alone.metrics.accepted_tokens == first.metrics.accepted_tokens
    assert forgetful.proposer.tree.tokens_held == 0 and not forgetful.proposer.tree.root.children
    # forget_finished (what benchmarks repeating their prompts call between runs) drops the first answer the same way
    llm.proposer.forget_finished()
    assert llm.proposer.tree.tokens_held == 0 and not llm.proposer.tree.root.children
    again = llm.generate(PROMPTS[1], GREEDY)[0]
    assert again.metrics.accepted_tokens == first.metrics.accepted_tokens


def vocab8_suffix(k: int) -> dict:
    return {"method": "suffix", "num_speculative_tokens": k, "num_tree_nodes": 2 * k, "suffix_min_prob": 0.05}


@pytest.mark.slow
@pytest.mark.parametrize("params_name", list(BOTH))
def test_sampling_from_suffix_trees_matches_the_target(params_name, monkeypatch, tmp_path_factory):
    """8,000 requests of one prompt in one batch: each drafts from what the others (and it) emitted so far."""
    from .test_lossless_sampling import make_tiny_vocab_model

    root = tmp_path_factory.mktemp("vocab8_suffix")
    make_tiny_vocab_model(root / "target", seed=10)
    p_value, stats = chi_square_p(root, vocab8_suffix(2), BOTH[params_name], monkeypatch)
    assert stats.accepted_tokens > 0.05 * stats.steps and stats.draft_tokens > 1.2 * stats.drafts  # trees, too
    assert p_value > 1e-3


@pytest.fixture(scope="module")
def certify_pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("certify_suffix"), target_sharpness=3.0)


@pytest.mark.slow
@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}])
def test_certify_passes(certify_pair, params):
    """certify (tests/certify's pair, its target only) at T=1 and T=0.7/top-p 0.9, prefix caching on."""
    llm = LLM(certify_pair / "target", dtype="float32", max_num_seqs=16, speculative_config={
        "method": "suffix", "num_speculative_tokens": 4, "adaptive": False, "suffix_min_prob": 0.05})
    report = certify(llm, CertifyConfig(samples=2048, prompts="builtin", **params))
    # (a random model's samples repeat little: ~2% of the drafts are accepted, which still exercises the one-hot
    # tree verification that tests/certify shows to have power)
    assert report.draft_tokens > 1000 and report.accepted_tokens > 0.01 * report.draft_tokens
    assert report.verdict.passed and report.verdict.p_value > 1e-3 and report.verdict.impossible == 0, report.verdict
