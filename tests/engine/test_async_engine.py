"""The background engine: concurrent requests, abort, back-pressure and surviving a failed step."""
import asyncio

import pytest

from specdecode.engine.async_engine import AsyncEngine, EngineOverloaded, RequestAborted, RequestFailed
from specdecode.engine.llm import LLM
from specdecode.errors import ConfigError
from specdecode.sampling import SamplingParams

PROMPTS = ["def add(a, b):", "class Point:", "for i in range(10):", "import os", "print(", "self.x ="]


@pytest.fixture(scope="module")
def llm_factory(tiny_models):
    def make(max_num_seqs=4):
        config = {"model": str(tiny_models["draft"]), "num_speculative_tokens": 3}
        return LLM(tiny_models["target"], dtype="float32", speculative_config=config, max_num_seqs=max_num_seqs)
    return make


@pytest.fixture
def engine(llm_factory):
    engine = AsyncEngine(llm_factory(), max_waiting=8)
    engine.start()
    yield engine
    engine.shutdown()


async def collect(stream):
    text, ids, last = "", [], None
    async for delta in stream:
        text += delta.text
        ids += delta.token_ids
        last = delta
    return text, ids, last


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
        with pytest.raises(RequestAborted):
            await stream.__anext__()
        for _ in range(500):
            if not engine.scheduler.running and engine._in_system == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())
    assert len(engine.scheduler.free) == engine.llm.max_num_seqs


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


def test_bad_prompt_is_a_config_error(engine):
    async def main():
        with pytest.raises(ConfigError):
            engine.add_request([], SamplingParams())
    asyncio.run(main())


def test_a_failed_step_fails_its_requests_but_not_the_engine(engine, monkeypatch):
    real_step = engine.llm.runner.step
    calls = []

    def failing_step(seqs, budgets):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated fault")
        return real_step(seqs, budgets)

    monkeypatch.setattr(engine.llm.runner, "step", failing_step)

    async def main():
        with pytest.raises(RequestFailed, match="simulated fault"):
            await collect(engine.add_request("import os", SamplingParams(temperature=0, max_tokens=8)))
        return await collect(engine.add_request("import os", SamplingParams(temperature=0, max_tokens=8)))

    text, ids, last = asyncio.run(main())
    assert engine.alive and len(ids) == 8 and last.finish_reason == "length"
