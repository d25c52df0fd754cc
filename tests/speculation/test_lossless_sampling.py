"""Sampling is lossless end to end: speculative samples of the first three tokens follow the target's exact
distribution.

A target and a draft over an 8-token vocabulary; the exact joint distribution of the first three generated
tokens is enumerated from the target alone (with temperature / top-p applied); 20,000 speculative samples
(fixed seeds, one batch) must pass a chi-square goodness-of-fit test, with either sampler (the race verified by
identity, rejection sampling), and a deliberately wrong verifier of each must fail it. With one draft token per step the three tokens span a bonus token or a second speculative step; one test mixes
every kind of row in each step. (tests/speculation/test_verify_exact.py checks the verifiers exactly, without a model.)
"""
import dataclasses
import itertools
import json

import pytest
import torch
from scipy.stats import chisquare
from tokenizers import Tokenizer, models

import specdecode.speculation.verify as verify_module
from specdecode.engine.llm import LLM
from specdecode.model.config import ModelConfig
from specdecode.model.llama import LlamaForCausalLM
from specdecode.model.loading import save_model
from specdecode.sampling import SamplingParams, processed_probs, race_uniforms, sample_rows
from specdecode.speculation.proposers.base import NO_FEATURES
from specdecode.speculation.tree import DraftTree, tree_shape
from specdecode.speculation.verify import verify_chains

VOCAB = 8
SAMPLES = 20_000
PROMPT = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]  # repeats, so that prompt lookup finds matches


def make_tiny_vocab_model(folder, seed, base=None, noise=0.0):
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5 if p.dim() > 1 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)
        if base is not None:
            for p, q in zip(model.parameters(), base.parameters()):
                p.copy_(q + noise * torch.randn_like(q))
    save_model(model, folder, dtype=torch.float32)
    tok = Tokenizer(models.WordLevel({chr(ord("a") + i): i for i in range(VOCAB)}, unk_token="a"))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({}))
    return model


@pytest.fixture(scope="module")
def vocab8(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab8")
    target = make_tiny_vocab_model(root / "target", seed=10)
    make_tiny_vocab_model(root / "draft", seed=11, base=target, noise=0.06)
    return root


def exact_distribution(model_dir, params: SamplingParams) -> dict[tuple[int, ...], float]:
    llm = LLM(str(model_dir), dtype="float32")
    t, k, p = (torch.tensor([params.temperature]), torch.tensor([params.top_k]), torch.tensor([params.top_p]))

    def probs_after(prefixes):
        ids = torch.tensor([PROMPT + list(x) for x in prefixes])
        with torch.no_grad():
            logits = llm.target(ids).logits[:, -1]
        n = len(prefixes)
        return processed_probs(logits, t.expand(n), k.expand(n), p.expand(n))

    first = probs_after([()])[0]
    second = probs_after([(a,) for a in range(VOCAB)])
    pairs = list(itertools.product(range(VOCAB), repeat=2))
    third = probs_after(pairs)
    dist = {}
    for (a, b), row in zip(pairs, third):
        for c in range(VOCAB):
            dist[(a, b, c)] = float(first[a] * second[a][b] * row[c])
    return dist


def speculative_samples(model_dir, spec_config, params: SamplingParams, proposer=None, greedy_every: int = 0,
                        sampler=None) -> tuple[list[tuple[int, ...]], LLM, list]:
    """The first three generated tokens of SAMPLES seeded requests decoded as one batch. Every greedy_every-th
    request is greedy (left out of the samples, returned as the third value). sampler: a function of the request
    index giving its SamplingParams.sampler (default: params.sampler for all)."""
    spec_config = {"adaptive": False, **spec_config}  # fixed K: every request drafts (and no start-up timing)
    llm = LLM(str(model_dir), dtype="float32", speculative_config=spec_config, max_num_seqs=SAMPLES)
    if proposer is not None:
        llm.proposer = llm.runner.proposer = proposer
    k = spec_config["num_speculative_tokens"]
    greedy = [greedy_every and i % greedy_every == greedy_every - 1 for i in range(SAMPLES)]
    per_request = [SamplingParams(temperature=0.0 if g else params.temperature, top_p=params.top_p,
                                  top_k=params.top_k, max_tokens=k + 3, seed=i, ignore_eos=True,
                                  sampler=sampler(i) if sampler else params.sampler)
                   for i, g in zip(range(SAMPLES), greedy)]
    outputs = llm.generate([PROMPT] * SAMPLES, per_request)
    stats = llm.total_stats
    assert stats.accepted_tokens > 0.1 * SAMPLES, "the drafts must be accepted often enough to matter"
    assert stats.draft_tokens > stats.accepted_tokens, "and rejected sometimes"
    samples = [tuple(o.outputs[0].token_ids[:3]) for o, g in zip(outputs, greedy) if not g]
    return samples, llm, [o.outputs[0].token_ids for o, g in zip(outputs, greedy) if g]


def goodness_of_fit(dist, samples) -> float:
    counts = {key: 0 for key in dist}
    for s in samples:
        counts[s] += 1
    impossible = [key for key in dist if dist[key] == 0.0 and counts[key] > 0]
    assert not impossible, f"sampled sequences the target gives probability 0: {impossible[:5]}"
    n = len(samples)
    # Cells with small expected counts are pooled so that the chi-square approximation holds.
    big = [key for key in dist if dist[key] * n >= 5]
    small = [key for key in dist if 0 < dist[key] * n < 5]
    observed = [counts[key] for key in big]
    expected = [dist[key] * n for key in big]
    if small:
        observed.append(sum(counts[key] for key in small))
        expected.append(sum(dist[key] for key in small) * n)
    total = sum(expected)
    expected = [e * n / total for e in expected]
    return chisquare(observed, expected).pvalue


def draft(root, k, drafts=1):
    return {"method": "draft_model", "model": str(root / "draft"), "num_speculative_tokens": k, "num_drafts": drafts}


PARAMS = {"t1": SamplingParams(temperature=1.0), "t0.7_top_p0.9": SamplingParams(temperature=0.7, top_p=0.9)}
"""Sampled settings (the default sampler, "auto": the race, since every request here is seeded)."""


def rejection(params: SamplingParams) -> SamplingParams:
    """The same settings, drawn by inverse CDF and verified by rejection sampling."""
    return dataclasses.replace(params, sampler="rejection")


def race(params: SamplingParams) -> SamplingParams:
    """The same settings, drawn by the exponential race and verified by identity."""
    return dataclasses.replace(params, sampler="race")


SAMPLERS = {"race": race, "rejection": rejection}
BOTH = {"t1_race": race(PARAMS["t1"]), "t0.7_top_p0.9_rejection": rejection(PARAMS["t0.7_top_p0.9"])}
"""One setting per sampler, for the methods' own end-to-end tests."""
CASES = {  # name: (speculative_config, sampling parameters, sampler)
    # One draft token per step: the first three tokens are the prefill token, then either the draft and its bonus
    # token, or a correction and the first token of a second speculative step.
    # (Longer chains: test_verify_exact.py exactly, and the mixed test below end to end.)
    "chain_K1_top_p": (lambda root: draft(root, 1), "t0.7_top_p0.9", "rejection"),
    "chain_K1_top_p_race": (lambda root: draft(root, 1), "t0.7_top_p0.9", "race"),
    "one_level_tree": (lambda root: draft(root, 1, drafts=3), "t0.7_top_p0.9", "rejection"),
    "tree_K2x3": (lambda root: draft(root, 2, drafts=3), "t1", "rejection"),
    "tree_K2x3_race": (lambda root: draft(root, 2, drafts=3), "t1", "race"),
    "ngram_one_hot": (lambda root: {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_max": 2}, "t1",
                      "rejection"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_matches_target_distribution(vocab8, case):
    config, params_name, sampler = CASES[case]
    params = SAMPLERS[sampler](PARAMS[params_name])
    config = config(vocab8)
    samples, llm, _ = speculative_samples(vocab8 / "target", config, params)
    if config["num_speculative_tokens"] == 1:
        stats = llm.total_stats
        assert stats.accepted_per_pos[0] > 0.1 * SAMPLES, "bonus tokens (after an accepted draft) must be common"
        assert stats.steps - SAMPLES > 0.1 * SAMPLES, "and so must second speculative steps"
    assert goodness_of_fit(exact_distribution(vocab8 / "target", params), samples) > 1e-3


class MixedProposer:
    """Every kind of draft in one batch, by request index: chains of one and three tokens drawn from q, a tree that
    branches below the root drawn from q (siblings independently), a one-hot tree, and no draft at all."""

    feature_request = NO_FEATURES
    draft_network = None
    SHAPES = [(-1,), (-1, 0, 1), (-1, 0, 0, 1), (-1, -1, 0), ()]

    def ensure_cache(self, slots, max_len, pool_positions=None):
        pass

    def cache_shortfall(self, seqs, budgets):
        return 0

    def __init__(self):
        self.gen = torch.Generator().manual_seed(0)
        self.q = torch.softmax(torch.randn(4, VOCAB, generator=self.gen) * 1.5, -1)  # [depth, V]

    def propose(self, seqs, budgets):
        trees = []
        for seq, budget in zip(seqs, budgets):
            kind = int(seq.request_id) % len(self.SHAPES)
            parents = self.SHAPES[kind]
            if len(tree_shape(parents).paths) and max(tree_shape(parents).depths.tolist()) >= budget:
                parents = tuple(range(-1, budget - 1))  # the budget is shallower than the tree: a chain
            depths = tree_shape(parents).depths.tolist()
            if kind == 3:  # one-hot: the i-th sibling is q's i-th most likely token at its depth
                children = tree_shape(parents).children
                tokens = [int(self.q[d].argsort(descending=True)[children[p + 1].index(i)])
                          for i, (p, d) in enumerate(zip(parents, depths))]
                trees.append(DraftTree(torch.tensor(tokens, dtype=torch.long), parents))
                continue
            q = self.q[depths] if depths else torch.zeros(0, VOCAB)  # [n, V]
            tokens = torch.multinomial(q, 1, generator=self.gen)[:, 0] if depths else torch.zeros(0, dtype=torch.long)
            trees.append(DraftTree(tokens, parents, q))
        return trees

    def add(self, seqs):
        pass

    def remove(self, seq):
        pass

    def observe(self, seqs, trees, results):
        pass


@pytest.mark.slow
def test_one_step_mixes_greedy_and_sampled_rows_chains_trees_and_lengths(vocab8):
    """Each step verifies greedy and sampled rows, chains (through the batched chain verifier) and trees (node by
    node), of different lengths, together; every sampled row must still follow the target."""
    params = PARAMS["t1"]
    config = {"method": "ngram", "num_speculative_tokens": 4}
    samples, llm, greedy = speculative_samples(vocab8 / "target", config, params, MixedProposer(), greedy_every=10,
                                               sampler=lambda i: ("race", "rejection")[i % 2])
    plain = LLM(str(vocab8 / "target"), dtype="float32").generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0].outputs[0].token_ids
    assert greedy and all(g == plain for g in greedy)
    assert goodness_of_fit(exact_distribution(vocab8 / "target", params), samples) > 1e-3


def wrong_verify_chains_without_residual(p, q, tokens, lengths, u_accept, u_draw):
    """Accepts like the real rule but, after a rejection, samples from p instead of norm(max(0, p - q))."""
    n_matches, _ = verify_chains(p, q, tokens, lengths, u_accept, u_draw)
    rows = torch.arange(p.shape[0])
    return n_matches, sample_rows(p[rows, n_matches], u_draw[rows, n_matches])


@pytest.mark.slow
def test_negative_control_wrong_verifier_is_detected(vocab8, monkeypatch):
    monkeypatch.setattr(verify_module, "verify_chains", wrong_verify_chains_without_residual)
    params = rejection(PARAMS["t1"])
    samples, _, _ = speculative_samples(vocab8 / "target", draft(vocab8, 1), params)
    assert goodness_of_fit(exact_distribution(vocab8 / "target", params), samples) < 1e-6


def wrong_race_with_uniform_clocks(probs, keys, positions):
    """The race, but each token's clock is the uniform itself instead of an exponential."""
    u = race_uniforms(keys, positions, torch.arange(probs.shape[1]).expand(probs.shape))
    return (probs.double() / u).masked_fill(~(probs > 0), -1.0).argmax(-1)


@pytest.mark.slow
def test_negative_control_wrong_race_is_detected(vocab8, monkeypatch):
    monkeypatch.setattr(verify_module, "race_tokens", wrong_race_with_uniform_clocks)
    params = PARAMS["t1"]
    samples, _, _ = speculative_samples(vocab8 / "target", draft(vocab8, 1), params)
    assert goodness_of_fit(exact_distribution(vocab8 / "target", params), samples) < 1e-6
