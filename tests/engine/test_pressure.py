"""A long prompt that needs most of the pool, beside streams that are decoding: what waits and what is preempted is
decided so that no stream starves (issue 56, item 5). The streams keep emitting a token at every step until they
end (an iteration that prefills a newcomer is not a step), nothing is preempted, the long prompt is answered once
they leave it room, a newcomer behind it is answered too, and every request's output is its solo output, token for
token."""
import pytest

from specdecode.sampling import SamplingParams

from tests.engine.test_paged import QUESTIONS, SPECS, assert_no_leak, engine

pytestmark = pytest.mark.usefixtures("built_kernels")

BLOCKS = 30
"""The pool's blocks (16 positions each): the long prompt takes 27 of them, 90%."""


def solo(tiny_models, spec, prompt, params) -> list[int]:
    llm = engine(tiny_models, spec, max_num_seqs=1, max_model_len=BLOCKS * 16)
    return llm.generate([prompt], params)[0].outputs[0].token_ids


@pytest.mark.parametrize("method", ["plain", "ngram"])
def test_streams_keep_flowing_beside_a_prompt_that_needs_most_of_the_pool(tiny_models, method):
    spec = SPECS[method]
    llm = engine(tiny_models, spec, max_num_seqs=4, max_model_len=BLOCKS * 16)
    llm.runner.num_blocks = BLOCKS
    llm.runner.ensure_capacity(4, BLOCKS * 16, llm.tree_size)
    scheduler = llm.make_scheduler(4)
    stream_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    streams = {f"stream{i}": QUESTIONS[i] for i in range(3)}
    long_prompt = [5] + [20 + (j * 7) % 50 for j in range(27 * 16 - 8)]  # 27 blocks with its first steps
    long_params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for request_id, prompt in streams.items():
        scheduler.add(llm.make_sequence(prompt, stream_params, request_id))
    out = scheduler.step()  # the streams' prefill
    assert set(out.deltas) == set(streams)
    scheduler.add(llm.make_sequence(long_prompt, long_params, "long"))
    scheduler.add(llm.make_sequence(QUESTIONS[3], stream_params, "newcomer"))
    ids = {request_id: [] for request_id in [*streams, "long", "newcomer"]}
    seqs = {s.request_id: s for s in [*scheduler.running, *scheduler.waiting]}
    steps = long_preempted = 0
    while scheduler.has_work:
        live = [r for r in streams if not seqs[r].finished]
        before = [s.request_id for s in [*scheduler.running, *scheduler.prefilling]]
        out = scheduler.step()
        after = [s.request_id for s in [*scheduler.running, *scheduler.prefilling]]
        if out.preempted:  # only the prompt being prefilled gives its blocks back (its full ones stay indexed)
            assert set(before) - set(after) <= {"long"}, (steps, before, after)
            long_preempted += 1
        joined_alone = out.prefilled and not out.stepped  # an iteration that prefilled newcomers (the newcomer)
        for request_id in live:  # every stream still decoding gets tokens at every other iteration
            assert request_id in out.deltas or seqs[request_id].finished or joined_alone, (steps, request_id)
        steps += 1
        assert steps < 500
    assert all(s.finished for s in seqs.values())
    assert long_preempted <= 2, long_preempted  # not admitted and thrown back again and again
    for request_id, prompt in streams.items():
        assert seqs[request_id].output_ids == solo(tiny_models, spec, prompt, stream_params), request_id
    assert seqs["long"].output_ids == solo(tiny_models, spec, long_prompt, long_params)
    assert seqs["newcomer"].output_ids == solo(tiny_models, spec, QUESTIONS[3], stream_params)
    assert_no_leak(llm)
