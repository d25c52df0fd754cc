"""Medusa: the static tree from measured top-k accuracies (against brute force), greedy output identical to plain
decoding, and lossless sampling from Medusa trees (chi-square, with a negative control)."""
import itertools
import json
import math
import random

import pytest
import torch

import specdecode.speculation.verify as verify_module
from specdecode.engine.llm import LLM
from specdecode.sampling import SamplingParams
from specdecode.speculation.heads import rank_accuracy
from specdecode.speculation.proposers.medusa import greedy_tree
from specdecode.speculation.tree import paths_to_parents

from .heads_fixtures import (chi_square_p, correction_from_p, load_target, per_tree, save_speculator, target_text,
                             train_medusa)
from .test_lossless_sampling import BOTH, PARAMS, rejection, make_tiny_vocab_model


def test_greedy_tree_is_the_best_set_of_paths():
    rng = random.Random(0)
    accuracy = [sorted((rng.random() * 0.5 for _ in range(4)), reverse=True) for _ in range(3)]
    value = lambda path: math.prod(accuracy[d][r] for d, r in enumerate(path))  # noqa: E731
    every = [p for n in (1, 2, 3) for p in itertools.product(range(4), repeat=n)]
    for nodes in (1, 5, 12, 40):
        paths = greedy_tree(accuracy, nodes)
        assert set(paths) == set(sorted(every, key=value, reverse=True)[:nodes])
        parents = paths_to_parents(paths)  # parents come first
        assert all(p == -1 if len(path) == 1 else paths[p] == path[:-1] for path, p in zip(paths, parents))


def test_rank_accuracy_from_cumulative_top_k():
    per_rank = rank_accuracy([[0.5, 0.6, 0.65, 0.7, 0.8]], [1, 2, 3, 5, 10])[0]
    assert len(per_rank) == 10
    assert per_rank[:4] == pytest.approx([0.5, 0.1, 0.05, 0.025])
    assert per_rank[5:] == pytest.approx([0.02] * 5)
    assert sum(per_rank) == pytest.approx(0.8)
    assert rank_accuracy([[0.3, 0.4]]) == [pytest.approx([0.3, 0.1])]


@pytest.fixture(scope="module")
def vocab8_medusa(tmp_path_factory):
    """An 8-token target and three Medusa heads over 6 of its tokens, trained for a moment on its samples, with
    the top-k accuracies recorded in the speculator's config."""
    root = tmp_path_factory.mktemp("vocab8_medusa")
    make_tiny_vocab_model(root / "target", seed=10)
    target = load_target(root / "target")
    heads = train_medusa(target, torch.tensor([0, 1, 3, 4, 5, 6]), target_text(target, 64, 24, sample=True), 3,
                         steps=100)
    accuracy = [[0.5, 0.7, 0.8], [0.4, 0.6, 0.7], [0.3, 0.5, 0.6]]
    save_speculator(heads, target, root / "heads", topk_accuracy=accuracy, topk_ranks=[1, 2, 3])
    return root


def medusa_config(root, depth=2, nodes=6):
    return {"method": "medusa", "model": str(root / "heads"), "num_speculative_tokens": depth, "adaptive": False,
            "num_tree_nodes": nodes}


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_is_exact_and_drafts_are_accepted(vocab8_medusa, batch):
    prompts = [[0, 1, 2, 3, 4], [5], [6, 2, 2, 7, 1, 0, 3, 3, 5], [1, 1], [7, 6, 5, 4, 3, 2]]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(str(vocab8_medusa / "target"), dtype="float32").generate(prompts, greedy)
    llm = LLM(str(vocab8_medusa / "target"), dtype="float32",
              speculative_config=medusa_config(vocab8_medusa, depth=3, nodes=9), max_num_seqs=batch)
    outputs = llm.generate(prompts, greedy)
    for prompt, want, got in zip(prompts, plain, outputs):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, prompt
    stats = llm.total_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert len(stats.accepted_per_pos) >= 2, "paths two levels deep must be accepted"


def test_tree_comes_from_the_recorded_accuracies(vocab8_medusa):
    llm = LLM(str(vocab8_medusa / "target"), dtype="float32", speculative_config=medusa_config(vocab8_medusa))
    recorded = json.loads((vocab8_medusa / "heads" / "config.json").read_text())["topk_accuracy"]
    assert llm.proposer.paths == greedy_tree(rank_accuracy(recorded[:2], [1, 2, 3]), 6)
    assert llm.spec_config.tree_size == 6


@pytest.mark.slow
@pytest.mark.parametrize("params_name", list(BOTH))
def test_sampling_from_medusa_trees_matches_the_target(vocab8_medusa, params_name, monkeypatch):
    p_value, stats = chi_square_p(vocab8_medusa, medusa_config(vocab8_medusa), BOTH[params_name], monkeypatch)
    assert len(stats.accepted_per_pos) >= 2, "whole paths of the tree must be accepted too"
    assert p_value > 1e-3


@pytest.mark.slow
def test_negative_control_fails(vocab8_medusa, monkeypatch):
    monkeypatch.setattr(verify_module, "verify_trees", per_tree(correction_from_p))
    p_value, _ = chi_square_p(vocab8_medusa, medusa_config(vocab8_medusa), rejection(PARAMS["t0.7_top_p0.9"]), monkeypatch)
    assert p_value < 1e-6
