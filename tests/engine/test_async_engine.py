"""The background engine: concurrent requests, abort, back-pressure, a request that breaks a step failing alone,
and health reports of a dead, stalled or leaking engine. Nothing here waits on wall-clock time: the tests hold the
engine with events and its own lock."""
import asyncio
import threading

import pytest

import specdecode.engine.step as step_module
import specdecode.speculation.verify as verify_module
from specdecode.engine.async_engine import (AsyncEngine, EngineDead, EngineOverloaded, RequestAborted,
                                            RequestFailed)
from specdecode.engine.llm import LLM
from specdecode.errors import ConfigError
from specdecode.sampling import SamplingParams
from specdecode.speculation.control import SpecController
from specdecode.speculation.cost import CostModel

PROMPTS = ["def add(a, b):", "class Point:", "for i in range(10):", "import os", "print(", "self.x ="]
WAIT = 60  # seconds before a test gives up waiting on the engine (it only matters when something is broken)


@pytest.fixture(scope="module")
def llm_factory(tiny_models):
    def make(max_num_seqs=4):
        config = {"model": str(tiny_models["draft"]), "num_speculative_tokens": 3, "adaptive": False}
        llm = LLM(tiny_models["target"], dtype="float32", speculative_config=config, max_num_seqs=max_num_seqs)
        # Fixed K with made-up costs: the engine would otherwise time the models at start-up, for its speedup gauge.
        llm.controller = SpecController(CostModel({k: {1: 0.01} for k in range(4)}, {1: 0.001}, max_num_seqs), 3)
        llm.controller.fixed_k = 3
        return llm
    return make


@pytest.fixture
def engine(llm_factory):
    engine = AsyncEngine(llm_factory(), max_waiting=8)
    engine.start()
    yield engine
    engine.shutdown()


async def collect(stream):
    """Text, ids and last delta of a request (a request that never answers fails the test instead of hanging)."""
    async def read():
        text, ids, last = "", [], None
        async for delta in stream:
            text += delta.text
            ids += delta.token_ids
            last = delta
        return text, ids, last
    return await asyncio.wait_for(read(), WAIT)


def test_concurrent_requests_match_offline_generate(engine, llm_factory):
    params = [SamplingParams(temperature=0, max_tokens=6 + 4 * i) for i in range(len(PROMPTS))]
    expected = llm_factory(max_num_seqs=8).generate(PROMPTS, params)

    async def main():
        return await asyncio.gather(*(collect(engine.add_request(p, sp)) for p, sp in zip(PROMPTS, params)))

    for (text, ids, last), want in zip(asyncio.run(main()), expected):
        assert text == want.outputs[0].text
        assert ids == want.outputs[0].token_ids
        assert last.finish_reason == want.outputs[0].finish_reason
        assert last.completion_tokens == len(ids)
    assert engine.metrics.generation_tokens._value.get() == sum(len(e.outputs[0].token_ids) for e in expected)


def test_abort_frees_the_slot(engine):
    async def main():
        stream = engine.add_request("import os", SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        await stream.__anext__()
        stream.abort()
        with pytest.raises(RequestAborted):  # at once, even with more deltas already queued
            await stream.__anext__()

    asyncio.run(main())
    assert engine.wait_idle(WAIT)
    assert len(engine.scheduler.free) == engine.llm.max_num_seqs and not engine.scheduler.running


def test_requests_beyond_capacity_are_refused(llm_factory):
    engine = AsyncEngine(llm_factory(max_num_seqs=1), max_waiting=1)
    engine.start()
    try:
        async def main():
            long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            first, second = engine.add_request("a", long), engine.add_request("b", long)
            with pytest.raises(EngineOverloaded):
                engine.add_request("c", long)
            first.abort()
            second.abort()
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_bad_requests_are_refused_before_the_engine_sees_them(engine):
    async def main():
        with pytest.raises(ConfigError):
            engine.add_request([], SamplingParams())
        with pytest.raises(ConfigError, match="token ids"):
            engine.add_request([5, 10 ** 6], SamplingParams())
        overflowing = SamplingParams(temperature=1.0)
        overflowing.top_k = 2 ** 63  # past validation: used to fail every request in the step that carried it
        with pytest.raises(ConfigError, match="sampling parameters"):
            engine.add_request("import os", overflowing)
    asyncio.run(main())
    assert engine.health() is None


POISON = 666  # the seed of a request that breaks any step it is in


def poisoned(calls: list, in_prefill: bool):
    """params_tensors that raises for a batch holding the POISON request (in prefill, or in decode steps)."""
    real = step_module.params_tensors

    def params_tensors(params, repeats=None, device="cpu"):
        if (repeats is None) == in_prefill and any(p.seed == POISON for p in params):
            calls.append(len(params))
            raise RuntimeError("secret internal detail")
        return real(params, repeats, device)
    return params_tensors


@pytest.mark.parametrize("in_prefill", [True, False], ids=["prefill", "decode"])
def test_a_request_that_breaks_a_step_fails_alone(engine, llm_factory, monkeypatch, in_prefill):
    calls = []
    # The prefill samples its first tokens in the step loop; a decode step's sampled rows are verified in speculation.
    monkeypatch.setattr(step_module if in_prefill else verify_module, "params_tensors", poisoned(calls, in_prefill))
    bystanders = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                  SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True),
                  SamplingParams(temperature=0.8, seed=4, max_tokens=25, ignore_eos=True)]
    expected = llm_factory().generate(PROMPTS[:3], bystanders)

    async def main():
        with engine._cond:  # the engine takes all four at once, so they share their first steps
            streams = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, bystanders)]
            poison = engine.add_request(PROMPTS[3], SamplingParams(temperature=1.0, seed=POISON, max_tokens=30))
        with pytest.raises(RequestFailed) as failure:
            await collect(poison)
        return await asyncio.gather(*(collect(s) for s in streams)), str(failure.value)

    results, message = asyncio.run(main())
    assert calls[0] > 1 and calls[-1] == 1  # a batch with others failed first, then the poison alone
    assert "secret" not in message and "internal error" in message
    for (text, ids, last), want in zip(results, expected):  # the others were not disturbed at all
        assert ids == want.outputs[0].token_ids and last.finish_reason == "length"
    assert engine.wait_idle(WAIT)
    assert len(engine.scheduler.free) == engine.llm.max_num_seqs
    assert engine.metrics.failed_requests._value.get() == 1 and engine.health() is None


def test_failing_requests_never_leak_slots(engine, monkeypatch):
    """Many more failing requests than slots (the prefill used to leave its slots taken, and then wedge)."""
    monkeypatch.setattr(step_module, "params_tensors", poisoned([], in_prefill=True))

    async def main():
        for _ in range(3 * engine.llm.max_num_seqs):
            with pytest.raises(RequestFailed):
                await collect(engine.add_request("x", SamplingParams(temperature=1.0, seed=POISON)))
        return await collect(engine.add_request("import os", SamplingParams(temperature=0, max_tokens=5)))

    text, ids, last = asyncio.run(main())
    assert len(ids) == 5 and last.finish_reason == "length"
    assert engine.wait_idle(WAIT) and len(engine.scheduler.free) == engine.llm.max_num_seqs
    assert engine.health() is None


def test_a_bug_in_the_bookkeeping_fails_that_iteration_only(engine, monkeypatch):
    real = engine.metrics.record_step
    calls = []

    def record_step(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in the metrics")
        return real(*args)

    monkeypatch.setattr(engine.metrics, "record_step", record_step)

    async def main():
        with pytest.raises(RequestFailed):
            await collect(engine.add_request("import os", SamplingParams(temperature=0, max_tokens=8)))
        return await collect(engine.add_request("import os", SamplingParams(temperature=0, max_tokens=8)))

    assert len(asyncio.run(main())[1]) == 8
    assert engine.wait_idle(WAIT) and len(engine.scheduler.free) == engine.llm.max_num_seqs
    assert engine.health() is None


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_health_reports_a_stalled_engine(llm_factory, monkeypatch):
    clock = FakeClock()
    engine = AsyncEngine(llm_factory(), stall_timeout=30, clock=clock)
    inside, release = threading.Event(), threading.Event()
    real_step = engine.llm.runner.step

    def stuck_step(seqs, budgets, chunk=None):
        inside.set()
        assert release.wait(WAIT)
        return real_step(seqs, budgets, chunk)

    monkeypatch.setattr(engine.llm.runner, "step", stuck_step)
    engine.start()
    try:
        async def main():
            stream = engine.add_request("import os", SamplingParams(temperature=0, max_tokens=4))
            assert await asyncio.to_thread(inside.wait, WAIT)
            assert engine.health() is None  # busy, not yet for too long
            clock.now += 31
            assert "inside one iteration for 31 s" in engine.health()
            release.set()
            return await collect(stream)

        assert len(asyncio.run(main())[1]) == 4
        assert engine.health() is None
    finally:
        release.set()
        engine.shutdown()
    assert "not running" in engine.health()


def test_a_dead_engine_fails_its_requests_and_says_so(llm_factory, monkeypatch):
    engine = AsyncEngine(llm_factory())

    def broken():
        raise RuntimeError("a bug outside the step")

    monkeypatch.setattr(engine.scheduler, "slot_problem", broken)
    engine.start()

    async def main():
        with pytest.raises(EngineDead):
            await collect(engine.add_request("import os", SamplingParams(temperature=0, max_tokens=4)))
        with pytest.raises(EngineDead):
            engine.add_request("import os", SamplingParams())

    asyncio.run(main())
    assert engine.health() == "the engine is not running (RuntimeError)"


def test_leaked_slots_are_reported_and_do_not_spin(engine, monkeypatch):
    steps = []
    real_step = engine.scheduler.step
    monkeypatch.setattr(engine.scheduler, "step", lambda: steps.append(1) or real_step())
    with engine._cond:
        engine.scheduler.pool.empty.clear()  # as if every slot had leaked
        engine.scheduler.pool.held.clear()

    async def main():
        with engine._cond:  # the engine is idle: its next iteration is the one that takes this request
            seen = engine.iterations
            stream = engine.add_request("import os", SamplingParams(temperature=0, max_tokens=4))
        await asyncio.to_thread(wait_for, engine, lambda: engine.iterations > seen)
        assert "cache slots leaked: 0 free and 0 running of 4" in engine.health()
        stream.abort()

    asyncio.run(main())
    assert engine.wait_idle(WAIT)
    assert steps == []  # work waiting and no slot: the engine waits instead of stepping in a loop


def wait_for(engine, predicate):
    with engine._cond:
        assert engine._cond.wait_for(predicate, WAIT)
