"""EAGLE-2: greedy output identical to plain decoding, the target's features reach the head aligned, the dynamic
tree's rerank, the speculator checks, and lossless sampling (chi-square, with a negative control)."""
from pathlib import Path

import pytest
import torch

import specdecode.speculation.verify as verify_module
from specdecode.engine.llm import LLM
from specdecode.errors import CheckpointError, ConfigError
from specdecode.sampling import SamplingParams
from specdecode.speculation.heads import EagleHead
from specdecode.speculation.proposers.eagle import EagleProposer, _Pool

from tests.speculation.test_control import FrozenCosts, synthetic_costs
from .heads_fixtures import (chi_square_p, copy_head, correction_from_p, keep_last_layer, load_target, per_tree,
                             save_speculator)
from .test_lossless_sampling import BOTH, PARAMS, rejection, make_tiny_vocab_model

PROMPTS = ["def add(a, b):", "class Point:\n    def __init__(self, x, y):\n        self.x = x", "for i in",
           "import os\nimport sys\n", "x", "Speculative decoding drafts tokens cheaply and"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def one_layer(tiny_models, tmp_path_factory):
    """A one-layer target and a head that copies it (so drafts are accepted, several levels deep)."""
    from tests.conftest import make_checkpoint

    root = tmp_path_factory.mktemp("eagle")
    make_checkpoint(root / "target", tiny_models["tok"], seed=3, layers=1)
    target = load_target(root / "target")
    draft_to_target = torch.arange(3, target.config.vocab_size - 40)  # a cut vocabulary: some ids never drafted
    save_speculator(copy_head(target, draft_to_target), target, root / "copy")
    return root


def _assert_plain_and_drafting(llm, plain, outputs):
    """Greedy outputs equal plain decoding's, and the head drafted: rejected sometimes, two levels deep often."""
    for prompt, want, got in zip(PROMPTS, plain, outputs):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, prompt
    stats = llm.total_stats
    assert stats.accepted_tokens < stats.draft_tokens, "drafts must be rejected sometimes"
    assert stats.accepted_per_pos[1] > 0.2 * stats.steps, "and accepted often, two levels deep"


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_is_exact_and_drafts_are_accepted(one_layer, batch):
    plain = LLM(str(one_layer / "target"), dtype="float32", max_num_seqs=4).generate(PROMPTS, GREEDY)
    config = {"method": "eagle", "model": str(one_layer / "copy"), "num_speculative_tokens": 4, "eagle_topk": 3,
              "adaptive": False}
    llm = LLM(str(one_layer / "target"), dtype="float32", speculative_config=config, max_num_seqs=batch)
    outputs = llm.generate(PROMPTS, GREEDY)
    _assert_plain_and_drafting(llm, plain, outputs)


def test_beside_a_quantized_target_the_head_runs_its_fused_kernels(one_layer, tmp_path):
    """With the target's matrices block-quantized, the head's are quantized too (Q8_0) and its layer runs through
    the fused kernel; drafts stay good and greedy output stays the quantized target's own."""
    from specdecode.model.loading import load_model
    from specdecode.model.quant import QuantLinear

    from tests.compiled import kernels_or_skip

    kernels_or_skip()
    quantized = load_model(one_layer / "target", dtype=torch.float32, quantization="q8_0").requires_grad_(False)
    draft_to_target = torch.arange(3, quantized.config.vocab_size - 40)
    save_speculator(copy_head(quantized, draft_to_target), quantized, tmp_path / "copy")
    target = dict(model=str(one_layer / "target"), dtype="float32", quantization="q8_0", max_num_seqs=4)
    plain = LLM(**target).generate(PROMPTS, GREEDY)
    config = {"method": "eagle", "model": str(tmp_path / "copy"), "num_speculative_tokens": 4, "eagle_topk": 3,
              "adaptive": False}
    llm = LLM(**target, speculative_config=config)
    head = llm.proposer.head
    linears = [m for m in head.modules() if isinstance(m, torch.nn.Linear | QuantLinear)]
    assert linears and all(isinstance(m, QuantLinear) and m.fmt == "q8_0" for m in linears)
    assert head.decoder.fused_layers(llm.proposer.cache or head.decoder.make_cache(1, 8)) is not None
    outputs = llm.generate(PROMPTS, GREEDY)
    _assert_plain_and_drafting(llm, plain, outputs)


@pytest.mark.parametrize("multi_layer", [False, True])
def test_target_features_reach_the_head_aligned(tiny_models, monkeypatch, tmp_path, multi_layer):
    """Every position's features (the last layer's; or, EAGLE-3-style, several layers' reduced) arrive once, in
    order, equal to a full forward's (prefill, plain and tree steps, uneven batch); greedy output stays plain's."""
    target = load_target(tiny_models["target"])
    last = target.config.num_hidden_layers - 1
    torch.manual_seed(0)
    head = EagleHead(target, torch.arange(target.config.vocab_size), (0, last) if multi_layer else None)
    save_speculator(head, target, tmp_path / "head", feature_layers=[0, last] if multi_layer else None)
    seen = {}
    real = EagleProposer.observe_target

    def spy(self, seqs, features):
        assert sorted(features.layers) == ([0, last] if multi_layer else [last])
        for b, (seq, n) in enumerate(zip(seqs, features.counts)):
            seen.setdefault(seq.request_id, []).append({i: h[b, :n].clone() for i, h in features.layers.items()})
        real(self, seqs, features)

    monkeypatch.setattr(EagleProposer, "observe_target", spy)
    config = {"method": "eagle", "model": str(tmp_path / "head"), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(str(tiny_models["target"]), dtype="float32", speculative_config=config, max_num_seqs=3)
    assert llm.proposer.head.feature_layers == ((0, last) if multi_layer else (last,))
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=1),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, use_speculation=False)]
    outputs = llm.generate(PROMPTS[:3], params)
    plain = LLM(str(tiny_models["target"]), dtype="float32").generate(PROMPTS[:1], params[0])
    assert outputs[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    for out in outputs:
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        with torch.no_grad():
            want = target(torch.tensor([ids[:-1]]), hidden_layers=(0, last)).layer_hidden
        for layer in seen[out.request_id][0]:
            got = torch.cat([step[layer] for step in seen[out.request_id]])  # [n, D]
            assert got.shape == want[layer][0].shape
            torch.testing.assert_close(got, want[layer][0], atol=1e-3, rtol=1e-3)
    assert llm.total_stats.draft_tokens > 0


def test_rerank_keeps_the_best_nodes_and_their_ancestors():
    """Against brute force: the chosen nodes are the best `nodes` by cumulative score among those shallower than
    the cap, every parent is chosen too, and parents come first."""
    gen = torch.Generator().manual_seed(0)
    B, k, levels = 5, 3, 3
    log_p = lambda *shape: torch.log_softmax(torch.randn(*shape, generator=gen), -1)[..., :k]  # noqa: E731
    scores = log_p(B, 8)
    pool = _Pool(scores, torch.arange(k).expand(B, k), torch.full((B, k), -1), 0)
    for depth in range(1, levels):
        first = pool.size - (k if depth == 1 else k * k)
        parents = first + torch.randint(0, k if depth == 1 else k * k, (B, k), generator=gen)
        parent_scores = torch.cat(pool.scores, 1).gather(1, parents)
        child = (parent_scores[..., None] + log_p(B, k, 8)).reshape(B, k * k)
        pool.append(child, torch.arange(k * k).expand(B, k * k) % 7, parents.repeat_interleave(k, 1), depth)
    scores_all, parents_all = torch.cat(pool.scores, 1), torch.cat(pool.parents, 1)
    depths_all = torch.cat(pool.depths, 1)
    caps, nodes = [3, 2, 1, 3, 3], [6, 4, 2, 1, 30]
    trees = pool.rerank(torch.tensor(caps), nodes, torch.arange(100, 107))
    for b, tree in enumerate(trees):
        allowed = [i for i in range(pool.size) if depths_all[b, i] < caps[b]]
        best = sorted(allowed, key=lambda i: -scores_all[b, i])[:nodes[b]]
        assert len(tree) == len(best)
        assert sorted(tree.depths.tolist()) == sorted(depths_all[b, best].tolist())
        assert all(-1 <= p < i for i, p in enumerate(tree.parents))
        assert all(100 <= t < 107 for t in tree.tokens.tolist())
        chosen = set(best)
        assert all(parents_all[b, i] < 0 or int(parents_all[b, i]) in chosen for i in best)


def test_speculator_checks(one_layer, tiny_models, tmp_path):
    with pytest.raises(CheckpointError, match="trained for other target weights"):
        LLM(str(tiny_models["target"]), dtype="float32",
            speculative_config={"method": "eagle", "model": str(one_layer / "copy")})
    with pytest.raises(ConfigError, match="holds a speculator of kind 'eagle'"):
        LLM(str(one_layer / "target"), dtype="float32",
            speculative_config={"method": "medusa", "model": str(one_layer / "copy")})
    with pytest.raises(ConfigError, match="needs \"model\""):
        LLM(str(one_layer / "target"), dtype="float32", speculative_config={"method": "eagle"})
    with pytest.raises(CheckpointError, match="config.json"):
        LLM(str(one_layer / "target"), dtype="float32", speculative_config={"method": "eagle", "model": str(tmp_path)})


# -- lossless sampling ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vocab8_eagle(tmp_path_factory):
    """An 8-token target (in effect one layer) and an EAGLE head over 6 of its tokens that copies it."""
    root = tmp_path_factory.mktemp("vocab8_eagle")
    make_tiny_vocab_model(root / "target", seed=10)
    keep_last_layer(root / "target")
    target = load_target(root / "target")
    save_speculator(copy_head(target, torch.tensor([0, 1, 2, 4, 5, 7])), target, root / "head")
    return root


def eagle_config(root):
    return {"method": "eagle", "model": str(root / "head"), "num_speculative_tokens": 2, "eagle_topk": 3,
            "num_tree_nodes": 6, "adaptive": False}


@pytest.mark.slow
@pytest.mark.parametrize("params_name", list(BOTH))
def test_sampling_from_eagle_trees_matches_the_target(vocab8_eagle, params_name, monkeypatch):
    p_value, stats = chi_square_p(vocab8_eagle, eagle_config(vocab8_eagle), BOTH[params_name], monkeypatch)
    assert stats.accepted_per_pos[1] > 0, "whole paths of the tree must be accepted too"
    assert p_value > 1e-3


@pytest.mark.slow
def test_negative_control_fails(vocab8_eagle, monkeypatch):
    monkeypatch.setattr(verify_module, "verify_trees", per_tree(correction_from_p))
    p_value, _ = chi_square_p(vocab8_eagle, eagle_config(vocab8_eagle), rejection(PARAMS["t1"]), monkeypatch)
    assert p_value < 1e-6


def test_trees_branch_and_respect_budgets(vocab8_eagle):
    llm = LLM(str(vocab8_eagle / "target"), dtype="float32", speculative_config=eagle_config(vocab8_eagle))
    seqs = [llm.make_sequence([0, 1, 2, 3][:n], SamplingParams(temperature=0, max_tokens=8)) for n in (1, 4)]
    for slot, seq in enumerate(seqs):
        seq.slot = slot
    llm.runner.ensure_capacity(2, 16, llm.spec_config.tree_size)
    llm.runner.prefill(seqs)
    llm.runner._join(seqs, [2, 1])
    trees = llm.proposer.propose(seqs, [2, 1])
    assert len(trees[0]) == 6 and max(trees[0].depths.tolist()) <= 1  # 2 levels: 6 nodes
    assert len(trees[1]) == 3 and max(trees[1].depths.tolist()) == 0  # 1 level: the 3 best children of the root
    assert len(set(trees[1].tokens.tolist())) == 3 and set(trees[1].tokens.tolist()) <= {0, 1, 2, 4, 5, 7}


def test_adaptive_trees_stay_exact(one_layer):
    """With the speculation controller choosing the depth (and so the node budget) per step from measured costs
    and per-depth acceptance."""
    config = {"method": "eagle", "model": str(one_layer / "copy"), "num_speculative_tokens": 3, "adaptive": True}
    llm = LLM(str(one_layer / "target"), dtype="float32", speculative_config=config, max_num_seqs=4)
    assert llm.controller.nodes_per_level == 4
    # Tiny models cost what they cost: measured costs (and the stopwatch) may rightly say never to draft. Costs where
    # drafting pays make the adaptive path draft, so that its exactness is what this tests.
    llm.controller.costs = synthetic_costs(cls=FrozenCosts)
    llm.controller.min_evidence = float("inf")
    plain = LLM(str(one_layer / "target"), dtype="float32", max_num_seqs=4).generate(PROMPTS, GREEDY)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert llm.total_stats.drafts > 0
    assert sum(llm.controller.global_trials) > 30, "acceptance is learned per depth from the trees' steps"


def test_the_adaptive_engine_sizes_the_tree_width_on_this_machine(one_layer, tmp_path, monkeypatch):
    """A head whose card records its accuracies gets the nodes per level that best_tree_width picks from this
    machine's timed passes; the config, the proposer and the controller agree on it; a num_tree_nodes that the
    user gives is kept."""
    import shutil

    import specdecode.engine.parts as parts

    head = tmp_path / "carded"
    shutil.copytree(one_layer / "copy", head)
    save_speculator(copy_head(load_target(one_layer / "target"), torch.arange(3, 60)), load_target(one_layer / "target"),
                    head, topk_accuracy=[[0.35, 0.45, 0.5], [0.3, 0.4, 0.45]], topk_ranks=[1, 2, 4])
    seen = {}

    def pick(passes, levels, accuracy, depth, candidates):
        seen.update(passes=passes, levels=levels, accuracy=accuracy, candidates=candidates)
        return 2, 1.5

    monkeypatch.setattr(parts, "best_tree_width", pick)
    config = {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}
    llm = LLM(str(one_layer / "target"), dtype="float32", speculative_config=config, max_num_seqs=2)
    assert seen["candidates"] == [1, 2, 4]
    assert set(seen["passes"]) == {1} | {1 + n * k for n in (1, 2, 4) for k in (1, 2, 3)}
    assert set(seen["levels"]) == {1, 2, 4} and all(t > 0 for t in seen["passes"].values())
    assert seen["accuracy"][0] == pytest.approx([0.35, 0.1, 0.025, 0.025])  # per rank, from the cumulative card
    assert llm.spec_config.num_tree_nodes == 6 and llm.proposer.config.nodes_per_level == 2
    assert llm.controller.widths == [1, 3, 5, 7]
    plain = LLM(str(one_layer / "target"), dtype="float32").generate(PROMPTS[:2], GREEDY)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == \
        [o.outputs[0].token_ids for o in plain]
    seen.clear()
    given = LLM(str(one_layer / "target"), dtype="float32", max_num_seqs=2,
                speculative_config={**config, "num_tree_nodes": 12})
    assert not seen and given.proposer.config.nodes_per_level == 4 and given.controller.widths == [1, 5, 9, 13]


def test_cli_flags_name_the_speculator(one_layer, monkeypatch):
    import argparse

    from specdecode.cli.model_flags import add_model_args, resolve_models, speculative_config
    from specdecode.catalog import registry

    parser = argparse.ArgumentParser()
    add_model_args(parser)
    head = str(one_layer / "copy")
    args = parser.parse_args(["--speculative-method", "eagle", "--speculative-model", head])
    assert speculative_config(args) == {"method": "eagle", "model": head}
    args = parser.parse_args(["--speculative-model", head, "--num-speculative-tokens", "3"])  # the kind is read
    assert speculative_config(args) == {"method": "eagle", "model": head, "num_speculative_tokens": 3}
    # A named model with shipped heads: the method alone picks them (resolving the model itself is not tested here).
    small = ["--model", registry.SMALL_MODEL]
    monkeypatch.setitem(registry.SHIPPED_SPECULATORS, registry.SMALL_MODEL, {"eagle": "smollm2/eagle"})
    monkeypatch.setattr("specdecode.cli.model_flags.resolve_model", lambda model: "target")
    monkeypatch.setattr("specdecode.cli.model_flags.prefetch", lambda model, config: None)
    _, config, _ = resolve_models(parser.parse_args([*small, "--speculative-method", "eagle"]))
    assert config == {"method": "eagle", "model": str(Path(registry.__file__).parent / "smollm2" / "eagle")}
    _, config, _ = resolve_models(parser.parse_args([*small, "--speculative-method", "medusa"]))
    assert config == {"method": "medusa"}  # none shipped: building the proposer asks for --speculative-model
    with pytest.raises(ConfigError, match="needs --speculative-model"):  # no draft shipped: said at once
        resolve_models(parser.parse_args([*small, "--speculative-method", "draft_model"]))
    monkeypatch.setitem(registry.SHIPPED_SPECULATORS, registry.SMALL_MODEL, {"draft_model": "smollm2/draft"})
    _, config, _ = resolve_models(parser.parse_args([*small, "--speculative-method", "draft_model"]))
    assert config == {"method": "draft_model", "model": str(Path(registry.__file__).parent / "smollm2" / "draft")}
