"""`bench --speed`'s step breakdown: the parts of a speculative step, measured on the engine's own calls and the
kernels' clock, add up to the steps' time; the layers' parts are the kernels' and are there; nothing outside a step
(the prefill) is counted; the engine is left as it was."""
import pytest

from specdecode.bench.breakdown import PARTS, StepBreakdown, breakdown_lines
from specdecode.engine.llm import LLM
from specdecode.model.quant import kernels
from specdecode.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("built_kernels")

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):"


def test_the_parts_of_a_step_add_up_and_the_engine_is_put_back(tiny_models):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    llm = LLM(tiny_models["target"], dtype="float32", quantization="q4_1", speculative_config=spec, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    steps_before = llm.total_stats.steps
    with StepBreakdown(llm) as measured:
        got = llm.generate([PROMPT, PROMPT[4:]], params)
    assert got[0].outputs[0].token_ids == want  # measuring changes no answer
    steps = llm.total_stats.steps - steps_before
    assert measured.steps >= 23 // 5 and measured.steps <= 2 * 24  # every step counted, each once (2 rows a step)
    seconds = measured.seconds
    assert list(seconds) == list(PARTS)
    assert seconds["linear products"] > 0 and seconds["attention"] > 0 and seconds["LM head"] > 0
    assert all(s > -1e-3 for s in seconds.values()), seconds
    shares = measured.shares()
    assert abs(sum(row["share"] for row in shares.values()) - 1.0) < 1e-6
    assert len(breakdown_lines("ngram K=4", shares)) == len(PARTS)
    # put back: the engine's own methods again, and the kernels' clock off
    assert "forward" not in llm.target.__dict__ and "step" not in llm.runner.__dict__
    assert "make_scheduler" not in llm.__dict__ and "forward" not in llm.target.lm_head.__dict__
    kernels().kernel_timing(False)
    before = kernels().kernel_times()
    llm.generate([PROMPT], params)
    assert kernels().kernel_times() == before and steps > 0
