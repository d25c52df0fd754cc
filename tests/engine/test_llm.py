"""Plain (non-speculative) decoding through the LLM API: output shape, equality with transformers' greedy
generate, one batched target forward per step, stop conditions, detokenized text, bad requests."""
import json
import shutil

import pytest
import torch

from specdecode.engine.llm import LLM
from specdecode.errors import ConfigError
from specdecode.sampling import SamplingParams

PROMPTS = ["def add(a, b):", "class Point:\n    def __init__(self, x, y):", "for i"]


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(model=tiny_models["target"], dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def hf_model(tiny_models):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_models["target"], dtype=torch.float32).eval()


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy loop on the same checkpoint (it stops at the checkpoint's EOS too)."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens, pad_token_id=2)
    return out[0, len(prompt_ids):].tolist()


def test_one_output_per_prompt(llm):
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(outputs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.prompt == prompt
        assert out.prompt_token_ids == llm.tokenizer.encode(prompt)
        completion = out.outputs[0]
        assert len(completion.token_ids) == 5 and all(isinstance(t, int) for t in completion.token_ids)
        assert completion.finish_reason == "length"
        assert completion.text == llm.tokenizer.decode(completion.token_ids)
        assert out.finished


def test_single_prompt_string_and_token_ids(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    by_text = llm.generate(PROMPTS[0], params)
    by_ids = llm.generate([llm.tokenizer.encode(PROMPTS[0])], params)
    assert len(by_text) == 1 and by_ids[0].prompt is None
    assert by_text[0].outputs[0].token_ids == by_ids[0].outputs[0].token_ids


def test_greedy_matches_transformers(llm, hf_model):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24))[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_model, out.prompt_token_ids, 24)


def test_batched_greedy_matches_transformers_per_prompt(llm, hf_model):
    """Prompts of different lengths decoded as one ragged batch give each prompt's own greedy continuation."""
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))
    assert len({len(o.prompt_token_ids) for o in outputs}) == len(PROMPTS)
    for out in outputs:
        assert out.outputs[0].token_ids == hf_greedy(hf_model, out.prompt_token_ids, 16)


def test_batch_runs_one_target_forward_per_step(llm, monkeypatch):
    calls = []
    forward = llm.target.forward

    def counting_forward(input_ids, *args, **kwargs):
        calls.append(tuple(input_ids.shape))
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(llm.target, "forward", counting_forward)
    max_tokens = 6
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    # One prefill for all prompts, then one forward per generated token for the whole batch.
    assert len(calls) == max_tokens
    assert all(shape[0] == len(PROMPTS) for shape in calls)


def test_stop_string(llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate(PROMPTS[1], params)[0].outputs[0].text
    stop = full[8:11]
    assert stop and full.find(stop) >= 0
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == full[:full.find(stop)]
    assert stop not in out.outputs[0].text


def test_stop_on_eos(tiny_models, tmp_path):
    """A checkpoint whose generation_config lists the token greedy decoding produces third as an EOS stops there."""
    first = LLM(model=tiny_models["target"], dtype="float32", device="cpu")
    ids = first.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    eos = ids.token_ids[2]
    ckpt = shutil.copytree(tiny_models["target"], tmp_path / "ckpt")
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, eos]}))
    llm = LLM(model=ckpt, dtype="float32", device="cpu")
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    stop_at = ids.token_ids.index(eos)
    assert out.finish_reason == "stop"
    assert out.token_ids == ids.token_ids[:stop_at + 1]  # the EOS token is returned, as in vLLM
    ignored = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == ids.token_ids


def test_stream_yields_the_generated_text(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    deltas = list(llm.stream(PROMPTS[0], params))
    assert "".join(deltas) == llm.generate(PROMPTS[0], params)[0].outputs[0].text
    assert llm.last_stats.emitted_tokens == 12


def test_text_equals_full_decode_with_multibyte_prompt(llm):
    """Random weights emit arbitrary byte tokens, so the detokenizer meets split UTF-8 sequences here."""
    outputs = llm.generate(["naïve café ✓ 日本語 🚀", "x = 'ü'"],
                           SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True))
    for out in outputs:
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)


def test_prompt_longer_than_context(tiny_models):
    llm = LLM(model=tiny_models["target"], dtype="float32", device="cpu", max_model_len=16)
    with pytest.raises(ConfigError, match=r"prompt has \d+ tokens but the model's context is 16; shorten"):
        llm.generate("def add(a, b):\n    return a + b\n" * 4, SamplingParams(max_tokens=4))


def test_output_capped_by_context(tiny_models):
    llm = LLM(model=tiny_models["target"], dtype="float32", device="cpu", max_model_len=16)
    out = llm.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 16


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(llm, prompt):
    with pytest.raises(ConfigError, match="prompt is empty"):
        llm.generate([prompt], SamplingParams(max_tokens=4))


def test_params_count_must_match_prompts(llm):
    with pytest.raises(ConfigError, match="2 sampling params for 3 prompts"):
        llm.generate(PROMPTS, [SamplingParams(), SamplingParams()])


def test_chat_renders_the_template(llm):
    conversation = [{"role": "user", "content": "def add"}]
    [out] = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=5))
    assert out.prompt == "<|user|>def add\n<|assistant|>"
    assert out.prompt_token_ids == llm.tokenizer.encode_chat(conversation)
    assert out.outputs[0].token_ids == llm.generate([out.prompt_token_ids],
                                                    SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].token_ids
    assert len(llm.chat([conversation, conversation])) == 2


def test_default_model_is_the_coder_pair(monkeypatch):
    """LLM() is Qwen2.5-Coder-1.5B with its 0.5B drafting (auto): both are fetched together, under one progress bar,
    before anything loads (the fetch is stopped here: the suite never downloads the pair)."""
    from specdecode.catalog import registry

    asked = []

    def stop(files, quiet=False):
        asked.append([model.name for model, _ in files])
        raise RuntimeError("stop here")

    monkeypatch.setattr(registry, "fetch_all", stop)
    with pytest.raises(RuntimeError, match="stop here"):
        LLM()
    assert asked == [["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"]]
    with pytest.raises(RuntimeError, match="stop here"):
        LLM(speculative_config=None)  # plain decoding of the default model: its draft is not fetched
    assert asked[-1] == ["qwen2.5-coder-1.5b-instruct"]


def test_smollm2_by_path_decodes_plainly(smollm2, tiny_models):
    """A path (here SmolLM2's file) decodes plainly unless speculative_config says otherwise; "auto" (the default)
    picks the speculator shipped for a named model (the CLI's default; checked there), and none for a path."""
    llm = LLM(smollm2, dtype="float32", max_num_seqs=1)
    assert llm.model_dir == smollm2 and llm.spec_config is None
    [out] = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
                     SamplingParams(temperature=0, max_tokens=12))
    assert out.outputs[0].text == "The capital of France is Paris." and out.outputs[0].finish_reason == "stop"
    assert LLM(model=tiny_models["target"], speculative_config="auto").spec_config is None
    with pytest.raises(ConfigError, match="speculative_config must be a dict, None or 'auto'"):
        LLM(model=tiny_models["target"], speculative_config="ngram")
