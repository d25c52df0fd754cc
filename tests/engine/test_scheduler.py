"""The scheduler over a paged pool at its edges: a preempted request's whole output (text, logprobs, finish reason,
streamed deltas) is an unpreempted run's; admission counts exactly the blocks a request's prefill and first step
take; a request alone is admitted and prefilled in a pool of one sequence of max_model_len; a sequence retried alone
after its batch failed preempts the others instead of being dropped; a failed prefill (a copy of a shared prompt
among them) gives back every block it took. The pool's counts are checked after each."""
import dataclasses

import pytest

from specdecode.engine import scheduler as scheduler_module
from specdecode.engine.llm import LLM
from specdecode.model.blocks import CacheFull
from specdecode.sampling import SamplingParams

from tests.engine.test_paged import QUESTIONS, SPECS, SYSTEM, assert_no_leak, engine


pytestmark = pytest.mark.usefixtures("built_kernels")


@dataclasses.dataclass
class Run:
    """What users of one request see: the streamed deltas and the final output."""

    deltas: list[str]
    text: str
    token_ids: list[int]
    logprobs: list | None
    finish_reason: str | None


def drive(llm: LLM, prompts, params, isolate_failures: bool = False, on_step=None):
    """Every request through one scheduler, step by step; returns ({request_id: Run}, the scheduler, what failed)."""
    llm.runner.ensure_capacity(llm.max_num_seqs, llm.max_model_len, llm.tree_size)
    scheduler = llm.make_scheduler(llm.max_num_seqs, isolate_failures)
    seqs = [llm.make_sequence(p, sp, str(i)) for i, (p, sp) in enumerate(zip(prompts, params))]
    for seq in seqs:
        scheduler.add(seq)
    deltas = {seq.request_id: [] for seq in seqs}
    failed = []
    steps = 0
    while scheduler.has_work:
        out = scheduler.step()
        failed += out.failed
        for request_id, delta in out.deltas.items():
            deltas[request_id].append(delta)
        if on_step is not None:
            on_step(scheduler, out)
        assert scheduler.slot_problem() is None and llm.runner.cache.leak() is None
        steps += 1
        assert steps < 3000
    runs = {s.request_id: Run(deltas[s.request_id], s.text, s.output_ids, s.logprobs, s.finish_reason) for s in seqs}
    return runs, scheduler, failed


@pytest.mark.parametrize("method", ["plain", "ngram"])
def test_a_preempted_request_streams_and_ends_as_an_unpreempted_one(tiny_models, method):
    """Recomputed after preemption, a request goes on from its prompt *and* what it generated: the same tokens, but
    also the same text (once), logprobs (one per token), finish reason and streamed deltas as without preemption."""
    spec = SPECS[method]
    prompts = [SYSTEM[:40 * (i + 1)] + q for i, q in enumerate(QUESTIONS)]
    params = [SamplingParams(temperature=0, max_tokens=30, logprobs=2),
              SamplingParams(temperature=1.0, seed=11, max_tokens=30, logprobs=2)] * 4
    first, _, _ = drive(engine(tiny_models, spec, max_num_seqs=8, block_size=None), prompts, params)
    # stop strings from the middle of half the answers: some requests end on "stop", with their text cut
    stops = [[first[str(i)].text[8:10]] if i % 2 == 0 and len(first[str(i)].text) > 12 else [] for i in range(8)]
    params = [dataclasses.replace(sp, stop=stop) for sp, stop in zip(params, stops)]
    reference, _, _ = drive(engine(tiny_models, spec, max_num_seqs=8, block_size=None), prompts, params)
    small = engine(tiny_models, spec, max_num_seqs=8, block_size=8)
    small.runner.num_blocks = 40  # the longest request and a little more: the rest wait or are preempted
    got, _, _ = drive(small, prompts, params)
    assert small.runner.slots.stats.preemptions > 0
    assert {r.finish_reason for r in reference.values()} == {"stop", "length"}
    for request_id, want in reference.items():
        run = got[request_id]
        assert run.token_ids == want.token_ids, request_id
        assert run.text == want.text and "".join(run.deltas) == want.text == "".join(want.deltas), request_id
        assert run.finish_reason == want.finish_reason, request_id
        assert len(run.logprobs) == len(run.token_ids) and run.logprobs == want.logprobs, request_id
    assert_no_leak(small)


@pytest.mark.parametrize("method", ["plain", "draft_model"])
def test_admission_counts_exactly_the_blocks_of_the_prefill_and_the_first_step(tiny_models, method):
    """A pool of exactly the blocks three requests' prefills and first steps take admits those three at once and a
    fourth only when one leaves: no preemption, and after the first step the pool holds exactly what was counted
    (a draft model drafts its whole chain, as large as the tree's room)."""
    spec = None if method == "plain" else {"model": str(tiny_models["draft"]), "num_speculative_tokens": 3,
                                           "adaptive": False}
    llm = LLM(tiny_models["target"], dtype="float32", quantization="q4_1", max_model_len=64, max_num_seqs=4,
              speculative_config=spec, enable_prefix_caching=False)
    room, bs = llm.tree_size, llm.runner.block_size
    # a prompt that ends where its prefill fills 3 blocks and the first step's [P, P + 1 + room) takes a 4th
    P = 3 * bs - room
    prompts = [[5 + i] + [20 + j % 7 for j in range(P - 1)] for i in range(4)]
    per_request = -(-(P + room + 1) // bs)
    assert per_request == 4 and -(-P // bs) == 3
    llm.runner.num_blocks = 3 * per_request
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 4
    seen = []

    def check(scheduler, out):
        seen.append((len(out.prefilled), len(out.stepped), llm.runner.cache.pool.used))

    runs, scheduler, _ = drive(llm, prompts, params, on_step=check)
    assert seen[0] == (3, 0, 3 * 3)  # three admitted, their prompts in 3 blocks each; the fourth waits
    assert seen[1] == (0, 3, 3 * per_request)  # the first step took exactly what was counted
    assert llm.runner.slots.stats.preemptions == 0
    reference = LLM(tiny_models["target"], dtype="float32", quantization="q4_1", max_model_len=64, block_size=None)
    assert [runs[str(i)].token_ids for i in range(4)] == [
        o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    assert_no_leak(llm)


def test_a_request_alone_in_the_smallest_pool_is_admitted_and_prefilled_in_chunks(tiny_models, monkeypatch):
    """The smallest pool the plan allows (one sequence of max_model_len): a prompt of max_model_len - 2 tokens is
    admitted although its prompt and a whole tree would not fit (its steps never draft past max_model_len), and
    prefilled in chunks alone - its last chunk with the tree's room missing from the pool - without a CacheFull."""
    monkeypatch.setattr(scheduler_module, "MAX_PREFILL_TOKENS", 64)  # a long prompt: chunks of 64
    llm = engine(tiny_models, SPECS["ngram"], max_model_len=256, num_kv_blocks=16, max_num_seqs=2)
    tight = []
    chunk_fits = llm.runner.chunk_fits

    def noting(seq, tokens):
        fits = chunk_fits(seq, tokens)
        if not fits:
            tight.append(seq.request_id)
        return fits

    monkeypatch.setattr(llm.runner, "chunk_fits", noting)
    prompts = [list(range(5, 5 + 254)), "def add(a, b):"]
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * 2
    runs, scheduler, failed = drive(llm, prompts, params)
    assert not failed and tight == ["0"], tight  # the path was taken: its last chunk and a tree do not fit
    assert llm.runner.slots.stats.chunks >= 3
    assert [len(runs[i].token_ids) for i in "01"] == [2, 4]  # the long one stops at max_model_len
    reference = engine(tiny_models, None, max_model_len=256, block_size=None)
    assert [runs[str(i)].token_ids for i in range(2)] == [
        o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    assert_no_leak(llm)


def test_a_sequence_retried_alone_preempts_the_others_rather_than_being_dropped(tiny_models, monkeypatch):
    """A step fails before changing anything (here: the pool turned out short, as a shortfall estimate that was too
    low would leave it) and each of its sequences is retried alone. A pool too short for one more block must then
    preempt the sequences waiting beside it, not blame the one retried and drop it."""
    llm = engine(tiny_models, None, max_num_seqs=4, max_model_len=64)
    llm.runner.num_blocks = 8
    prompts = [[5 + i] + [20, 21, 22, 23] * 7 for i in range(4)]  # 29 tokens: two blocks each, full at step 3
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 4
    shortfall = llm.runner.shortfall
    underestimated = []

    def too_low(seqs, budgets):  # once, when every row needs a block the pool does not have: the batch raises
        if not underestimated and len(seqs) == 4 and llm.runner.cache.pool.available == 0 \
                and shortfall(seqs, budgets) >= 4:
            underestimated.append(len(seqs))
            return 0
        return shortfall(seqs, budgets)

    monkeypatch.setattr(llm.runner, "shortfall", too_low)
    runs, scheduler, failed = drive(llm, prompts, params, isolate_failures=True)
    assert underestimated == [4]  # the path was taken
    assert not failed
    assert llm.runner.slots.stats.preemptions >= 1
    reference = engine(tiny_models, None, max_model_len=64, block_size=None)
    assert [runs[str(i)].token_ids for i in range(4)] == [
        o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    assert_no_leak(llm)


def test_a_failed_prefill_gives_back_every_block_it_took(tiny_models, monkeypatch):
    """Isolating failures, a prefill that raises is retried one request at a time; the rows it filled - the copies
    of a prompt shared by a request's choices too, whose references were taken before the copy raised - go back to
    the pool at once, not when their slot is next taken. (Chunked prefill off: the three same long prompts are then
    prefilled together, one row and two copies.)"""
    llm = engine(tiny_models, None, max_num_seqs=4, enable_chunked_prefill=False)
    llm.runner.ensure_capacity(4, llm.max_model_len, llm.tree_size)
    copy_slot = llm.runner.cache.copy_slot
    raised = []

    def failing(source, targets, length):  # the copy takes its references, then the pool turns out short
        copy_slot(source, targets, length)
        if not raised:
            raised.append(len(targets))
            raise CacheFull("injected")

    monkeypatch.setattr(llm.runner.cache, "copy_slot", failing)
    prompt = SYSTEM + QUESTIONS[0]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 4

    def no_block_without_a_row(scheduler, out):
        held = {s.slot for s in scheduler.running + scheduler.prefilling}
        for slot in scheduler.free:
            assert (llm.runner.cache.tables[slot] < 0).all(), f"free slot {slot} still holds blocks"
        assert len(held) == len(scheduler.running) + len(scheduler.prefilling)

    runs, scheduler, failed = drive(llm, [prompt] * 3 + [QUESTIONS[1]], params, isolate_failures=True,
                                    on_step=no_block_without_a_row)
    assert raised == [2] and not failed
    reference = engine(tiny_models, None, block_size=None)
    want = [o.outputs[0].token_ids for o in reference.generate([prompt] * 3 + [QUESTIONS[1]], params)]
    assert [runs[str(i)].token_ids for i in range(4)] == want
    assert_no_leak(llm)


def test_a_next_turn_continues_an_answer_whose_last_block_ends_on_the_pending_token(tiny_models):
    """An answer that ends exactly at a block's end leaves that block's last position unwritten (the last token is
    never run): it must not be indexed, or the next turn, which begins with the whole answer, would adopt a block
    with a hole and answer differently from a fresh engine."""
    llm = engine(tiny_models, None, max_num_seqs=1)
    prompt = llm.tokenizer.encode(SYSTEM + QUESTIONS[0])
    first = SamplingParams(temperature=0, max_tokens=16 - len(prompt) % 16 + 16, ignore_eos=True, logprobs=1)
    [answer] = llm.generate([prompt], first)
    history = prompt + answer.outputs[0].token_ids
    assert len(history) % 16 == 0
    follow = history + llm.tokenizer.encode("\nAnd now?")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    [again] = llm.generate([follow], params)
    assert llm.runner.slots.stats.hits == len(history) - 16  # every full block but the one with the hole
    fresh = engine(tiny_models, None, max_num_seqs=1, enable_prefix_caching=False).generate([follow], params)
    assert again.outputs[0].token_ids == fresh[0].outputs[0].token_ids
    assert again.outputs[0].logprobs == fresh[0].outputs[0].logprobs
    assert_no_leak(llm)


def test_admission_waits_for_the_blocks_the_running_sequences_next_step_takes(tiny_models):
    """A request whose blocks fit only if the running one's next step took none waits for it: admitting it would
    only have the step preempt it again."""
    llm = engine(tiny_models, None, max_num_seqs=2, max_model_len=128)
    llm.runner.num_blocks = 8
    llm.runner.ensure_capacity(2, 128, 0)
    scheduler = llm.make_scheduler(2)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.make_sequence([5] + [20 + j % 7 for j in range(30)], greedy, "first")  # 31 tokens
    scheduler.add(first)
    scheduler.step()  # its prefill: 2 blocks
    scheduler.step()  # writes position 31, the last of its 2nd block; the next step writes 32: a 3rd block
    pool = llm.runner.cache.pool
    assert pool.used == 2 and llm.runner.step_headroom([first]) == 1
    second = llm.make_sequence([6] + [40 + j % 5 for j in range(89)], greedy, "second")  # 90 tokens: 6 blocks
    assert llm.runner.admission_blocks(second, [], 90) == pool.available == 6
    scheduler.add(second)
    out = scheduler.step()
    assert not out.prefilled and out.stepped == [first] and second in scheduler.waiting
    while scheduler.has_work:
        scheduler.step()
    assert llm.runner.slots.stats.preemptions == 0 and first.finished and second.finished
    assert_no_leak(llm)


def test_preemption_takes_the_most_recently_admitted_sequence_first(tiny_models):
    """The step that runs short preempts the sequence admitted last (it has waited least and holds the fewest
    generated tokens), not the one that has run longest."""
    llm = engine(tiny_models, None, max_num_seqs=3, max_model_len=64)
    llm.runner.num_blocks = 6
    llm.runner.ensure_capacity(3, 64, 0)
    scheduler = llm.make_scheduler(3)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seqs = [llm.make_sequence([5 + i] + [20 + j % 7 for j in range(28)], greedy, str(i)) for i in range(3)]
    for seq in seqs:  # 29 tokens each: 2 blocks, all 6 taken; at position 32 every row needs a 3rd
        scheduler.add(seq)
    preempted = []
    while scheduler.has_work and not preempted:
        running = list(scheduler.running)
        if scheduler.step().preempted:
            preempted = [s.request_id for s in running if s not in scheduler.running]
    assert preempted == ["2"], preempted
    while scheduler.has_work:
        scheduler.step()
    assert all(s.finished for s in seqs)
    assert_no_leak(llm)


def test_a_long_prompt_alone_goes_in_chunks_that_an_abort_or_a_newcomer_does_not_wait_out(tiny_models, monkeypatch):
    """Alone, a long prompt is prefilled in chunks of about LONE_CHUNK_SECONDS (the first of LONE_FIRST_CHUNK
    tokens), each step one chunk: a request that arrives meanwhile starts at the next step, an abort frees the prompt's
    row and blocks at once, and the answer is the one prefilled in a single piece."""
    monkeypatch.setattr(scheduler_module, "LONE_FIRST_CHUNK", 8)
    monkeypatch.setattr(scheduler_module, "LONE_CHUNK_SECONDS", 1e-9)  # the tiny model is fast: keep chunks small
    prompt = SYSTEM + QUESTIONS[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    whole = engine(tiny_models, None, max_num_seqs=2, enable_chunked_prefill=False)
    want = whole.generate([prompt], params)[0].outputs[0].token_ids
    llm = engine(tiny_models, None, max_num_seqs=2)
    sizes = []

    def chunk_sizes(scheduler, out):
        if scheduler.prefilling:
            sizes.append(scheduler.prefilling[0].prefilled)

    runs, scheduler, _ = drive(llm, [prompt], [params], on_step=chunk_sizes)
    assert runs["0"].token_ids == want
    n = len(llm.tokenizer.encode(prompt))
    assert n > scheduler_module.CHUNKED_PREFILL_ABOVE and sizes[0] == 8 and len(sizes) >= 2  # in pieces, not whole
    assert sizes == sorted(sizes) and sizes[-1] < n
    assert {b - a for a, b in zip(sizes, sizes[1:])} == {scheduler_module.MIN_CHUNK}  # sized from the last's speed

    # an abort between chunks: the row and its blocks go back before the next step; a newcomer starts at once
    llm = engine(tiny_models, None, max_num_seqs=2)  # (a fresh one: the first holds the prompt in its prefix cache)
    llm.runner.ensure_capacity(llm.max_num_seqs, llm.max_model_len, llm.tree_size)
    scheduler = llm.make_scheduler(llm.max_num_seqs, False)
    scheduler.add(llm.make_sequence(prompt, params, "long"))
    scheduler.step()
    assert [s.request_id for s in scheduler.prefilling] == ["long"] and not scheduler.running
    assert scheduler.abort("long") is not None
    assert not scheduler.prefilling and len(scheduler.free) == llm.max_num_seqs
    scheduler.add(llm.make_sequence(QUESTIONS[1], params, "short"))
    out = scheduler.step()
    assert "short" in out.deltas and [s.request_id for s in scheduler.running] == ["short"]
    while scheduler.has_work:
        scheduler.step()
    assert_no_leak(llm)



def _beside_a_stream(llm, prompts, params, monkeypatch):
    """A short stream decoding, then the long prompts, all to the end, the stream getting a token at every iteration:
    ({request_id: output ids}, how many steps carried a chunk, the order the long ones joined)."""
    alone = []
    monkeypatch.setattr(llm.runner, "prefill_chunk", lambda seq, tokens: alone.append(tokens))  # must not run
    llm.runner.ensure_capacity(llm.max_num_seqs, llm.max_model_len, llm.tree_size)
    scheduler = llm.make_scheduler(llm.max_num_seqs, False)
    stream = llm.make_sequence(QUESTIONS[1], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True), "stream")
    scheduler.add(stream)
    scheduler.step()
    seqs = [stream] + [llm.make_sequence(p, sp, f"long{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
    for seq in seqs[1:]:
        scheduler.add(seq)
    chunks, joined = 0, []
    while scheduler.has_work:
        before = [s.prefilled for s in seqs[1:]]
        out = scheduler.step()
        if [s.prefilled for s in seqs[1:]] != before and not out.prefilled:  # a chunk rode in the stream's step
            chunks += 1
        assert "stream" in out.deltas or stream.finished  # no iteration passes the stream by
        joined += [s.request_id for s in out.prefilled if s.request_id != "stream"]
        assert scheduler.slot_problem() is None and llm.runner.cache.leak() is None
    assert alone == [] and len(joined) == len(prompts)
    assert_no_leak(llm)
    return {s.request_id: s.output_ids for s in seqs}, chunks, joined


def test_a_long_prompt_rides_in_the_running_streams_steps_and_answers_as_alone(tiny_models, monkeypatch):
    """While others decode, a long prompt's chunks go in their steps' target pass (no pass of its own), growing
    towards STEP_BUDGET_SECONDS a step (doubling at most from FIRST_CHUNK, so a budget far above the step takes a
    few steps; none keeps chunks to a fraction of a step, many of them); every answer is its solo one, bit for
    bit, in each case."""
    prompt = SYSTEM + SYSTEM[:len(SYSTEM) // 2] + QUESTIONS[0]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    solo = engine(tiny_models, None, max_num_seqs=1, enable_chunked_prefill=False)
    n = len(solo.tokenizer.encode(prompt))
    assert n > 1.5 * scheduler_module.CHUNKED_PREFILL_ABOVE
    want = {"long0": solo.generate([prompt], params)[0].outputs[0].token_ids,
            "stream": solo.generate([QUESTIONS[1]], SamplingParams(temperature=0, max_tokens=300,
                                                                   ignore_eos=True))[0].outputs[0].token_ids}
    runs = {}
    for budget in (30.0, 0.0):
        monkeypatch.setattr(scheduler_module, "STEP_BUDGET_SECONDS", budget)
        runs[budget] = _beside_a_stream(engine(tiny_models, None, max_num_seqs=2), [prompt], params, monkeypatch)
        assert runs[budget][0] == want, budget
    wide, narrow = runs[30.0][1], runs[0.0][1]
    doubling = next(i for i in range(20) if scheduler_module.FIRST_CHUNK * (2 ** (i + 1) - 1) >= n - 1) + 1
    assert wide == doubling and narrow > 2 * wide, (wide, narrow)


def test_the_chunked_prompt_with_the_fewest_tokens_left_goes_first(tiny_models, monkeypatch):
    """Two prompts long enough to be chunked arrive while a stream decodes, the longer first: the shorter one's
    chunks go first, so it does not wait out the file-sized one's whole prefill."""
    monkeypatch.setattr(scheduler_module, "STEP_BUDGET_SECONDS", 0.0)  # small chunks: many steps to tell the order
    longer, shorter = SYSTEM + SYSTEM[:len(SYSTEM) // 2] + QUESTIONS[0], SYSTEM + QUESTIONS[2]
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * 2
    llm = engine(tiny_models, None, max_num_seqs=3, enable_prefix_caching=False)
    sizes = [len(llm.tokenizer.encode(p)) for p in (longer, shorter)]
    assert sizes[0] > sizes[1] + 100 and sizes[1] > scheduler_module.CHUNKED_PREFILL_ABOVE
    _, _, joined = _beside_a_stream(llm, [longer, shorter], params, monkeypatch)
    assert joined == ["long1", "long0"]


def test_beside_a_stream_a_prompt_of_a_few_dozen_tokens_rides_too(tiny_models, monkeypatch):
    """A prompt of more than RIDING_ABOVE tokens (fewer than CHUNKED_PREFILL_ABOVE) that arrives while others decode
    rides in their steps instead of holding them for its prefill; its answer is its solo one."""
    prompt = SYSTEM[:120] + QUESTIONS[2]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    solo = engine(tiny_models, None, max_num_seqs=1)
    n = len(solo.tokenizer.encode(prompt))
    assert scheduler_module.RIDING_ABOVE < n < scheduler_module.CHUNKED_PREFILL_ABOVE
    want = solo.generate([prompt], params)[0].outputs[0].token_ids
    outputs, chunks, _ = _beside_a_stream(engine(tiny_models, None, max_num_seqs=2), [prompt], params, monkeypatch)
    assert chunks >= 1 and outputs["long0"] == want



def test_a_riding_prompts_blocks_are_shared_as_they_fill(tiny_models, monkeypatch):
    """The blocks a riding chunk fills are offered to the prefix cache at once: a request that begins as a prompt
    still being prefilled (its first three blocks, then other text) joins with those blocks reused, instead of
    waiting for the whole prefill."""
    monkeypatch.setattr(scheduler_module, "STEP_BUDGET_SECONDS", 0.0)  # small chunks: the first is mid-prefill
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = engine(tiny_models, None, max_num_seqs=3)
    llm.runner.ensure_capacity(llm.max_num_seqs, llm.max_model_len, llm.tree_size)
    scheduler = llm.make_scheduler(llm.max_num_seqs, False)
    scheduler.add(llm.make_sequence(QUESTIONS[1], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True),
                                    "stream"))
    scheduler.step()
    first = llm.make_sequence(SYSTEM + SYSTEM[:len(SYSTEM) // 2] + QUESTIONS[0], params, "first")
    scheduler.add(first)
    block = llm.runner.cache.block_size
    while first.prefilled < 3 * block:
        scheduler.step()
    assert first in scheduler.prefilling  # still being prefilled
    second = llm.make_sequence(first.token_ids[:3 * block + 2] + [7 + j % 5 for j in range(40)], params, "second")
    scheduler.add(second)
    scheduler.step()
    assert second not in scheduler.waiting and second.reused == 3 * block, second.reused
    for request_id in ("stream", "first", "second"):
        scheduler.abort(request_id)
    assert_no_leak(llm)
