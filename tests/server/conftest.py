"""A real server on loopback: uvicorn in a thread over an AsyncEngine on the tiny checkpoints."""
import contextlib
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import uvicorn

from specdecode.engine.async_engine import AsyncEngine
from specdecode.engine.llm import LLM
from specdecode.server.app import build_app


@contextlib.contextmanager
def running_server(llm: LLM, model_name: str = "tiny", api_key: str | None = None, max_waiting: int = 64):
    engine = AsyncEngine(llm, max_waiting=max_waiting)
    app = build_app(engine, model_name, api_key=api_key)
    engine.start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", engine=engine, llm=llm, model=model_name)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()
        sock.close()


def speculative_config(tiny_models, **extra) -> dict:
    return {"model": str(tiny_models["draft"]), "num_speculative_tokens": 4, **extra}


@pytest.fixture(scope="module")
def server(tiny_models):
    """Adaptive speculation, 8 slots (so 16 clients also exercise the waiting queue)."""
    llm = LLM(tiny_models["target"], dtype="float32",
              speculative_config=speculative_config(tiny_models, adaptive=True), max_num_seqs=8)
    with running_server(llm) as s:
        yield s


@pytest.fixture(scope="module")
def reference(tiny_models):
    """Offline LLM with the same checkpoints, for the texts the server must reproduce."""
    return LLM(tiny_models["target"], dtype="float32", speculative_config=speculative_config(tiny_models),
               max_num_seqs=16)
