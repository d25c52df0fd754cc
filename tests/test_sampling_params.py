"""SamplingParams validates at construction, with a message naming the field and the allowed values."""
import pytest

from specdecode.errors import ConfigError
from specdecode.sampling import SamplingParams


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, r"max_tokens must be a positive integer, got 0"),
    ({"max_tokens": -5}, r"max_tokens must be a positive integer, got -5"),
    ({"max_tokens": 2.5}, r"max_tokens must be a positive integer"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0\.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1\.5"),
    ({"top_p": -0.1}, r"top_p must be in \(0, 1\]"),
    ({"temperature": -0.5}, r"temperature must be >= 0 \(0 = greedy\), got -0\.5"),
    ({"temperature": "hot"}, r"temperature must be >= 0"),
    ({"top_k": -2}, r"top_k must be a non-negative integer up to 2147483647 \(0 or -1 = off\), got -2"),
    ({"top_k": 2**63}, r"top_k must be a non-negative integer up to 2147483647"),  # overflowed in the engine
    ({"stop": ["ok", ""]}, r"stop must be a non-empty string"),
    ({"seed": "7"}, r"seed must be an integer"),
])
def test_invalid_params(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0}, {"temperature": 0.7, "top_p": 1.0}, {"top_p": 0.01}, {"top_k": -1}, {"top_k": 0},
    {"max_tokens": 1}, {"seed": 0},
])
def test_valid_edges(kwargs):
    SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    params = SamplingParams(stop="\n\n")
    assert params.stop == ["\n\n"]
    assert SamplingParams().stop == []
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    assert SamplingParams(temperature=1e-40).greedy  # below MIN_TEMPERATURE: argmax, not NaN
    assert not SamplingParams(temperature=1e-4).greedy
