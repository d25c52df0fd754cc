"""`specdecode serve` builds the engine and app from its flags and binds to loopback unless told otherwise."""
import asyncio

import httpx
import pytest
import uvicorn

from specdecode.cli import build_parser, main


def test_serve_flags_wire_an_adaptive_engine(tiny_models, monkeypatch):
    seen = {}

    def fake_run(app, host, port, log_level):
        seen.update(host=host, port=port)

        async def ask():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                seen["unauthorised"] = (await http.get("/v1/models")).status_code
                seen["models"] = (await http.get("/v1/models", headers={"Authorization": "Bearer k"})).json()
                seen["health"] = (await http.get("/health")).status_code
                seen["completion"] = (await http.post("/v1/completions", json={"prompt": "def", "max_tokens": 3},
                                                      headers={"Authorization": "Bearer k"})).json()

        asyncio.run(ask())

    monkeypatch.setattr(uvicorn, "run", fake_run)
    assert main(["serve", "--model", str(tiny_models["target"]), "--speculative-model", str(tiny_models["draft"]),
                 "--num-speculative-tokens", "2", "--max-num-seqs", "2", "--api-key", "k",
                 "--served-model-name", "tiny"]) == 0
    assert seen["host"] == "127.0.0.1" and seen["port"] == 8000
    assert seen["unauthorised"] == 401
    assert [m["id"] for m in seen["models"]["data"]] == ["tiny"]
    assert seen["health"] == 200
    assert seen["completion"]["usage"]["completion_tokens"] == 3


def test_serve_rejects_contradictory_flags(tiny_models, capsys):
    code = main(["serve", "--model", str(tiny_models["target"]), "--no-speculation", "--speculative-method", "ngram"])
    assert code == 2
    assert "no-speculation" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--adaptive", "--no-adaptive"])
def test_adaptive_flag_parses(flag):
    args = build_parser().parse_args(["serve", flag])
    assert args.adaptive == (flag == "--adaptive")
