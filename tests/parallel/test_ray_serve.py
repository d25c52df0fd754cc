"""Two replicas on a local Ray cluster behind Ray Serve's HTTP proxy, driven by the official openai client: greedy
answers equal offline LLM.generate, requests reach both replicas, each has its own /metrics, a killed replica's
streams fail with a connection error and its other requests get an error the client retries (not a hang), it is
replaced, and a deleted deployment lets its in-flight stream finish. Skipped when Ray Serve is not installed (pip install -e ".[ray]")."""
import os
import signal
import socket
import threading
import time

import pytest

serve = pytest.importorskip("ray.serve")
ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402

from specdecode.cli import build_parser  # noqa: E402
from specdecode.engine.llm import LLM  # noqa: E402
from specdecode.errors import ConfigError  # noqa: E402
from specdecode.sampling import SamplingParams  # noqa: E402
from specdecode.server.ray_serve import (REPLICA_HEADER, DeploymentSettings, ReplicaSettings,  # noqa: E402
                                         app_builder, build_deployment, deployment_settings)

PROMPTS = ["def add(a, b):", "class Point:", "for i in range(10):", "import os"]
DEADLINE = 60.0  # seconds any one request may take here before the test calls it a hang


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tiny_models):
    """A local Ray cluster (2 CPUs, no dashboard) serving 2 replicas of the tiny target; torn down after."""
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2 ** 20, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        llm_kwargs = {"model": str(tiny_models["target"]), "dtype": "float32", "device": "cpu", "max_num_seqs": 4,
                      "max_model_len": 512}
        app = build_deployment(ReplicaSettings(llm_kwargs, "tiny"),
                               DeploymentSettings(replicas=2, num_cpus=0.5, graceful_shutdown_timeout_s=20,
                                                  health_check_period_s=1))
        serve.run(app, name="specdecode", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def client(base: str, retries: int = 0):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=retries, timeout=DEADLINE)


def complete(api, prompt: str, max_tokens: int = 12) -> tuple[str, str]:
    """(text, replica) of one greedy completion."""
    raw = api.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0)
    return raw.parse().choices[0].text, raw.headers[REPLICA_HEADER]


@pytest.mark.slow
def test_greedy_answers_equal_offline_and_both_replicas_serve(cluster, tiny_models):
    offline = LLM(str(tiny_models["target"]), dtype="float32", max_num_seqs=4, max_model_len=512)
    want = [o.outputs[0].text for o in offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))]
    api = client(cluster)
    assert [complete(api, p)[0] for p in PROMPTS] == want
    replicas = set()
    for i in range(40):  # the router picks at random between replicas: both show up (2^-39 odds otherwise)
        text, replica = complete(api, PROMPTS[i % len(PROMPTS)])
        assert text == want[i % len(PROMPTS)]
        replicas.add(replica)
        if len(replicas) == 2:
            break
    assert len(replicas) == 2, replicas
    chat = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0)
    assert chat.choices[0].message.role == "assistant"


def test_each_replica_has_its_metrics(cluster):
    seen = {}
    for _ in range(40):
        response = httpx.get(f"{cluster}/metrics", timeout=DEADLINE)
        assert response.status_code == 200 and "specdecode:" in response.text
        seen[response.headers[REPLICA_HEADER]] = response.text
        if len(seen) == 2:
            break
    assert len(seen) == 2
    assert httpx.get(f"{cluster}/health", timeout=DEADLINE).json() == {"status": "ok"}


def open_streams(api, count: int) -> list:
    """`count` long greedy streams, each opened (headers read): [(stream, replica)]."""
    streams = []
    for i in range(count):
        raw = api.completions.with_raw_response.create(model="tiny", prompt=PROMPTS[i % len(PROMPTS)],
                                                        max_tokens=400, temperature=0, stream=True,
                                                        stream_options={"include_usage": True},
                                                        extra_body={"ignore_eos": True})
        streams.append((raw.parse(), raw.headers[REPLICA_HEADER]))
    return streams


def drain(stream) -> tuple[int, Exception | None]:
    """(tokens the stream's usage reports, 0 without one; the error that ended the stream or None), read in a
    thread bounded by DEADLINE."""
    result = [0, None]

    def read():
        try:
            for chunk in stream:
                if chunk.usage is not None:
                    result[0] = chunk.usage.completion_tokens
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            result[1] = exc

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(DEADLINE)
    assert not thread.is_alive(), "a stream hung"
    return result[0], result[1]


@pytest.mark.slow
def test_a_killed_replica_fails_its_streams_retryably_and_is_replaced(cluster):
    api = client(cluster)
    streams = []
    for _ in range(5):  # until both replicas hold a stream
        streams += open_streams(api, 4)
        if len({replica for _, replica in streams}) == 2:
            break
    victim = streams[0][1]
    answers = []  # non-streaming requests in flight during the kill, from clients that retry (openai's default)

    def ask():
        answers.append(client(cluster, retries=2).completions.create(
            model="tiny", prompt="x", max_tokens=400, extra_body={"ignore_eos": True}).usage.completion_tokens)

    asking = [threading.Thread(target=ask, daemon=True) for _ in range(4)]
    for thread in asking:
        thread.start()
    time.sleep(0.3)
    os.kill(int(victim.rsplit("/", 1)[1]), signal.SIGKILL)
    for stream, replica in streams:
        chunks, error = drain(stream)
        if replica == victim:
            assert isinstance(error, (openai.APIConnectionError, httpx.TransportError)), error  # retried by clients
        else:
            assert error is None and chunks == 400, (chunks, error)
    for thread in asking:
        thread.join(DEADLINE)
    assert answers == [400] * 4, "a killed replica's requests are retried onto a live one"
    deadline = time.monotonic() + DEADLINE
    replicas = set()
    while len(replicas - {victim}) < 2 and time.monotonic() < deadline:
        replicas.add(complete(client(cluster, retries=2), PROMPTS[0], 2)[1])
    assert len(replicas - {victim}) == 2, f"the killed replica was not replaced: {replicas}"


@pytest.mark.slow
def test_deleting_the_deployment_finishes_in_flight_requests(cluster):
    (stream, _), = open_streams(client(cluster), 1)
    deleting = threading.Thread(target=serve.delete, args=("specdecode",), daemon=True)
    deleting.start()
    chunks, error = drain(stream)
    assert error is None and chunks == 400, (chunks, error)
    deleting.join(DEADLINE)
    assert not deleting.is_alive()


def test_serve_run_builder_reads_its_arguments(tiny_models):
    app = app_builder({"model": str(tiny_models["target"]), "replicas": "3", "num_cpus": "0.25", "dtype": "float32"})
    deployment = app._bound_deployment
    assert deployment.num_replicas == 3
    assert deployment.ray_actor_options["num_cpus"] == 0.25
    with pytest.raises(ConfigError, match="both --min-replicas and --max-replicas"):
        DeploymentSettings(min_replicas=1)
    parser = build_parser()
    with pytest.raises(SystemExit):  # refused while parsing, before any cluster starts
        parser.parse_args(["serve", "--replicas", "0"])
    flags = ["serve", "--min-replicas", "1", "--max-replicas", "3", "--replica-cpus", "2", "--replica-gpus", "1"]
    settings = deployment_settings(parser.parse_args(flags))
    assert (settings.min_replicas, settings.max_replicas, settings.num_cpus, settings.num_gpus) == (1, 3, 2.0, 1.0)
