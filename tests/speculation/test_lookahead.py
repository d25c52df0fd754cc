"""Lookahead decoding: the Jacobi window as a tree (its mask against the definition), the target's outputs at the
window read in context (against separate passes), the n-gram pool, greedy output identical to plain decoding, and
lossless sampling (chi-square, with a negative control)."""
import pytest
import torch

import specdecode.speculation.verify as verify_module
from specdecode.engine.llm import LLM
from specdecode.sampling import SamplingParams
from specdecode.speculation.proposers.lookahead import LookaheadConfig, NgramPool, _State
from specdecode.speculation.tree import merge_paths, tree_shape

from .heads_fixtures import chains_by, chi_square_p, correction_from_p, per_tree
from .test_lossless_sampling import BOTH, PARAMS, rejection, make_tiny_vocab_model


def lookahead_config(n=3, w=3, g=3, adaptive=False):
    return {"method": "lookahead", "num_speculative_tokens": n - 1, "lookahead_ngram": n, "lookahead_window": w,
            "lookahead_guesses": g, "adaptive": adaptive}


@pytest.fixture(scope="module")
def vocab8(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab8_lookahead")
    make_tiny_vocab_model(root / "target", seed=10)
    return root


def test_window_is_a_tree_with_the_jacobi_mask():
    """Column i's level-l token sits i + l + 1 places after the pending token and sees level 0 up to column i,
    then its own column below it."""
    state = _State(LookaheadConfig(ngram=4, window=4, guesses=1))
    state.columns = [[10 + i, 20 + i, 30 + i] for i in range(3)] + [[13]]  # the last column is one level tall
    branch = state.branch([1, 2, 3], levels=3, width=4)
    shape = tree_shape(branch.parents)
    node = {}  # (level, column) -> branch node
    for i, column in enumerate(state.columns):
        for level, token in enumerate(column):
            node[level, i] = branch.tokens.tolist().index(token)
    for (level, i), j in node.items():
        assert int(shape.depths[j]) == i + level
        sees = {(0, c) for c in range(i + 1)} | {(lv, i) for lv in range(1, level + 1)}
        assert {key for key, other in node.items() if shape.attention_mask[j, other]} == sees
    assert [branch.tokens[t] for t in state.tops] == [30, 31, 32, 13]


def test_full_columns_become_ngrams_and_move_up():
    state = _State(LookaheadConfig(ngram=3, window=2, guesses=2))
    state.columns = [[5, 6], [7]]
    branch = state.branch([1], levels=2, width=2)
    outputs = [0] * len(branch.tokens)
    outputs[state.tops[0]], outputs[state.tops[1]] = 8, 9
    state.advance(outputs)
    assert state.columns == [[6, 8], [7, 9]]  # the full column moved up; the short one grew
    assert state.pool.guesses(5, 4, 2) == [(6, 8)]


def test_pool_keeps_the_most_recent_ngrams_per_first_token():
    pool = NgramPool(per_key=2)
    for ngram in ([1, 2, 3], [1, 4, 5], [1, 2, 3], [1, 6, 7], [2, 9, 9]):
        pool.add(ngram)
    assert pool.guesses(1, 5, 2) == [(6, 7), (2, 3)]  # (4, 5) was the least recently seen
    assert pool.guesses(1, 5, 1) == [(6,), (2,)]
    assert pool.guesses(3, 5, 2) == []
    assert merge_paths([(1, 2), (1, 3), (4,), (1, 2)]) == ([1, 2, 3, 4], [-1, 0, 0, -1], [3, 2, 1, 1])


def test_window_outputs_are_the_targets_tokens_in_context(tiny_models, monkeypatch):
    """The argmax handed back at each window node is what the target predicts after the committed text and that
    node's ancestors: mask and positions of the branch are right, and the drafts do not leak into it."""
    llm = LLM(str(tiny_models["target"]), dtype="float32", speculative_config=lookahead_config(n=4, w=4, g=3))
    seen = []
    propose = llm.proposer.propose

    def recording(seqs, budgets):
        trees = propose(seqs, budgets)
        seen.append((list(seqs[0].token_ids), trees[0]))
        return trees

    monkeypatch.setattr(llm.proposer, "propose", recording)
    llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    checked = 0
    for context, tree in seen[2:5]:
        branch = tree.lookahead
        for j in range(len(branch.tokens)):
            path = [j]
            while branch.parents[path[-1]] >= 0:
                path.append(branch.parents[path[-1]])
            ids = torch.tensor([context + branch.tokens[path[::-1]].tolist()])
            with torch.no_grad():
                assert branch.outputs[j] == int(llm.target(ids).logits[0, -1].argmax())
            checked += 1
    assert checked >= 3 * 9


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_is_exact_and_drafts_are_accepted(vocab8, batch):
    prompts = [[0, 1, 2, 3, 4], [5], [6, 2, 2, 7, 1, 0, 3, 3, 5], [1, 1], [7, 6, 5, 4, 3, 2]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(vocab8 / "target"), dtype="float32").generate(prompts, greedy)
    llm = LLM(str(vocab8 / "target"), dtype="float32", speculative_config=lookahead_config(n=4, w=4, g=3),
              max_num_seqs=batch)
    outputs = llm.generate(prompts, greedy)
    for prompt, want, got in zip(prompts, plain, outputs):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, prompt
    stats = llm.total_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert len(stats.accepted_per_pos) >= 2, "whole n-grams must be accepted too"


def test_adaptive_lookahead_stays_exact(vocab8):
    prompts = [[0, 1, 2, 3, 4], [6, 2, 2, 7, 1, 0, 3, 3, 5]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(vocab8 / "target"), dtype="float32").generate(prompts, greedy)
    llm = LLM(str(vocab8 / "target"), dtype="float32", speculative_config=lookahead_config(adaptive=True),
              max_num_seqs=2)
    assert llm.controller is not None and llm.controller.widths == [1, 5, 13]
    for want, got in zip(plain, llm.generate(prompts, greedy)):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.slow
@pytest.mark.parametrize("params_name", list(BOTH))
def test_sampling_with_lookahead_matches_the_target(vocab8, params_name, monkeypatch):
    p_value, stats = chi_square_p(vocab8, lookahead_config(), BOTH[params_name], monkeypatch)
    assert len(stats.accepted_per_pos) >= 2
    assert p_value > 1e-3


@pytest.mark.slow
def test_negative_control_fails(vocab8, monkeypatch):
    monkeypatch.setattr(verify_module, "verify_trees", per_tree(correction_from_p))
    monkeypatch.setattr(verify_module, "verify_chains", chains_by(correction_from_p))
    p_value, _ = chi_square_p(vocab8, lookahead_config(), rejection(PARAMS["t0.7_top_p0.9"]), monkeypatch)
    assert p_value < 1e-6
