"""`specdecode serve` builds the engine, app and uvicorn options from its flags, binds to loopback unless told
otherwise, and takes its API key from a flag, a file or the environment."""
import argparse
import asyncio
import re

import httpx
import pytest
from specdecode.cli import build_parser, main
from specdecode.cli import serve as server_cli
from specdecode.errors import ConfigError
from specdecode.cli.serve import API_KEY_ENV, api_key


def serve(tiny_models, monkeypatch, *flags, env=None):
    """Run `specdecode serve` with uvicorn.run replaced: returns what it was given and a few answers of the app."""
    seen = {}
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)

    def fake_run(app, host, port, log_level, ready_line, **options):
        seen.update(host=host, port=port, options=options, ready_line=ready_line)

        async def ask():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
                seen["unauthorised"] = (await http.get("/v1/models")).status_code
                seen["models"] = await http.get("/v1/models", headers={"Authorization": "Bearer k"})
                seen["health"] = (await http.get("/health")).status_code
                seen["completion"] = (await http.post("/v1/completions", json={"prompt": "def", "max_tokens": 3},
                                                      headers={"Authorization": "bearer k"})).json()
                seen["foreign_host"] = (await http.get("/health", headers={"Host": "evil.example"})).status_code
                seen["other_model"] = (await http.post(
                    "/v1/completions", json={"model": "another", "prompt": "def", "max_tokens": 1},
                    headers={"Authorization": "bearer k"})).status_code

        asyncio.run(ask())

    monkeypatch.setattr(server_cli, "run_uvicorn", fake_run)
    code = main(["serve", "--model", str(tiny_models["target"]), "--dtype", "float32", *flags])
    return code, seen


def test_serve_flags_wire_an_engine_and_connection_limits(tiny_models, monkeypatch):
    code, seen = serve(tiny_models, monkeypatch, "--speculative-model", str(tiny_models["draft"]),
                       "--num-speculative-tokens", "2", "--max-num-seqs", "2", "--api-key", "k",
                       "--served-model-name", "tiny", "--max-waiting", "10")
    assert code == 0
    assert seen["host"] == "127.0.0.1" and seen["port"] == 8000
    assert seen["unauthorised"] == 401
    assert [m["id"] for m in seen["models"].json()["data"]] == ["tiny"]
    assert seen["health"] == 200 and seen["foreign_host"] == 400
    assert seen["completion"]["usage"]["completion_tokens"] == 3
    options = seen["options"]
    assert options["limit_concurrency"] == 2 + 10 + 64
    assert options["timeout_keep_alive"] == 5 and options["h11_max_incomplete_event_size"] == 16384
    assert options["http"].__name__ == "HeaderTimeoutH11Protocol"


def test_limit_flags_reach_the_server(tiny_models, monkeypatch):
    code, seen = serve(tiny_models, monkeypatch, "--api-key-file", str(write(tiny_models["tok"] / "key", "k\n")),
                       "--max-connections", "7", "--keep-alive-timeout", "2", "--max-header-bytes", "4096",
                       "--allowed-hosts", "evil.example")
    assert code == 0 and seen["models"].status_code == 200 and seen["foreign_host"] == 200
    assert (seen["options"]["limit_concurrency"], seen["options"]["timeout_keep_alive"],
            seen["options"]["h11_max_incomplete_event_size"]) == (7, 2, 4096)


def test_api_key_from_the_environment(tiny_models, monkeypatch):
    code, seen = serve(tiny_models, monkeypatch, env={API_KEY_ENV: "k"})
    assert code == 0 and seen["unauthorised"] == 401 and seen["models"].status_code == 200


@pytest.mark.parametrize("flags,status", [((), 200), (("--strict-model-name",), 404)])
def test_strict_model_name_flag_decides_the_answer_to_another_name(tiny_models, monkeypatch, flags, status):
    code, seen = serve(tiny_models, monkeypatch, "--api-key", "k", "--max-model-len", "64", *flags)
    assert code == 0 and seen["other_model"] == status


def write(path, text):
    path.write_text(text)
    return path


def key_args(**kwargs):
    return argparse.Namespace(**{"api_key": None, "api_key_file": None, **kwargs})


def test_api_key_sources(tmp_path):
    assert api_key(key_args(), environ={}) is None
    assert api_key(key_args(), environ={API_KEY_ENV: " k1 "}) == "k1"
    assert api_key(key_args(api_key="k2"), environ={API_KEY_ENV: "k1"}) == "k2"  # a flag wins
    assert api_key(key_args(api_key_file=write(tmp_path / "key", "k3\n")), environ={}) == "k3"
    for args, env in ((key_args(api_key=""), {}), (key_args(api_key="  "), {}), (key_args(), {API_KEY_ENV: ""}),
                      (key_args(api_key_file=write(tmp_path / "empty", "\n")), {})):
        with pytest.raises(ConfigError, match="is empty, which would lock every client out"):
            api_key(args, environ=env)
    with pytest.raises(ConfigError, match="not both"):
        api_key(key_args(api_key="a", api_key_file=tmp_path / "key"), environ={})
    with pytest.raises(ConfigError, match="cannot read --api-key-file"):
        api_key(key_args(api_key_file=tmp_path / "missing"), environ={})


def test_an_empty_api_key_is_a_clear_cli_error(tiny_models, capsys):
    assert main(["serve", "--model", str(tiny_models["target"]), "--api-key", ""]) == 2
    assert "API key from --api-key is empty" in capsys.readouterr().err


def test_bad_limits_are_cli_errors(tiny_models, capsys):
    assert main(["serve", "--model", str(tiny_models["target"]), "--max-body-bytes", "0"]) == 2
    err = capsys.readouterr().err
    assert "argument --max-body-bytes: must be an integer between" in err and len(err.strip().splitlines()) == 1


def test_serve_rejects_contradictory_flags(tiny_models, capsys):
    code = main(["serve", "--model", str(tiny_models["target"]), "--no-speculation", "--speculative-method", "ngram"])
    assert code == 2
    assert "no-speculation" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--adaptive", "--no-adaptive"])
def test_adaptive_flag_parses(flag):
    args = build_parser().parse_args(["serve", flag])
    assert args.adaptive == (flag == "--adaptive")


@pytest.mark.parametrize("flags, message", [
    (["--max-num-seqs", "0"], "argument --max-num-seqs: must be an integer between 1 and"),
    (["--port", "70000"], "argument --port: must be an integer between 0 and 65535"),
    (["--memory-fraction", "0"], "argument --memory-fraction: must be a number in (0, 1]"),
    (["--max-num-seqs", "1000", "--memory-budget", "0.05", "--block-size", "0"], "lower --max-num-seqs to"),
    (["--max-model-len", "100000000"], "longer than the model's context"),
    (["--memory-budget", "0.000001"], "not even one sequence"),
])
def test_serve_refuses_bad_sizes_before_the_model_loads(tiny_models, capsys, monkeypatch, flags, message):
    from specdecode.engine import parts as llm

    monkeypatch.setattr(llm, "load_model", lambda *a, **k: pytest.fail("loaded the model before refusing"))
    assert main(["serve", "--model", str(tiny_models["target"]), "--dtype", "float32", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_serve_sizes_its_batch_from_the_memory_available(tiny_models, monkeypatch):
    """Without --max-num-seqs: slots layout, as many sequences as the plan fits in --memory-fraction of what is
    available (at most 32); paged, 32 rows over a pool of the memory left. The ready line says what was chosen."""
    from specdecode.cli import serve as server_cli

    monkeypatch.setattr("specdecode.hardware.available_memory", lambda: 64 * 2**20)
    code, seen = serve(tiny_models, monkeypatch, "--max-model-len", "256", "--memory-fraction", "0.5", "--no-speculation")
    assert code == 0
    pool = re.search(r"up to 32 sequences of up to 256 positions in a KV pool of ([\d,]+) positions", seen["ready_line"])
    assert pool and int(pool.group(1).replace(",", "")) > 32 * 256
    code, seen = serve(tiny_models, monkeypatch, "--max-model-len", "256", "--memory-fraction", "0.5", "--no-speculation",
                       "--block-size", "0")
    assert code == 0
    lines = re.search(r"(\d+) sequences x 256 positions", seen["ready_line"])
    chosen = int(lines.group(1))
    assert 1 <= chosen < server_cli.DEFAULT_MAX_NUM_SEQS and "of 0.1 GiB available" in seen["ready_line"]
    code, seen = serve(tiny_models, monkeypatch, "--max-model-len", "256", "--memory-fraction", "0.5",
                       "--no-speculation", "--max-num-seqs", str(chosen), "--block-size", "0")
    assert code == 0 and f"{chosen} sequences" in seen["ready_line"]


def test_default_flags_start_whenever_the_models_and_one_sequence_fit(tiny_models, monkeypatch):
    """A quarter of what the models leave is too small for one sequence (the pair refused to start beside another
    process's 5 GB): with default flags serve starts all the same, its pool one sequence; an explicit
    --memory-fraction that is too small is still refused."""
    from specdecode.plan import plan_memory

    one = plan_memory(tiny_models["target"], 2**40, None, server_cli.DEFAULT_MAX_NUM_SEQS, None, "float32",
                      block_size=16)
    need = one.needed()  # the models, the activations' peak and one sequence of the model's context
    monkeypatch.setattr("specdecode.hardware.available_memory", lambda: int(need * 1.5))
    code, seen = serve(tiny_models, monkeypatch, "--no-speculation")
    assert code == 0, seen
    pool = re.search(r"of up to (\d+) positions in a KV pool of ([\d,]+) positions", seen["ready_line"])
    assert pool and int(pool.group(1)) == one.max_model_len
    assert one.max_model_len <= int(pool.group(2).replace(",", "")) < 3 * one.max_model_len
    assert seen["completion"]["usage"]["completion_tokens"] == 3
    assert main(["serve", "--model", str(tiny_models["target"]), "--dtype", "float32", "--no-speculation",
                 "--memory-fraction", "0.01"]) == 2


def test_the_ready_line_counts_what_the_process_holds(tiny_models, tmp_path):
    """The ready line's "GiB resident" is the memory the server holds, also once a request ran and left (its pool's
    pages are taken as blocks are first written), and "GiB planned" what it may come to hold with the pool full (it
    said 0.8 GiB where the process held 4.2 GB: the plan's one-sequence minimum, and no runtime)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "specdecode.cli", "serve", "--model", str(tiny_models["target"]), "--dtype",
           "float32", "--no-speculation", "--memory-budget", "0.5", "--port", "0", "--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "ready at" in line:
                break
        ready = re.search(r"([\d.]+) GiB resident, up to ([\d.]+) GiB planned .*ready at (http://\S+)", lines[-1])
        assert ready, "".join(lines)
        idle, planned, url = float(ready.group(1)) * 2**30, float(ready.group(2)) * 2**30, ready.group(3)
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": "def add", "max_tokens": 8}, timeout=60)
        assert answer.status_code == 200
        status = open(f"/proc/{proc.pid}/status").read()
        resident = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024
        assert abs(resident - idle) <= 0.1 * idle, (resident / 2**30, idle / 2**30)
        assert planned > 1.2 * idle  # (a pool of 0.5 GiB less the model)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
