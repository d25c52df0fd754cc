"""Sampling is lossless: speculative samples of the first three tokens follow the target's exact distribution.

A target and a draft over an 8-token vocabulary; the exact joint distribution of the first three generated
tokens is enumerated from the target alone (with temperature / top-p applied); 20,000 speculative samples
(fixed seeds) must pass a chi-square goodness-of-fit test, and a deliberately wrong verifier must fail it.
"""
import itertools
import json

import pytest
import torch
from scipy.stats import chisquare
from tokenizers import Tokenizer, models

import specdecode.engine.step as step_module
from specdecode.engine.llm import LLM
from specdecode.model.config import ModelConfig
from specdecode.model.llama import LlamaForCausalLM
from specdecode.model.loading import save_model
from specdecode.sampling import SamplingParams, processed_probs, sample_rows
from specdecode.spec.verify import verify_chains

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


def speculative_samples(model_dir, spec_config, params: SamplingParams) -> list[tuple[int, ...]]:
    llm = LLM(str(model_dir), dtype="float32", speculative_config=spec_config, max_num_seqs=SAMPLES)
    k = spec_config["num_speculative_tokens"]
    per_request = [SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                  max_tokens=k + 3, seed=i, ignore_eos=True) for i in range(SAMPLES)]
    outputs = llm.generate([PROMPT] * SAMPLES, per_request)
    assert llm.total_stats.accepted_tokens > 0.1 * SAMPLES, "the drafts must be accepted often enough to matter"
    assert llm.total_stats.draft_tokens > llm.total_stats.accepted_tokens, "and rejected sometimes"
    return [tuple(o.outputs[0].token_ids[:3]) for o in outputs]


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


CONFIGS = {
    "chain": lambda root: {"method": "draft_model", "model": str(root / "draft"), "num_speculative_tokens": 3},
    "multi_draft_tree": lambda root: {"method": "draft_model", "model": str(root / "draft"),
                                      "num_speculative_tokens": 2, "num_drafts": 3},
    "ngram_one_hot": lambda root: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
}
PARAMS = {"t1": SamplingParams(temperature=1.0), "t0.7_top_p0.9": SamplingParams(temperature=0.7, top_p=0.9)}


@pytest.mark.parametrize("params_name", list(PARAMS))
@pytest.mark.parametrize("method", list(CONFIGS))
def test_speculative_sampling_matches_target_distribution(vocab8, method, params_name):
    params = PARAMS[params_name]
    dist = exact_distribution(vocab8 / "target", params)
    samples = speculative_samples(vocab8 / "target", CONFIGS[method](vocab8), params)
    assert goodness_of_fit(dist, samples) > 1e-3


def wrong_verify_chains_without_residual(p, q, tokens, lengths, u_accept, u_next):
    """Accepts like the real rule but, after a rejection, samples from p instead of norm(max(0, p - q))."""
    n_matches, _ = verify_chains(p, q, tokens, lengths, u_accept, u_next)
    return n_matches, sample_rows(p[torch.arange(p.shape[0]), n_matches], u_next)


def test_negative_control_wrong_verifier_is_detected(vocab8, monkeypatch):
    monkeypatch.setattr(step_module, "verify_chains", wrong_verify_chains_without_residual)
    params = PARAMS["t1"]
    dist = exact_distribution(vocab8 / "target", params)
    samples = speculative_samples(vocab8 / "target", CONFIGS["chain"](vocab8), params)
    assert goodness_of_fit(dist, samples) < 1e-6
