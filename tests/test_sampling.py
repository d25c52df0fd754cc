"""processed_probs against a brute-force reference on tiny inputs; seeded sampling through LLM.generate."""
import itertools
import math

import pytest
import torch

from specdecode.sampling import SamplingParams, params_tensors, processed_probs, sample_rows

V = 7


def reference_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """The definition, one token at a time: softmax(logits / T), keep the top k, renormalise, keep the smallest
    most-likely set whose mass reaches top_p, renormalise. Temperature 0 is a one-hot argmax."""
    n = len(logits)
    if temperature == 0:
        best = max(range(n), key=lambda i: logits[i])
        return [float(i == best) for i in range(n)]
    weights = [math.exp(x / temperature) for x in logits]
    by_likelihood = sorted(range(n), key=lambda i: -weights[i])
    kept = by_likelihood[:top_k] if top_k > 0 else by_likelihood
    total = sum(weights[i] for i in kept)
    if top_p >= 1:
        return [weights[i] / total if i in kept else 0.0 for i in range(n)]
    nucleus, mass = [], 0.0
    for i in kept:
        nucleus.append(i)
        mass += weights[i] / total
        assert abs(mass - top_p) > 1e-6, "inputs on a top_p boundary would make the reference ambiguous"
        if mass >= top_p:
            break
    z = sum(weights[i] for i in nucleus)
    return [weights[i] / z if i in nucleus else 0.0 for i in range(n)]


def run(logits: torch.Tensor, settings: list[tuple[float, int, float]]) -> torch.Tensor:
    temperature = torch.tensor([s[0] for s in settings], dtype=torch.float32)
    top_k = torch.tensor([s[1] for s in settings], dtype=torch.long)
    top_p = torch.tensor([s[2] for s in settings], dtype=torch.float32)
    return processed_probs(logits, temperature, top_k, top_p)


LOGITS = torch.randn(4, V, generator=torch.Generator().manual_seed(0)) * 2  # [rows, V], no ties
SETTINGS = list(itertools.product((0.5, 1.0, 2.0), (0, 1, 3, V), (0.35, 0.8, 1.0)))


@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS)
def test_matches_reference(temperature, top_k, top_p):
    probs = run(LOGITS, [(temperature, top_k, top_p)] * len(LOGITS))
    for row in range(len(LOGITS)):
        expected = torch.tensor(reference_probs(LOGITS[row].tolist(), temperature, top_k, top_p))
        torch.testing.assert_close(probs[row], expected, atol=1e-6, rtol=1e-5)


def test_each_row_has_its_own_settings():
    """One call, rows with different parameters (as in a batch of requests): each matches its reference."""
    settings = [(0.0, 0, 1.0), (0.7, 2, 1.0), (1.3, 0, 0.6), (1.0, 4, 0.9)]
    probs = run(LOGITS, settings)
    for row, (t, k, p) in enumerate(settings):
        torch.testing.assert_close(probs[row], torch.tensor(reference_probs(LOGITS[row].tolist(), t, k, p)),
                                   atol=1e-6, rtol=1e-5)


def test_greedy_is_one_hot_argmax_whatever_top_k_top_p():
    for k, p in ((0, 1.0), (3, 0.5), (1, 0.1)):
        probs = run(LOGITS, [(0.0, k, p)] * len(LOGITS))
        expected = torch.nn.functional.one_hot(LOGITS.argmax(-1), V).float()
        assert torch.equal(probs, expected)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1e-40, 0, 1.0), (1e-6, 0, 1.0), (1.0, 0, 1e-300),
                                                      (0.5, 3, 1e-45), (1e-40, 0, 1e-300)])
def test_tiny_temperature_and_top_p_keep_the_most_likely_token(temperature, top_k, top_p):
    """Below MIN_TEMPERATURE sampling is greedy; a top_p that rounds to 0 keeps the most likely token. Both used to
    give NaN rows, from which the inverse-CDF draw always returned the last token of the vocabulary."""
    probs = run(LOGITS, [(temperature, top_k, top_p)] * len(LOGITS))
    assert torch.equal(probs, torch.nn.functional.one_hot(LOGITS.argmax(-1), V).float())
    assert sample_rows(probs, torch.full((len(LOGITS),), 0.999)).tolist() == LOGITS.argmax(-1).tolist()


def test_huge_temperature_is_uniform_not_nan():
    probs = run(LOGITS, [(1e300, 0, 1.0)] * len(LOGITS))
    assert torch.allclose(probs, torch.full_like(probs, 1 / V))


def test_rows_are_distributions_at_vocabulary_scale():
    logits = torch.randn(16, 5000, generator=torch.Generator().manual_seed(1)) * 4
    settings = [(t, k, p) for t in (0.3, 1.0) for k in (0, 50) for p in (0.5, 0.95)] * 2
    probs = run(logits, settings)
    assert torch.allclose(probs.sum(-1), torch.ones(16), atol=1e-5)
    assert (probs >= 0).all()
    for row, (_, k, _) in enumerate(settings):
        if k:
            assert int((probs[row] > 0).sum()) <= k


def test_params_tensors_repeats_each_request():
    params = [SamplingParams(temperature=0.5, top_k=3, top_p=0.9), SamplingParams(temperature=0)]
    temperature, top_k, top_p, min_p = params_tensors(params, [2, 3])
    assert min_p is None  # no request sets min_p: processed_probs skips it
    assert temperature.tolist() == [0.5, 0.5, 0.0, 0.0, 0.0]
    assert top_k.tolist() == [3, 3, 0, 0, 0]
    assert top_p.tolist() == pytest.approx([0.9, 0.9, 1.0, 1.0, 1.0])


# -- seeded generation end to end -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_models):
    from specdecode.engine.llm import LLM

    return LLM(model=tiny_models["target"], dtype="float32", device="cpu")


def sampled(llm, seed, prompt="def add(a, b):", **kwargs):
    params = SamplingParams(temperature=1.5, max_tokens=16, seed=seed, ignore_eos=True, **kwargs)
    return llm.generate(prompt, params)[0].outputs[0].token_ids


def test_same_seed_same_tokens(llm):
    assert sampled(llm, 7) == sampled(llm, 7)
    assert sampled(llm, 7, top_k=5, top_p=0.9) == sampled(llm, 7, top_k=5, top_p=0.9)


def test_different_seeds_differ(llm):
    outputs = {tuple(sampled(llm, seed)) for seed in range(4)}
    assert len(outputs) > 1


def test_seed_is_per_request_in_a_batch(llm):
    """A request's random stream is its own: batching it with others does not change its sample."""
    params = [SamplingParams(temperature=1.5, max_tokens=16, seed=s, ignore_eos=True) for s in (7, 8)]
    batch = llm.generate(["def add(a, b):", "class Point:"], params)
    assert batch[0].outputs[0].token_ids == sampled(llm, 7)
    assert batch[1].outputs[0].token_ids == sampled(llm, 8, prompt="class Point:")


@pytest.mark.parametrize("scale, top_k, top_p", [
    (6.0, [0, 0, 40, 0, 64, 0], [0.85, 0.5, 1.0, 0.75, 0.8, 0.6]),  # peaked rows: the 64 ranked candidates decide
    (0.05, [0, 0, 40, 0, 3000, 0], [0.9, 0.5, 1.0, 0.95, 0.8, 0.999]),  # flat rows: whole rows are sorted
])
def test_ranking_only_candidates_equals_sorting_whole_rows(scale, top_k, top_p):
    """On a real-sized vocabulary top-k/top-p look at the most likely tokens first; the result must be what sorting
    every row gives."""
    from specdecode.sampling import truncate

    V, m = 4096, 64
    probs = (torch.randn(6, V, generator=torch.Generator().manual_seed(1)) * scale).softmax(-1)
    top_k, top_p = torch.tensor(top_k), torch.tensor(top_p)
    candidates_decide = ((top_k > 0) & (top_k <= m)) | (probs.topk(m).values.sum(-1) >= top_p)
    assert candidates_decide.all() == (scale > 1)
    ranked = truncate(probs, top_k, top_p, candidates=(m,))
    torch.testing.assert_close(truncate(probs, top_k, top_p, candidates=(16, m)), ranked)  # two rounds of ranking
    torch.testing.assert_close(ranked, truncate(probs, top_k, top_p, candidates=()), atol=1e-6, rtol=1e-5)
    kept = (ranked > 0).sum(-1)
    assert kept[2] == 40 and kept[4] <= top_k[4] and (kept[[0, 1, 3, 5]] < V).all()


def test_no_truncation_is_a_plain_softmax():
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(2))
    probs = run(logits, [(0.7, 0, 1.0), (1.0, 5000, 1.0), (1.3, 10**6, 1.0)])
    for row, t in enumerate((0.7, 1.0, 1.3)):
        torch.testing.assert_close(probs[row], (logits[row] / t).softmax(-1))


# -- the exponential race ----------------------------------------------------------------------------------------

def test_race_uniforms_are_the_requests_own_numbers():
    from specdecode.sampling import RACE, RequestRandom, race_uniforms

    randoms = [RequestRandom(seed) for seed in (0, 1, 2**40 + 3)]
    tokens = torch.tensor([[0, 5, 49151], [7, 7, 8], [1, 2, 3]])
    u = race_uniforms([r.key for r in randoms], [0, 17, 2**20], tokens)
    expected = [[r.uniform(pos, RACE, int(x)) for x in row] for r, pos, row in zip(randoms, [0, 17, 2**20], tokens)]
    assert u.tolist() == expected


def test_race_kernel_equals_the_torch_arithmetic(monkeypatch):
    from specdecode import kernels
    from specdecode.sampling import RequestRandom, race_tokens

    if kernels.quant() is None:
        pytest.skip("the kernels cannot be compiled here")
    gen = torch.Generator().manual_seed(0)
    probs = processed_probs(torch.randn(64, 4096, generator=gen) * 3, torch.full((64,), 0.8),
                            torch.tensor([0, 50] * 32), torch.tensor([1.0, 0.9] * 32))
    keys = [RequestRandom(i).key for i in range(64)]
    positions = list(range(64))
    compiled = race_tokens(probs, keys, positions)
    monkeypatch.setattr(kernels, "quant", lambda: None)
    assert torch.equal(compiled, race_tokens(probs, keys, positions))
    assert bool((probs[torch.arange(64), compiled] > 0).all()), "a token outside top-k/top-p won"


def test_race_winners_follow_the_distribution():
    """Winners over many seeds against p (chi-square), and a token of probability 0 never wins."""
    from scipy.stats import chisquare

    from specdecode.sampling import RequestRandom, race_tokens

    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    n = 20_000
    keys = [RequestRandom(seed).key for seed in range(n)]
    winners = race_tokens(p.expand(n, -1).contiguous(), keys, [3] * n)
    counts = torch.bincount(winners, minlength=6)
    assert counts[5] == 0
    assert chisquare(counts[:5].tolist(), (p[:5] * n).tolist()).pvalue > 1e-3
    # Another position's noise gives other winners with the same law (positions are independent races).
    elsewhere = race_tokens(p.expand(n, -1).contiguous(), keys, [4] * n)
    assert not torch.equal(winners, elsewhere)
    assert chisquare(torch.bincount(elsewhere, minlength=6)[:5].tolist(), (p[:5] * n).tolist()).pvalue > 1e-3
