"""A real server on loopback: uvicorn in a thread over an AsyncEngine on the tiny checkpoints, with the same
connection options `specdecode serve` uses."""
import contextlib
import copy
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import uvicorn

from specdecode.engine.async_engine import AsyncEngine
from specdecode.engine.llm import LLM
from specdecode.server.app import build_app
from specdecode.server.limits import ServerLimits
from specdecode.server.transport import uvicorn_options


@contextlib.contextmanager
def running_server(llm: LLM, model_name: str = "tiny", api_key: str | None = None, max_waiting: int = 64,
                   limits: ServerLimits | None = None, allowed_hosts: list[str] | None = None,
                   strict_model_name: bool = False, cors_origins: str | None = None):
    engine = AsyncEngine(llm, max_waiting=max_waiting)
    limits = limits or ServerLimits()
    app = build_app(engine, model_name, api_key=api_key, limits=limits, allowed_hosts=allowed_hosts,
                    strict_model_name=strict_model_name, cors_origins=cors_origins)
    engine.start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", **uvicorn_options(limits)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", port=port, engine=engine, llm=llm, model=model_name,
                              app=app)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()
        sock.close()


def speculative_config(tiny_models, **extra) -> dict:
    return {"model": str(tiny_models["draft"]), "num_speculative_tokens": 4, "adaptive": False, **extra}


@pytest.fixture(scope="module")
def server(tiny_models):
    """Always drafts 4 tokens with a draft close to the target (so drafts are both proposed and accepted); 8 slots,
    so 16 clients also exercise the waiting queue."""
    llm = LLM(tiny_models["target"], dtype="float32", speculative_config=speculative_config(tiny_models),
              max_num_seqs=8)
    with running_server(llm) as s:
        yield s


@pytest.fixture(scope="module")
def reference(tiny_models):
    """Offline LLM with the same checkpoints, for the texts the server must reproduce."""
    return LLM(tiny_models["target"], dtype="float32", speculative_config=speculative_config(tiny_models),
               max_num_seqs=16)


class SpecCounts:
    """The engine's own speculation counts over a stretch of a test (its requests must have finished)."""

    def __init__(self, server):
        self.llm = server.llm
        self.before = copy.deepcopy(server.llm.total_stats)

    def delta(self) -> dict:
        now, before = self.llm.total_stats, self.before
        per_pos = [n - (before.accepted_per_pos[i] if i < len(before.accepted_per_pos) else 0)
                   for i, n in enumerate(now.accepted_per_pos)]
        return {"steps": now.steps - before.steps, "drafts": now.drafts - before.drafts,
                "draft_tokens": now.draft_tokens - before.draft_tokens,
                "accepted_tokens": now.accepted_tokens - before.accepted_tokens, "accepted_per_pos": per_pos}

    def assert_speculated(self) -> dict:
        """The requests in between really speculated: drafts were proposed, and some were accepted."""
        delta = self.delta()
        assert delta["draft_tokens"] > 0, "no draft token was proposed: this tested plain decoding"
        assert delta["accepted_tokens"] > 0, "no draft token was accepted"
        return delta


WAIT = 60
"""Seconds before a test gives up waiting for the server (it only matters when something is broken)."""


class StepGate:
    """Holds the engine at the start of each decode step until opened, and notes aborts: lets a test act while a
    request is certainly mid-generation, whatever the machine's speed."""

    def __init__(self, engine, monkeypatch):
        self.entered, self.opened, self.aborted = threading.Event(), threading.Event(), threading.Event()
        runner, real_step, real_abort = engine.llm.runner, engine.llm.runner.step, engine.abort

        def step(seqs, budgets, chunk=None):
            self.entered.set()
            assert self.opened.wait(WAIT), "the test never opened the gate"
            return real_step(seqs, budgets, chunk)

        def abort(request_id):
            real_abort(request_id)
            self.aborted.set()

        monkeypatch.setattr(runner, "step", step)
        monkeypatch.setattr(engine, "abort", abort)


def checkpoint_with_template(source, folder, chat_template: str):
    """A copy of the checkpoint at `source` in `folder` whose tokenizer has another chat template."""
    import json
    import shutil

    shutil.copytree(source, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = chat_template
    config_path.write_text(json.dumps(config))
    return folder
