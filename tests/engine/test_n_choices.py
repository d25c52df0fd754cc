"""n > 1: the choices of one request share its prefill (one prompt run, copied into the other slots) and are each
what a request with that choice's seed alone would give."""
import pytest

from specdecode.engine.llm import LLM
from specdecode.errors import ConfigError
from specdecode.sampling import SamplingParams, choice_seed


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}])
def test_choices_share_the_prefill_and_equal_single_requests(tiny_models, spec):
    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):"
    llm = LLM(str(tiny_models["target"]), dtype="float32", max_num_seqs=4, speculative_config=spec,
              enable_prefix_caching=False)
    calls = []
    real = llm.target.forward

    def counting(ids, *args, **kwargs):
        calls.append(ids.shape)
        return real(ids, *args, **kwargs)
    llm.target.forward = counting
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=7, n=3, ignore_eos=True)
    out = llm.generate(prompt, params)[0]
    n_prompt = len(out.prompt_token_ids)
    prefill_rows = [shape[0] for shape in calls if shape[1] == n_prompt]
    assert prefill_rows == [1], calls  # one prompt run for three choices
    assert [c.index for c in out.outputs] == [0, 1, 2]
    texts = [c.token_ids for c in out.outputs]
    assert len(set(map(tuple, texts))) == 3  # different seeds, different samples
    single = LLM(str(tiny_models["target"]), dtype="float32", max_num_seqs=1, speculative_config=spec)
    for i, choice in enumerate(out.outputs):
        alone = single.generate(prompt, SamplingParams(temperature=1.0, max_tokens=10, seed=choice_seed(7, i),
                                                       ignore_eos=True))[0].outputs[0]
        assert alone.token_ids == choice.token_ids
    assert choice_seed(7, 0) == 7 and choice_seed(None, 2) is None


def test_n_validation(tiny_models):
    for bad in (0, 17, 1.5, True):
        with pytest.raises(ConfigError, match="n must be"):
            SamplingParams(n=bad)
    llm = LLM(str(tiny_models["target"]), dtype="float32", max_num_seqs=1)
    with pytest.raises(ConfigError, match="n > 1"):
        list(llm.stream("x", SamplingParams(n=2)))
