"""llama-server's surface beyond its generation routes: the aliases of the /v1 routes, and (below) what a client
written against llama-server's README asks of a server serving one model."""
import httpx
import pytest

from specdecode.engine.llm import LLM
from specdecode.sampling import SamplingParams

from .conftest import running_server

JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def plain(tiny_models):
    """The tiny target alone (no speculation): these routes do not depend on drafting."""
    llm = LLM(tiny_models["target"], dtype="float32", max_num_seqs=2, max_model_len=128)
    with running_server(llm) as server:
        yield server


def greedy(llm: LLM, prompt: str, max_tokens: int) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompt, params)[0].outputs[0].text


def test_completions_alias_answers_as_llamas_completion(plain):
    """llama-server's /completions is its own /completion (its native answer), not /v1/completions."""
    body = {"prompt": "def add(a, b):", "n_predict": 6, "temperature": 0, "ignore_eos": True}
    alias = httpx.post(plain.url + "/completions", json=body, headers=JSON)
    native = httpx.post(plain.url + "/completion", json=body, headers=JSON)
    assert alias.status_code == 200, alias.text
    assert alias.json()["stop"] is True and "choices" not in alias.json()
    assert alias.json()["content"] == native.json()["content"] == greedy(plain.llm, body["prompt"], 6)


def test_chat_completions_alias_answers_as_the_v1_route(plain):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    alias = httpx.post(plain.url + "/chat/completions", json=body, headers=JSON)
    v1 = httpx.post(plain.url + "/v1/chat/completions", json=body, headers=JSON)
    assert alias.status_code == 200, alias.text
    assert alias.json()["object"] == "chat.completion"
    assert alias.json()["choices"][0]["message"] == v1.json()["choices"][0]["message"]
    assert alias.json()["choices"][0]["message"]["role"] == "assistant"
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # (the second had the prompt cached)
    assert [alias.json()["usage"][k] for k in counts] == [v1.json()["usage"][k] for k in counts]


def test_models_alias_lists_the_served_model(plain):
    alias = httpx.get(plain.url + "/models")
    assert alias.status_code == 200
    assert alias.json()["data"][0]["id"] == "tiny"
    assert alias.json()["data"] == httpx.get(plain.url + "/v1/models").json()["data"]


def test_aliases_stay_out_of_the_schema(plain):
    paths = httpx.get(plain.url + "/openapi.json").json()["paths"]
    assert "/v1/completions" in paths and "/v1/chat/completions" in paths
    assert not {"/completions", "/chat/completions", "/models"} & set(paths)


def test_aliases_need_the_key_when_one_is_set(tiny_models):
    llm = LLM(tiny_models["target"], dtype="float32", max_num_seqs=1, max_model_len=64)
    with running_server(llm, api_key="sk-k") as keyed:
        for method, path, body in [("POST", "/completions", {"prompt": "x", "n_predict": 1}),
                                   ("POST", "/chat/completions",
                                    {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
                                   ("GET", "/models", None)]:
            url = keyed.url + path
            refused = httpx.request(method, url, json=body)
            assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error", path
            assert httpx.request(method, url, json=body, headers={"X-Api-Key": "sk-k"}).status_code == 200, path


# -- /tokenize and /detokenize (llama-server's README; tests/unit/test_tokenize.py) ------------------------------

def test_tokenize_answers_the_tokenizers_ids_and_detokenize_inverts_them(plain):
    content = "def add(a, b):\n    return a + b"
    tokens = httpx.post(plain.url + "/tokenize", json={"content": content}).json()["tokens"]
    assert tokens == plain.llm.tokenizer.encode(content, add_special_tokens=False) and len(tokens) > 5
    back = httpx.post(plain.url + "/detokenize", json={"tokens": tokens})
    assert back.status_code == 200 and back.json() == {"content": content}


def test_tokenize_add_special_prepends_bos_only_when_asked(plain, monkeypatch):
    tokenizer = plain.llm.tokenizer
    monkeypatch.setattr(tokenizer, "add_bos_token", True)
    monkeypatch.setattr(tokenizer, "bos_token_id", 7)
    plain_ids = httpx.post(plain.url + "/tokenize", json={"content": "hello"}).json()["tokens"]
    with_bos = httpx.post(plain.url + "/tokenize", json={"content": "hello", "add_special": True}).json()["tokens"]
    assert with_bos == [7] + plain_ids and plain_ids == tokenizer.encode("hello", add_special_tokens=False)


def test_tokenize_with_pieces_gives_each_tokens_text_or_bytes(plain):
    content = "unicode 媽 and emoji 🤗"
    answer = httpx.post(plain.url + "/tokenize", json={"content": content, "with_pieces": True}).json()["tokens"]
    assert [t["id"] for t in answer] == plain.llm.tokenizer.encode(content, add_special_tokens=False)
    assert all(set(t) == {"id", "piece"} and len(t["piece"]) > 0 for t in answer)
    raw = b"".join(t["piece"].encode() if isinstance(t["piece"], str) else bytes(t["piece"]) for t in answer)
    assert raw.decode() == content
    assert any(isinstance(t["piece"], list) for t in answer)  # a byte-level BPE splits 媽 or 🤗 inside a character


def test_tokenize_and_detokenize_without_their_field_answer_empty(plain):
    assert httpx.post(plain.url + "/tokenize", json={}).json() == {"tokens": []}
    assert httpx.post(plain.url + "/detokenize", json={}).json() == {"content": ""}


@pytest.mark.parametrize("path,body,field", [
    ("/tokenize", {"content": 3}, "content"),
    ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
    ("/tokenize", {"content": "x", "add_special": 1}, "add_special"),
    ("/tokenize", {"content": "x", "parse_special": False}, "parse_special"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, 10 ** 6]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
])
def test_tokenize_and_detokenize_refuse_bad_input_naming_the_field(plain, path, body, field):
    response = httpx.post(plain.url + path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].split(".")[0] == field


# -- /props -----------------------------------------------------------------------------------------------------

def test_props_describe_the_server(plain):
    props = httpx.get(plain.url + "/props").json()
    assert props["default_generation_settings"]["n_ctx"] == plain.llm.max_model_len == 128
    assert props["total_slots"] == plain.llm.max_num_seqs == 2
    assert props["model_alias"] == "tiny"
    assert props["model_path"] == str(plain.llm.model_dir)
    assert props["chat_template"] == plain.llm.tokenizer.chat_template and "messages" in props["chat_template"]
    assert props["build_info"].startswith("specdecode ")
    assert props["endpoint_slots"] is False


# -- a request naming another model ----------------------------------------------------------------------------

OTHER_MODEL = [("/v1/completions", {"prompt": "def f(", "max_tokens": 3, "temperature": 0, "ignore_eos": True}),
               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})]


@pytest.mark.parametrize("path,body", OTHER_MODEL)
def test_another_model_name_is_served_by_the_one_model(plain, path, body):
    named = httpx.post(plain.url + path, json={**body, "model": "gpt-3.5-turbo"})
    assert named.status_code == 200, named.text
    assert named.json()["model"] == "tiny"
    if path == "/v1/completions":
        assert named.json()["choices"][0]["text"] == greedy(plain.llm, body["prompt"], 3)


def test_strict_model_name_answers_404_to_another_name(tiny_models):
    llm = LLM(tiny_models["target"], dtype="float32", max_num_seqs=1, max_model_len=64)
    with running_server(llm, strict_model_name=True) as strict:
        for path, body in OTHER_MODEL:
            refused = httpx.post(strict.url + path, json={**body, "model": "gpt-3.5-turbo"})
            assert refused.status_code == 404, refused.text
            assert refused.json()["error"]["code"] == "model_not_found" and refused.json()["error"]["param"] == "model"
            assert httpx.post(strict.url + path, json={**body, "model": "tiny"}).status_code == 200


def test_slots_is_off_as_llama_servers_is_by_default(plain):
    response = httpx.get(plain.url + "/slots")
    assert response.status_code == 501
    assert response.json()["error"]["type"] == "not_supported_error"
