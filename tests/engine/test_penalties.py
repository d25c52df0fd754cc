"""Penalties and logit_bias under speculation: plain decoding applies them as a step-by-step reference loop does,
and every speculative method gives the same greedy text (each tree node penalised from its own path)."""
import pytest
import torch

from specdecode.engine.llm import LLM
from specdecode.errors import ConfigError
from specdecode.model.loading import load_model
from specdecode.sampling import SamplingParams, penalize

PROMPTS = ["def add(a, b):\n    return", "class Point:\n    def __init__(self"]
PENALTIES = [{"presence_penalty": 1.5}, {"frequency_penalty": 0.8}, {"repetition_penalty": 1.8},
             {"logit_bias": {5: 4.0, 7: -100.0}},
             {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3, "logit_bias": {9: 3.0}}]


def reference_loop(target, prompt_ids, params, n):
    """Greedy decoding one token at a time on the whole sequence, penalties from the output so far."""
    ids = list(prompt_ids)
    for _ in range(n):
        with torch.no_grad():
            logits = target(torch.tensor([ids])).logits[0, -1:].float()
        ids.append(int(penalize(logits, params, prompt_ids, ids[len(prompt_ids):], [[]]).argmax()))
    return ids[len(prompt_ids):]


@pytest.mark.parametrize("penalties", PENALTIES, ids=lambda p: "+".join(p))
def test_greedy_penalties_identical_under_speculation(tiny_models, penalties):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **penalties)
    plain = LLM(str(tiny_models["target"]), dtype="float32", max_num_seqs=2)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    target = load_model(tiny_models["target"], dtype="float32", device="cpu")
    ids = plain.tokenizer.encode(PROMPTS[0])
    assert want[0] == reference_loop(target, ids, params, 16)
    unpenalized = plain.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert unpenalized[0].outputs[0].token_ids != want[0], "the penalty must change the text, or this tests nothing"
    for spec in ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
                 {"model": str(tiny_models["draft"]), "num_speculative_tokens": 4, "num_drafts": 2}):
        llm = LLM(str(tiny_models["target"]), dtype="float32", max_num_seqs=2,
                  speculative_config={**spec, "adaptive": False})
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        assert got == want, spec
        if "model" in spec:  # (penalties against repeats leave prompt lookup little to accept)
            assert llm.total_stats.accepted_tokens > 0


def test_penalty_validation():
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
                {"logit_bias": {"5": 1.0}}, {"logit_bias": {5: 101}}, {"logit_bias": {-1: 1}}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert SamplingParams(logit_bias={}).penalized is False
    assert SamplingParams(repetition_penalty=1.1).penalized
