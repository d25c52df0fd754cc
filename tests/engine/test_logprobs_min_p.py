"""logprobs and min_p under speculation: the logprobs are the target's own (those of the whole sequence run at
once), equal with and without speculation; min_p filters the distribution plain sampling and the verifier use."""
import pytest
import torch

from specdecode.engine.llm import LLM
from specdecode.errors import ConfigError
from specdecode.model.loading import load_model
from specdecode.sampling import SamplingParams, params_tensors, processed_probs

PROMPTS = ["def add(a, b):\n    return", "class Point:\n    def __init__(self"]


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
                                  {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False}])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_the_targets(tiny_models, spec, temperature):
    if spec and spec["method"] == "draft_model":
        spec = {**spec, "model": str(tiny_models["draft"])}
    llm = LLM(str(tiny_models["target"]), dtype="float32", speculative_config=spec, max_num_seqs=2)
    params = SamplingParams(temperature=temperature, max_tokens=12, seed=3, ignore_eos=True, logprobs=3)
    target = load_model(tiny_models["target"], dtype="float32", device="cpu")
    for out in llm.generate(PROMPTS, params):
        done = out.outputs[0]
        assert len(done.logprobs) == len(done.token_ids) == 12
        ids = torch.tensor([out.prompt_token_ids + done.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(target(ids).logits[0].float(), -1)  # teacher-forced: the target alone
        n = len(out.prompt_token_ids)
        for i, (token, lp) in enumerate(zip(done.token_ids, done.logprobs)):
            row = logp[n - 1 + i]
            assert lp.token == token
            assert lp.logprob == pytest.approx(float(row[token]), abs=1e-4)
            assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
        if temperature == 0:  # greedy: the chosen token is the most likely one
            assert all(lp.top[0][0] == lp.token for lp in done.logprobs)


def test_logprobs_off_and_validation(tiny_models):
    llm = LLM(str(tiny_models["target"]), dtype="float32", max_num_seqs=1)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.outputs[0].logprobs is None
    assert llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logprobs=0))[0].outputs[0].logprobs[0].top == []
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(ConfigError, match="logprobs"):
            SamplingParams(logprobs=bad)
    for bad in (-0.1, 1.5, "0.1"):
        with pytest.raises(ConfigError, match="min_p"):
            SamplingParams(min_p=bad)


def test_min_p_keeps_tokens_near_the_most_likely():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04], [0.5, 0.3, 0.1, 0.06, 0.04]]))
    params = [SamplingParams(min_p=0.25), SamplingParams()]
    probs = processed_probs(logits, *params_tensors(params))
    assert probs[0].tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0, 0, 0])  # 0.1 < 0.25 * 0.5
    assert probs[1].tolist() == pytest.approx([0.5, 0.3, 0.1, 0.06, 0.04])
    # before top-p: top_p 0.7 of the min_p-filtered [0.625, 0.375] keeps both (0.625 < 0.7)
    both = processed_probs(logits[:1], *params_tensors([SamplingParams(min_p=0.25, top_p=0.7)]))
    assert both[0].tolist() == pytest.approx([0.625, 0.375, 0, 0, 0])


@pytest.mark.parametrize("sampler", ["race", "rejection"])
def test_min_p_under_speculation_draws_only_kept_tokens(tiny_models, sampler):
    """Every token a speculative run emits has probability >= min_p x the most likely one's at its position."""
    llm = LLM(str(tiny_models["target"]), dtype="float32", max_num_seqs=4,
              speculative_config={"method": "draft_model", "model": str(tiny_models["draft"]),
                                  "num_speculative_tokens": 3, "adaptive": False})
    params = SamplingParams(temperature=1.5, min_p=0.3, max_tokens=24, seed=5, ignore_eos=True, logprobs=1,
                            sampler=sampler)
    outs = llm.generate(PROMPTS * 2, params)
    for out in outs:
        for lp in out.outputs[0].logprobs:
            # at temperature T, p_x / p_max = exp((l_x - l_max) / T)
            ratio = torch.exp(torch.tensor((lp.logprob - lp.top[0][1]) / 1.5))
            assert float(ratio) >= 0.3 - 1e-5
    assert llm.total_stats.accepted_tokens > 0
