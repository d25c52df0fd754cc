"""`specdecode generate`: streams the completion, ends with a speed line; bad input exits 2 with one line."""
import re

import pytest

from specdecode.cli import main


def run(capsys, *argv):
    code = main(["generate", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_generate(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
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
    assert re.fullmatch(r"\d+ tokens, [\d.]+ tokens/s \(draft_model, K=3: acceptance rate [\d.]+%, "
                        r"[\d.]+ tokens per step\)", last), last


def test_compare_prints_both_speeds_and_speedup(tiny_models, capsys):
    code, out, err = run(capsys, "for i", "--model", tiny_models["target"], "--max-tokens", 6,
                         "--speculative-method", "ngram", "--compare")
    assert code == 0, err
    assert "[plain]" in out and "[speculative]" in out
    assert re.search(r"plain: [\d.]+ tokens/s \| speculative: [\d.]+ tokens/s \(ngram, K=5: .*\) \| "
                     r"speedup [\d.]+x", out)


def test_sampling_flags(tiny_models, capsys):
    argv = ("x =", "--model", tiny_models["target"], "--max-tokens", 8, "--temperature", 0.9, "--top-p", 0.9,
            "--top-k", 20, "--seed", 5, "--no-speculation", "--threads", 1)
    first, second = run(capsys, *argv), run(capsys, *argv)
    assert first[0] == second[0] == 0
    assert first[1].splitlines()[:-1] == second[1].splitlines()[:-1]  # same seed, same text


@pytest.mark.parametrize("extra, message", [
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--max-tokens", "0"], "max_tokens must be a positive integer"),
    (["--dtype", "flaot16"], "dtype 'flaot16' is not supported"),
    (["--compare"], "--compare needs a speculative method"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--no-speculation", "--num-speculative-tokens", "3"], "--no-speculation contradicts"),
    (["--speculative-method", "ngram", "--speculative-model", "x"], "apply to --speculative-method draft_model"),
])
def test_bad_flags_exit_2_with_one_line(tiny_models, capsys, extra, message):
    code, out, err = run(capsys, "x", "--model", tiny_models["target"], *extra)
    assert code == 2
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_missing_model_dir(tmp_path, capsys):
    code, _, err = run(capsys, "x", "--model", tmp_path / "nope")
    assert code == 2 and "does not exist" in err


def test_missing_bundled_models(monkeypatch, tmp_path, capsys):
    import specdecode.models

    monkeypatch.setattr(specdecode.models, "DEFAULT_TARGET_DIR", tmp_path / "target")
    monkeypatch.setattr(specdecode.models, "DEFAULT_DRAFT_DIR", tmp_path / "draft")
    code, _, err = run(capsys, "def fibonacci(n):")
    assert code == 2
    assert "bundled target model is missing" in err and "--model DIR" in err


def test_bundled_target_speculates_with_bundled_draft(monkeypatch, tiny_models, capsys):
    """With the bundled target and no flags, generate drafts with the bundled draft (here: the tiny pair)."""
    import specdecode.models

    monkeypatch.setattr(specdecode.models, "DEFAULT_TARGET_DIR", tiny_models["target"])
    monkeypatch.setattr(specdecode.models, "DEFAULT_DRAFT_DIR", tiny_models["draft"])
    code, out, err = run(capsys, "def add(a, b):", "--max-tokens", 8)
    assert code == 0, err
    assert "(draft_model, K=5: acceptance rate" in out.strip().splitlines()[-1]
    code, out, err = run(capsys, "def add(a, b):", "--max-tokens", 8, "--no-speculation")
    assert code == 0 and "acceptance" not in out.strip().splitlines()[-1]
