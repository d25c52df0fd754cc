"""`auto`: the sources' trees merged into one trie, nodes valued by learned per-source acceptance and cut by the
measured pass costs; greedy output identical to plain decoding, sampling lossless (chi-square, with a negative
control), per-source counts in /metrics, and clear errors for sources it cannot combine."""
from types import SimpleNamespace

import pytest
import torch

import specdecode.speculation.verify as verify_module
from specdecode.engine.llm import LLM
from specdecode.engine.metrics import EngineMetrics
from specdecode.errors import ConfigError
from specdecode.sampling import SamplingParams
from specdecode.speculation.proposers.auto import PRIOR_RATE, AutoProposer
from specdecode.speculation.tree import DraftTree
from specdecode.speculation.verify import VerifyResult

from .heads_fixtures import chains_by, chi_square_p, correction_from_p, per_tree
from .test_lossless_sampling import BOTH, PARAMS, rejection
from .test_rest import vocab8_rest  # noqa: F401 (a fixture)


class Fixed:
    """A source that always proposes the same tree."""

    trees_rewritable = True
    draft_network = None

    def __init__(self, tokens, parents):
        self.tree = DraftTree(torch.tensor(tokens), tuple(parents))

    def add(self, seqs):
        pass

    def remove(self, seq):
        pass

    def propose(self, seqs, budgets):
        return [self.tree if b else DraftTree.empty() for b in budgets]

    def observe(self, seqs, trees, results):
        pass


class Seq:
    def __init__(self, request_id="r"):
        self.request_id = request_id


def auto(sources, max_depth=4, nodes=lambda k: 3 * k):
    return AutoProposer(sources, max_depth, nodes, [1 + nodes(k) for k in range(max_depth + 1)])


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[tree.path_to(i)].tolist()) for i in range(len(tree))}


def test_trees_merge_into_one_trie_valued_by_both_sources():
    a = Fixed([5, 6, 7], [-1, 0, 1])  # 5 6 7
    b = Fixed([5, 6, 9, 8], [-1, 0, 1, -1])  # 5 6 9 and 8
    proposer = auto({"a": a, "b": b})
    seq = Seq()
    proposer.add([seq])
    tree = proposer.propose([seq], [4])[0]
    assert paths(tree) == {(5,), (5, 6), (5, 6, 7), (5, 6, 9), (8,)}
    assert all(p < i for i, p in enumerate(tree.parents))
    values = {c.token: c.value for c in proposer.last["r"]}
    both = 1 - (1 - PRIOR_RATE) ** 2  # proposed by both: the chance that either is right
    assert values[5] == pytest.approx(both) and values[6] == pytest.approx(both * both)
    assert values[7] == pytest.approx(both * both * PRIOR_RATE) and values[8] == pytest.approx(PRIOR_RATE)
    # at most pass_nodes(k) nodes, the most valuable first; depth capped at k levels
    assert paths(proposer.propose([seq], [1])[0]) == {(5,), (8,)}


def test_rates_are_learned_per_source_and_carry_to_new_requests():
    right = Fixed([1, 2], [-1, 0])
    wrong = Fixed([3, 4], [-1, 0])
    proposer = auto({"right": right, "wrong": wrong}, nodes=lambda k: 2 * k)
    for n in range(30):
        seq = Seq(f"r{n}")
        proposer.add([seq])
        tree = proposer.propose([seq], [2])[0]
        accepted = [i for i, t in enumerate(tree.tokens.tolist()) if t in (1, 2)]
        proposer.observe([seq], [tree], [VerifyResult(accepted, 0)])
        proposer.remove(seq)
    assert proposer.counts["right"][1] == proposer.counts["right"][0] > 0 and proposer.counts["wrong"][1] == 0
    fresh = Seq("new")
    proposer.add([fresh])
    at = proposer.rates.at
    assert proposer.rate("new", at(0, 0, 0)) > 0.9 > 0.1 > proposer.rate("new", at(1, 0, 0))  # a new one starts warm
    proposer.bind_costs(WidthCosts(0.5, proposer.widths))
    assert paths(proposer.propose([fresh], [1])[0]) == {(1,)}  # the wrong source's node is not worth verifying


def test_acceptance_is_learned_per_confidence_class():
    """A source whose long matches are right and short ones wrong: its confident trees are kept, the others not."""
    source = Fixed([1, 2], [-1, 0])
    proposer = auto({"lookup": source}, nodes=lambda k: 2 * k)
    proposer.bind_costs(WidthCosts(0.5, proposer.widths))
    for n in range(40):
        seq = Seq(f"r{n}")
        proposer.add([seq])
        source.tree.confidence = 4 if n % 2 else 1
        tree = proposer.propose([seq], [2])[0]
        proposer.observe([seq], [tree], [VerifyResult(list(range(len(tree))) if n % 2 else [], 0)])
        proposer.remove(seq)
    seq = Seq("new")
    proposer.add([seq])
    source.tree.confidence = 4
    assert len(proposer.propose([seq], [2])[0]) == 2
    source.tree.confidence = 1
    assert len(proposer.propose([seq], [2])[0]) == 0


class WidthCosts:
    """A cost model whose pass time grows with width: a plain step costs 1, each node per row `per_node` more
    (steep, as at a large batch)."""

    def __init__(self, per_node: float, widths: list[int]):
        self.per_node, self.widths = per_node, widths

    def target_time(self, batch, k):
        return 1.0 + self.per_node * (self.widths[k] - 1)

    def overhead_time(self, batch, speculative):
        return 0.0


def test_the_tree_stops_where_one_more_node_would_not_pay():
    chain = Fixed([1, 2, 3, 4], [-1, 0, 1, 2])
    proposer = auto({"chain": chain}, nodes=lambda k: k)
    seq = Seq()
    proposer.add([seq])
    assert len(proposer.propose([seq], [4])[0]) == 4  # no cost model: the budget decides
    proposer.bind_costs(WidthCosts(1 / 3, proposer.widths))  # a node costs a third of a plain step: only sure ones pay
    rates = proposer.rates
    for depth, rate in enumerate([0.95, 0.95, 0.2, 0.95]):
        rates.hits[rates.at(0, 0, depth)] = rate * rates.trials[rates.at(0, 0, depth)]
    assert len(proposer.propose([seq], [4])[0]) == 2  # (1 + 0.95 + 0.90) / (1 + 2/3) beats 1 and 3 nodes


def test_one_width_for_the_batch_rows_that_guess_nothing_pay_for_it_too():
    """The pass is padded to the widest row: a row with nothing to guess pays for another row's nodes, so at batch 2
    fewer of them pay than alone, and every row is cut to one width."""
    class OnlyFirst(Fixed):
        def propose(self, seqs, budgets):
            return [self.tree if i == 0 and b else DraftTree.empty() for i, b in enumerate(budgets)]

    proposer = auto({"chain": OnlyFirst([1, 2, 3, 4], [-1, 0, 1, 2])}, nodes=lambda k: k)
    proposer.bind_costs(WidthCosts(0.3, proposer.widths))
    rates = proposer.rates
    for depth, rate in enumerate([0.9, 0.7, 0.95, 0.95]):  # path values 0.9, 0.63, 0.60, 0.57
        rates.hits[rates.at(0, 0, depth)] = rate * rates.trials[rates.at(0, 0, depth)]
    one, two = Seq("a"), Seq("b")
    proposer.add([one, two])
    assert len(proposer.propose([one], [4])[0]) == 4  # alone: (1 + 2.70) / 2.2 = 1.68 beats shorter trees
    # beside a row that guesses nothing: (2 + 0.9) / 1.3 = 2.23 beats (2 + 2.70) / 2.2 = 2.13 and plain's 2
    assert [len(t) for t in proposer.propose([one, two], [4, 4])] == [1, 0]


@pytest.fixture(scope="module")
def plain_answers(tiny_models):
    prompts = ["def add(a, b):\n    return a + b\n\ndef add(", "class Point:", "for i in range(10):", "print("]
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    return prompts, greedy, LLM(str(tiny_models["target"]), dtype="float32").generate(prompts, greedy)


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_is_exact_and_sources_are_counted(tiny_models, plain_answers, batch):
    prompts, greedy, plain = plain_answers
    llm = LLM(str(tiny_models["target"]), dtype="float32", max_num_seqs=batch,
              speculative_config={"method": "auto", "num_speculative_tokens": 4, "adaptive": False})
    assert llm.proposer.names == ["ngram", "suffix"]
    for _ in range(2):  # the second round: suffix decoding knows the first round's answers
        for prompt, want, got in zip(prompts, plain, llm.generate(prompts, greedy)):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids, prompt
    counts = llm.proposer.counts
    assert all(proposed > 0 for proposed, _ in counts.values()), counts
    assert 0 < llm.total_stats.accepted_tokens <= sum(accepted for _, accepted in counts.values())
    assert counts["suffix"][1] > 0, counts  # repeated answers are drafted across requests


def test_adaptive_auto_shapes_its_own_trees_and_stays_exact(tiny_models, plain_answers):
    """With the controller on, auto is offered the whole budget every step and trims by the measured pass costs
    itself (a controller choosing K from per-level rates would cut it first); prompt lookup alone keeps K chosen
    by the controller."""
    prompts, greedy, plain = plain_answers
    llm = LLM(str(tiny_models["target"]), dtype="float32", max_num_seqs=2,
              speculative_config={"method": "auto", "num_speculative_tokens": 4, "adaptive": True})
    assert llm.controller.delegated and llm.proposer.costs is llm.controller.costs
    for prompt, want, got in zip(prompts, plain, llm.generate(prompts, greedy)):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, prompt
    llm.controller.steps_since_draft = 0  # (whether the last steps drafted depends on measured pass times,
    llm.controller.gate.start_cap = 4  # and so does the cost gate's last verdict, which a new request starts from)
    assert llm.controller.choose([llm.make_sequence(prompts[0], greedy)]) == 4
    ngram = LLM(str(tiny_models["target"]), dtype="float32",
                speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": True})
    assert not ngram.controller.delegated


@pytest.mark.parametrize("covered", [None, 0.5])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_draft_model_joins_the_tree_and_stays_exact(tiny_models, plain_answers, batch, covered, monkeypatch):
    """"model" naming a draft checkpoint makes the draft model a source beside prompt lookup and suffix decoding:
    greedy output is plain decoding's, the draft's nodes are accepted (it is a near copy of the target), and its
    cache follows whatever path the target took, whichever source guessed it (also when it drafts below the free
    sources' sure path: COVERED)."""
    from specdecode.speculation.proposers import auto as auto_module

    monkeypatch.setattr(auto_module, "COVERED", covered)
    prompts, greedy, plain = plain_answers
    llm = LLM(str(tiny_models["target"]), dtype="float32", max_num_seqs=batch,
              speculative_config={"method": "auto", "model": str(tiny_models["draft"]), "num_speculative_tokens": 4,
                                  "adaptive": False})
    assert llm.proposer.names == ["draft_model", "ngram", "suffix"]
    assert llm.proposer.draft_network is llm.proposer.drafter.model
    drafter, below = llm.proposer.drafter, []
    propose = drafter.propose

    def noting(seqs, budgets, prefixes=None):
        below.extend(p for p, b in zip(prefixes or [], budgets) if p and b)
        return propose(seqs, budgets, prefixes)

    monkeypatch.setattr(drafter, "propose", noting)
    for _ in range(2):
        for prompt, want, got in zip(prompts, plain, llm.generate(prompts, greedy)):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids, prompt
    proposed, accepted = llm.proposer.counts["draft_model"]
    assert accepted > 0.3 * proposed > 0, llm.proposer.counts
    assert bool(below) == (covered is not None)  # drafted below a free path, when on


def test_a_windowed_draft_stays_exact(tiny_models, plain_answers, monkeypatch):
    """A draft that joins with only the last few tokens of a long prompt (auto's DRAFT_WINDOW, here 6) drafts from
    that shorter context at its own positions; the output is still plain decoding's."""
    from specdecode.speculation.proposers import auto as auto_module

    monkeypatch.setattr(auto_module, "DRAFT_WINDOW", 6)
    prompts, greedy, plain = plain_answers
    llm = LLM(str(tiny_models["target"]), dtype="float32", max_num_seqs=2,
              speculative_config={"method": "auto", "model": str(tiny_models["draft"]), "num_speculative_tokens": 3,
                                  "adaptive": False})
    drafter = llm.proposer.drafter
    assert drafter.window == 6
    windowed = []
    add = drafter.add

    def noting_add(seqs):
        add(seqs)
        windowed.extend(seq.request_id for seq in seqs if seq.request_id in drafter.windowed)

    monkeypatch.setattr(drafter, "add", noting_add)
    for prompt, want, got in zip(prompts, plain, llm.generate(prompts, greedy)):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, prompt
    assert len(windowed) == 3  # every prompt but "print(", which fits in the window
    assert llm.proposer.counts["draft_model"][1] > 0 and not drafter.windowed  # drafted; forgotten when done


def test_a_draft_model_in_auto_samples_exactly_with_a_seed(tiny_models):
    """Seeded sampling gives the same tokens with and without speculation (one-hot guesses verified exactly)."""
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=32, ignore_eos=True)
    prompts = ["def add(a, b):", "class Point:"]
    plain = LLM(str(tiny_models["target"]), dtype="float32").generate(prompts, params)
    llm = LLM(str(tiny_models["target"]), dtype="float32", max_num_seqs=2,
              speculative_config={"method": "auto", "model": str(tiny_models["draft"]), "num_speculative_tokens": 3})
    for want, got in zip(plain, llm.generate(prompts, params)):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert llm.proposer.counts["draft_model"][1] > 0


def test_the_draft_cache_follows_the_committed_tokens(tiny_models):
    """A draft whose chain was not the path the target took keeps only the nodes whose tokens were committed:
    after a step where another source's guess won, its next drafts are what a fresh draft model would draft."""
    from specdecode.speculation.config import SpeculativeConfig, build_proposer
    from specdecode.model.loading import load_model
    from specdecode.model.tokenizer import Tokenizer

    target = load_model(tiny_models["target"], dtype="float32")
    config = SpeculativeConfig(method="draft_model", model=str(tiny_models["draft"]), num_speculative_tokens=4)
    tok = Tokenizer(tiny_models["target"])
    drafts = [build_proposer(config, target, tok, "float32", "cpu") for _ in range(2)]
    for proposer in drafts:
        proposer.ensure_cache(1, 64)
    seq = SimpleNamespace(request_id="a", token_ids=tok.encode("def add(a, b):"), slot=0,
                          params=SamplingParams(temperature=0))
    drafts[0].add([seq])
    [tree] = drafts[0].propose([seq], [4])
    chain = tree.tokens.tolist()
    committed = chain[:2] + [(chain[2] + 1) % 100]  # two of its nodes, then a token it did not guess
    seq.token_ids += committed
    drafts[0].observe([seq], [tree], [None])
    assert drafts[0].draft_len["a"] == len(seq.token_ids) - 1
    drafts[1].add([seq])
    assert drafts[0].propose([seq], [4])[0].tokens.tolist() == drafts[1].propose([seq], [4])[0].tokens.tolist()


@pytest.mark.parametrize("diverge", [0, 1])
def test_the_draft_cache_keeps_no_node_past_where_the_committed_tokens_left_its_chain(tiny_models, diverge):
    """As `auto` commits another source's path: the draft's chain is left in its middle (at depth `diverge`) and
    more tokens are committed after that, as many as the chain had nodes. Only the nodes before the divergence are
    kept (matching by count would keep them all), so the next drafts are a fresh draft model's."""
    from specdecode.speculation.config import SpeculativeConfig, build_proposer
    from specdecode.model.loading import load_model
    from specdecode.model.tokenizer import Tokenizer

    target = load_model(tiny_models["target"], dtype="float32")
    config = SpeculativeConfig(method="auto", model=str(tiny_models["draft"]), num_speculative_tokens=4)
    tok = Tokenizer(tiny_models["target"])
    drafters = [build_proposer(config, target, tok, "float32", "cpu").drafter for _ in range(2)]
    for drafter in drafters:
        drafter.ensure_cache(1, 64)
    seq = SimpleNamespace(request_id="a", token_ids=tok.encode("def add(a, b):"), slot=0,
                          params=SamplingParams(temperature=0))
    drafters[0].add([seq])
    [tree] = drafters[0].propose([seq], [4])
    chain = tree.tokens.tolist()
    assert len(chain) == 4
    other = [t for t in (7, 8, 9, 10) if t != chain[diverge]][:4 - diverge]
    seq.token_ids += chain[:diverge] + other + [11]  # the last one is the new pending token
    drafters[0].observe([seq], [tree], [None])
    assert drafters[0].draft_len["a"] == len(seq.token_ids) - 1 - len(other)  # the tail catches up next step
    drafters[1].add([seq])
    for _ in range(2):  # and stays in step afterwards
        mine, fresh = drafters[0].propose([seq], [4])[0], drafters[1].propose([seq], [4])[0]
        assert mine.tokens.tolist() == fresh.tokens.tolist()
        seq.token_ids += mine.tokens.tolist()[:2] + [12]
        for drafter, tree in zip(drafters, (mine, fresh)):
            drafter.observe([seq], [tree], [None])


def test_metrics_count_by_source(tiny_models):
    llm = LLM(str(tiny_models["target"]), dtype="float32",
              speculative_config={"method": "auto", "auto_sources": ["ngram"], "adaptive": False})
    llm.generate("def add(a, b):\n    return a + b\n\ndef add(", SamplingParams(temperature=0, max_tokens=24))
    metrics = EngineMetrics()
    metrics.watch(llm.make_scheduler(1), 64, "auto", llm.proposer)
    samples = metrics.samples()
    proposed, accepted = llm.proposer.counts["ngram"]
    assert proposed > 0
    assert samples['specdecode:spec_decode_num_draft_tokens_by_source_total{source="ngram"}'] == proposed
    assert samples['specdecode:spec_decode_num_accepted_tokens_by_source_total{source="ngram"}'] == accepted


@pytest.mark.parametrize("sources, message", [
    (["eagle"], "eagle cannot be combined yet"),
    (["lookahead"], "lookahead cannot be combined yet"),
    (["draft_model", "ngram"], "draft_model needs \"model\""),
    (["nope"], "'nope' is not a method"),
    (["ngram", "ngram"], "distinct methods"),
    ([], "non-empty list"),
    ("ngram", "non-empty list"),
])
def test_bad_sources_are_refused(tiny_models, sources, message):
    with pytest.raises(ConfigError, match=message):
        LLM(str(tiny_models["target"]), dtype="float32",
            speculative_config={"method": "auto", "auto_sources": sources})


def auto_rest_config(root):
    return {"method": "auto", "auto_sources": ["ngram", "rest"], "model": str(root / "ds"),
            "num_speculative_tokens": 2, "num_tree_nodes": 4}


@pytest.mark.slow
@pytest.mark.parametrize("params_name", list(BOTH))
def test_sampling_from_combined_trees_matches_the_target(vocab8_rest, params_name, monkeypatch):  # noqa: F811
    p_value, stats = chi_square_p(vocab8_rest, auto_rest_config(vocab8_rest), BOTH[params_name], monkeypatch)
    assert len(stats.accepted_per_pos) >= 2
    assert p_value > 1e-3


@pytest.mark.slow
def test_negative_control_fails(vocab8_rest, monkeypatch):  # noqa: F811
    monkeypatch.setattr(verify_module, "verify_trees", per_tree(correction_from_p))
    monkeypatch.setattr(verify_module, "verify_chains", chains_by(correction_from_p))
    p_value, _ = chi_square_p(vocab8_rest, auto_rest_config(vocab8_rest), rejection(PARAMS["t0.7_top_p0.9"]),
                              monkeypatch)
    assert p_value < 1e-6


def test_a_draft_below_a_guessed_prefix_keeps_its_cache_in_step(tiny_models):
    """auto hands the draft model the free sources' sure path as a prefix: the draft feeds it, drafts below it, and
    its tree is that path then its chain. Whatever part of the prefix the target committed (all, some, none) is kept
    in the draft's cache with the chain's committed nodes below it, and the next drafts are what a fresh draft model
    would draft."""
    from specdecode.speculation.config import SpeculativeConfig, build_proposer
    from specdecode.model.loading import load_model
    from specdecode.model.tokenizer import Tokenizer

    target = load_model(tiny_models["target"], dtype="float32")
    config = SpeculativeConfig(method="draft_model", model=str(tiny_models["draft"]), num_speculative_tokens=4)
    tok = Tokenizer(tiny_models["target"])
    prompt = tok.encode("def add(a, b):")
    fresh_chain = None
    for kept in (3, 1, 0):
        drafts = [build_proposer(config, target, tok, "float32", "cpu") for _ in range(2)]
        for proposer in drafts:
            proposer.ensure_cache(1, 64)
        seq = SimpleNamespace(request_id="a", token_ids=list(prompt), slot=0, params=SamplingParams(temperature=0))
        drafts[0].add([seq])
        if fresh_chain is None:  # what the draft itself would guess: used as a "free source's" prefix
            fresh_chain = drafts[0].propose([seq], [4])[0].tokens.tolist()
            drafts[0].pending.clear()
        prefix = fresh_chain[:2] + [(fresh_chain[2] + 7) % 100]  # two of its own guesses, then another token
        [tree] = drafts[0].propose([seq], [2], [prefix])
        assert tree.tokens.tolist()[:3] == prefix and tree.parents == (-1, 0, 1, 2, 3)
        below = tree.tokens.tolist()[3:]
        if kept == 3:  # the whole prefix and the draft's first node accepted, then a bonus token it did not guess
            committed = prefix + below[:1] + [(below[1] + 1) % 100]
        else:  # part of the prefix, then a token that is not the prefix's next
            committed = prefix[:kept] + [(prefix[kept] + 1) % 100]
        seq.token_ids += committed
        drafts[0].observe([seq], [tree], [None])
        assert drafts[0].draft_len["a"] == len(seq.token_ids) - 1
        drafts[1].add([seq])
        assert drafts[0].propose([seq], [4])[0].tokens.tolist() == drafts[1].propose([seq], [4])[0].tokens.tolist()
