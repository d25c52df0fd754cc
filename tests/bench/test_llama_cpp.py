"""llama.cpp as a speed peer (specdecode/bench/llama_cpp.py) without a llama.cpp build: its timing output parsed
from real captured samples, the flags that make it decode our exact prompt ids (checked through stand-in
binaries that record what they are given), the comparison, the one-line errors and the CLI wiring."""
import dataclasses
import os
import stat
import sys
from pathlib import Path

import pytest

from specdecode.bench.llama_cpp import (BUILD_SCRIPT, LlamaCpp, PeerRun, compare, parse_completion_log,
                                        parse_lookup_log)
from specdecode.cli import main
from specdecode.errors import ConfigError

# stderr of `llama-completion -no-cnv --ignore-eos -t 1 --temp 0 -n 16` on SmolLM2-135M-Instruct Q4_1 (llama.cpp of
# llama-cpp-python 0.3.36, while a build ran beside it), from the perf print on
COMPLETION_LOG = """\
0.00.467.599 I generate: n_ctx = 256, n_batch = 2048, n_predict = 16, n_keep = 0
0.00.467.600 I
0.01.082.934 I common_perf_print:    sampling time =       3.10 ms
0.01.082.936 I common_perf_print:    samplers time =       1.01 ms /    52 tokens
0.01.082.946 I common_perf_print:        load time =     176.70 ms
0.01.082.949 I common_perf_print: prompt eval time =     317.34 ms /    36 tokens (    8.82 ms per token,   113.44 tokens per second)
0.01.082.951 I common_perf_print:        eval time =     293.11 ms /    15 runs   (   19.54 ms per token,    51.18 tokens per second)
0.01.082.952 I common_perf_print:       total time =     616.30 ms /    51 tokens
0.01.082.954 I common_perf_print: unaccounted time =       2.75 ms /   0.4 %      (total - sampling - prompt eval - eval) / (total)
0.01.082.954 I common_perf_print:    graphs reused =         14
"""

# stderr of `llama-lookup --spec-draft-n-max 8 -n 64` on the same model, a request that copies its prompt
LOOKUP_LOG = """\
0.06.250.311 I encoded  132 tokens in    2.787 seconds, speed:   70.693 t/s
0.06.250.347 I decoded   65 tokens in    2.579 seconds, speed:   25.202 t/s
0.06.250.368 I
0.06.250.389 I n_draft      = 8
0.06.250.409 I n_predict    = 65
0.06.250.429 I n_drafted    = 56
0.06.250.450 I t_draft_flat = 0.19 ms
0.06.250.474 I t_draft      = 0.65 ms, 11.61 us per token, 86153.85 tokens per second
0.06.250.496 I n_accept     = 37
0.06.250.563 I accept       = 66.071%
0.06.250.586 I
target:

0.06.250.618 I common_perf_print:    sampling time =      11.25 ms
0.06.250.641 I common_perf_print:    samplers time =       4.57 ms /    65 tokens
0.06.250.669 I common_perf_print:        load time =     379.32 ms
0.06.250.693 I common_perf_print: prompt eval time =    4416.37 ms /   195 tokens (   22.65 ms per token,    44.15 tokens per second)
0.06.250.717 I common_perf_print:        eval time =     632.48 ms /    20 runs   (   31.62 ms per token,    31.62 tokens per second)
0.06.250.740 I common_perf_print:       total time =    5368.41 ms /   215 tokens
"""

# stderr of `llama-speculative -md DRAFT --spec-draft-n-max 4 -n 48 -t 1` on Qwen2.5-Coder-1.5B with the 0.5B drafting
SPECULATIVE_LOG = """\
0.09.188.305 I encoded   18 tokens in    0.701 seconds, speed:   25.665 t/s
0.09.188.306 I decoded   50 tokens in    4.911 seconds, speed:   10.182 t/s
0.09.188.307 I
0.09.188.307 I n_draft   = 4
0.09.188.308 I n_predict = 50
0.09.188.308 I n_drafted = 40
0.09.188.308 I n_accept  = 39
0.09.188.308 I accept    = 97.500%
0.09.188.336 I common_perf_print:    sampling time =      13.27 ms
0.09.188.342 I common_perf_print: prompt eval time =    3267.88 ms /    68 tokens (   48.06 ms per token,    20.81 tokens per second)
0.09.188.409 I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)
"""

# A ChatML prompt as our template renders it: special tokens, a non-ASCII character, a backslash-n that must stay
# two characters (no escape processing) and the final newline that llama.cpp's -f would drop.
PROMPT = "<|im_start|>user\nWhat does print('a\\n') show? ❏<|im_end|>\n<|im_start|>assistant\n"


def test_completion_perf_print_is_parsed():
    figures = parse_completion_log(COMPLETION_LOG)
    assert figures["prompt_tokens"] == 36 and figures["tokens"] == 16  # 15 eval runs after the prefill's token
    assert figures["prompt_tokens_per_s"] == pytest.approx(36 / 0.31734)
    assert figures["eval_tokens_per_s"] == pytest.approx(15 / 0.29311)  # llama.cpp's own 51.18
    assert figures["decode_tokens_per_s"] == pytest.approx(15 / (0.29311 + 0.00310))  # with its sampling


def test_lookup_summary_is_parsed_not_its_perf_print():
    figures = parse_lookup_log(LOOKUP_LOG)
    assert (figures["prompt_tokens"], figures["tokens"]) == (132, 65)  # not the perf print's 195 "prompt" tokens
    assert figures["decode_tokens_per_s"] == pytest.approx(64 / 2.579)
    assert figures["prompt_tokens_per_s"] == pytest.approx(132 / 2.787)
    assert (figures["drafted"], figures["accepted"]) == (56, 37)


def test_output_without_timings_is_a_one_line_error():
    with pytest.raises(ConfigError, match="prompt eval time"):
        parse_completion_log("error: unknown argument: -no-cnv\n")
    with pytest.raises(ConfigError, match="encoded/decoded"):
        parse_lookup_log(COMPLETION_LOG)


BENCH_JSON = ('[{"n_prompt": 1, "n_gen": 0, "avg_ns": 11107413, "avg_ts": 90.07},'
              ' {"n_prompt": 2, "n_gen": 0, "avg_ns": 18382609, "avg_ts": 108.8}]\n')
"""What `llama-bench -p 1,2 -n 0 -o json` prints (trimmed to the fields read), from a real run on SmolLM2."""


def _fake_bin(folder: Path, record: Path) -> Path:
    """Stand-ins for the llama.cpp binaries: each writes its arguments and its prompt file's bytes under `record`,
    then prints what the real one prints."""
    folder.mkdir()
    outputs = {"llama-completion": ("Because of Rayleigh scattering.\n\n", COMPLETION_LOG),
               "llama-lookup": (f"\n\n{PROMPT}Because of Rayleigh scattering.\n\n\n\n", LOOKUP_LOG),
               "llama-speculative": (f"\n\n{PROMPT}Because of Rayleigh scattering.\n\n\n\n", SPECULATIVE_LOG),
               "llama-tokenize": ("[1, 9690, 198]\n", ""), "llama-quantize": ("", "quantize time = 1 ms\n"),
               "llama-bench": (BENCH_JSON, "")}
    for name, (out, err) in outputs.items():
        script = folder / name
        (record / f"{name}.out").write_text(out)
        (record / f"{name}.err").write_text(err)
        script.write_text(f"""#!/bin/sh
printf '%s\\n' "$@" > "{record}/{name}.args"
while [ $# -gt 0 ]; do
  case "$1" in -bf|-f) cp "$2" "{record}/{name}.prompt" ;; esac
  if [ "$1" = --allow-requantize ]; then cp "$2" "$3"; fi
  shift
done
cat "{record}/{name}.out"; cat "{record}/{name}.err" >&2
""")
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return folder


@pytest.fixture
def fake_llama(tmp_path):
    import gguf

    record = tmp_path / "record"
    record.mkdir()
    model = tmp_path / "model.Q4_1.gguf"
    writer = gguf.GGUFWriter(str(model), "llama")
    writer.add_file_type(3)  # LLAMA_FTYPE_MOSTLY_Q4_1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return LlamaCpp(_fake_bin(tmp_path / "bin", record)), model, record


@pytest.mark.skipif(sys.platform == "win32", reason="the stand-in binaries are shell scripts")
def test_runs_pass_our_exact_prompt_and_no_template(fake_llama):
    peer, model, record = fake_llama
    run = peer.complete(model, PROMPT, tokens=16, prompt_tokens=20, prompt="qa:0")
    assert (record / "llama-completion.prompt").read_bytes() == PROMPT.encode()  # byte for byte, final newline too
    args = (record / "llama-completion.args").read_text().split("\n")
    for flag in ("-no-cnv", "--no-escape", "--ignore-eos", "--no-display-prompt"):
        assert flag in args
    assert args[args.index("--override-kv") + 1] == "tokenizer.ggml.add_bos_token=bool:false"
    assert args[args.index("-t") + 1] == "1" and args[args.index("--temp") + 1] == "0"
    assert args[args.index("-n") + 1] == "16"
    assert (run.engine, run.mode, run.format, run.prompt, run.tokens) == ("llama.cpp", "plain", "Q4_1", "qa:0", 16)
    assert run.text == "Because of Rayleigh scattering."

    lookup = peer.lookup(model, PROMPT, tokens=64, prompt_tokens=20, draft=8)
    args = (record / "llama-lookup.args").read_text().split("\n")
    assert args[args.index("--spec-draft-n-max") + 1] == "8" and "-no-cnv" not in args  # lookup refuses it
    assert lookup.text == "Because of Rayleigh scattering."  # the echoed prompt taken off
    assert (lookup.mode, lookup.drafted, lookup.accepted) == ("lookup", 56, 37)

    draft = model.with_name("draft.gguf")
    spec = peer.speculative(model, draft, PROMPT, tokens=48, prompt_tokens=20, draft=4)
    args = (record / "llama-speculative.args").read_text().split("\n")
    assert args[args.index("-md") + 1] == str(draft) and args[args.index("--spec-draft-n-max") + 1] == "4"
    assert args[args.index("-td") + 1] == args[args.index("-tbd") + 1] == "1"
    assert "--ignore-eos" not in args  # it stops at the end of the turn, as a chat request does
    assert spec.text == "Because of Rayleigh scattering." and (spec.tokens, spec.drafted, spec.accepted) == (50, 40, 39)
    assert spec.decode_tokens_per_s == pytest.approx(49 / 4.911)
    peer.complete(model, PROMPT, tokens=16, prompt_tokens=20, ignore_eos=False)
    assert "--ignore-eos" not in (record / "llama-completion.args").read_text().split("\n")

    assert peer.tokenize(model, PROMPT) == [1, 9690, 198]
    args = (record / "llama-tokenize.args").read_text().split("\n")
    assert "--no-bos" in args and "--no-escape" in args
    assert (record / "llama-tokenize.prompt").read_bytes() == PROMPT.encode()


@pytest.mark.skipif(sys.platform == "win32", reason="the stand-in binaries are shell scripts")
def test_pass_costs_come_from_llama_bench_and_sit_beside_ours(fake_llama):
    from specdecode.bench.speed_report import verify_table

    peer, model, record = fake_llama
    costs = peer.pass_costs(model, [1, 2], repeats=2)
    args = (record / "llama-bench.args").read_text().split("\n")
    assert args[args.index("-p") + 1] == "1,2" and args[args.index("-n") + 1] == "0"
    assert args[args.index("-t") + 1] == "1" and args[args.index("-o") + 1] == "json"
    assert costs == {1: 0.011107413, 2: 0.018382609}
    ours = {"seconds": {"1": 0.010, "2": 0.012}, "relative": {"1": 1.0, "2": 1.2}}
    table = verify_table({"verify": {"gguf": ours}, "vs_llama_cpp": {"pass_costs": {str(k): v for k, v in costs.items()}}})
    assert "| 2 | 12.00 ms, 1.20x | 18.38 ms, 1.65x |" in table
    (peer.bin_dir / "llama-bench").unlink()
    assert peer.pass_costs(model, [1, 2]) is None


@pytest.mark.skipif(sys.platform == "win32", reason="the stand-in binaries are shell scripts")
def test_q8_0_copy_is_made_once(fake_llama, tmp_path):
    peer, model, record = fake_llama
    copy = peer.requantize(model, "Q8_0", tmp_path / "cache")
    assert copy == tmp_path / "cache" / "model.Q4_1.requantized-Q8_0.gguf" and copy.is_file()
    assert (record / "llama-quantize.args").read_text().split("\n")[:4] == [
        "--allow-requantize", str(model), str(copy.with_suffix(".partial")), "Q8_0"]
    (record / "llama-quantize.args").unlink()
    assert peer.requantize(model, "Q8_0", tmp_path / "cache") == copy
    assert not (record / "llama-quantize.args").exists()  # not run again
    (peer.bin_dir / "llama-quantize").unlink()
    assert peer.requantize(model, "Q8_0", tmp_path / "other") is None  # no llama-quantize: no Q8_0 row


def test_failed_run_is_one_line(fake_llama):
    peer, model, record = fake_llama
    (peer.bin_dir / "llama-tokenize").write_text("#!/bin/sh\necho 'loading...' >&2\necho 'error: bad model' >&2\n"
                                                 "exit 1\n")
    with pytest.raises(ConfigError, match=r"^llama-tokenize failed \(exit 1\): error: bad model$"):
        peer.tokenize(model, PROMPT)


def _run(engine, mode, fmt, prompt, tokens_per_s, text="same", drafted=0, accepted=0):
    return PeerRun(engine, mode, fmt, prompt, 30, 128, tokens_per_s, 500.0, drafted, accepted, text=text)


def test_compare_gives_per_prompt_ratios_to_the_reference():
    runs = [_run("llama.cpp", "plain", "Q4_1", "a", 100.0), _run("specdecode", "plain", "float32 onednn", "a", 50.0),
            _run("llama.cpp", "plain", "Q4_1", "b", 200.0),
            _run("specdecode", "plain", "float32 onednn", "b", 150.0, text="same but longer"),
            _run("specdecode", "ngram adaptive", "float32 onednn", "a", 80.0, "other", drafted=10, accepted=4),
            _run("specdecode", "ngram adaptive", "float32 onednn", "b", 400.0, drafted=30, accepted=16)]
    rows = {r["name"]: r for r in compare(runs, "llama.cpp plain Q4_1")}
    assert list(rows) == ["llama.cpp plain Q4_1", "specdecode plain float32 onednn",
                          "specdecode ngram adaptive float32 onednn"]
    ref, plain, spec = rows.values()
    assert ref["ratio_median"] == 1.0 and ref["same_text"] == 2 and ref["acceptance"] is None
    assert ref["shared_chars"] == 4
    assert (plain["ratio_min"], plain["ratio_max"]) == (0.5, 0.75) and plain["ratio_median"] == pytest.approx(0.625)
    assert plain["decode_tokens_per_s"] == 100.0 and plain["same_text"] == 2  # a longer text that starts alike
    assert (spec["ratio_min"], spec["ratio_max"]) == (0.8, 2.0) and spec["same_text"] == 1
    assert spec["shared_chars"] == 2  # median of "other" vs "same" (0) and "same" vs "same" (4)
    assert spec["acceptance"] == pytest.approx(20 / 40)


def test_bin_dir_without_binaries_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as caught:
        LlamaCpp(tmp_path)
    message = str(caught.value)
    assert "\n" not in message and BUILD_SCRIPT in message and "llama-completion" in message
    assert os.path.isfile(Path(__file__).parents[2] / BUILD_SCRIPT)  # the script it names exists


def test_cli_refuses_a_bin_dir_without_binaries(tiny_models, tmp_path, capsys):
    code = main(["bench", "--speed", "--llama-cpp", str(tmp_path / "nowhere"), "--model", str(tiny_models["target"]),
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and BUILD_SCRIPT in err
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_cli_needs_speed_for_llama_cpp(tmp_path, capsys):
    assert main(["bench", "--llama-cpp", str(tmp_path)]) == 2
    assert "--speed" in capsys.readouterr().err


@pytest.mark.skipif(sys.platform == "win32", reason="the stand-in binaries are shell scripts")
def test_cli_hands_llama_cpp_to_the_speed_run(fake_llama, monkeypatch, tmp_path):
    from specdecode.bench import speed

    peer, model, _ = fake_llama
    seen = {}

    def run_speed(config, log=print):
        seen["config"] = config
        raise ConfigError("stop here")

    monkeypatch.setattr(speed, "run_speed", run_speed)
    assert main(["bench", "--speed", "--llama-cpp", str(peer.bin_dir), "--prompts", "3", "--model", str(model)]) == 2
    config = seen["config"]
    assert config.llama_cpp == peer.bin_dir and config.peer_prompts == 3 and config.tokens == 128
    with pytest.raises(ConfigError, match="not one"):  # llama.cpp runs the same GGUF as ours
        speed.SpeedConfig(model=tmp_path, llama_cpp=peer.bin_dir)


def test_report_has_the_table_vs_llama_cpp():
    from specdecode.bench.speed_report import llama_cpp_table

    runs = [_run("llama.cpp", "plain", "Q4_1", "qa:0", 100.0), _run("specdecode", "plain", "Q4_1 kernels", "qa:0", 50.0),
            _run("llama.cpp", "plain", "Q4_1", "code:0", 80.0), _run("specdecode", "plain", "Q4_1 kernels", "code:0", 60.0)]
    peer = {"reference": "llama.cpp plain Q4_1", "draft": 8, "spec_config": {"method": "ngram"},
            "same_prompt_ids": {"qa:0": True, "code:0": False}, "rows": compare(runs, "llama.cpp plain Q4_1"),
            "runs": [dataclasses.asdict(r) for r in runs]}
    table = llama_cpp_table({"vs_llama_cpp": peer, "settings": {"tokens": 128, "rounds": 3}})
    assert "vs llama.cpp plain Q4_1 (median)" in table and "**1/2** prompts" in table
    assert "| specdecode | plain | Q4_1 kernels | 55.0 | 0.62x | 0.50-0.75x |" in table
    assert "| code:0 (ids differ) | 30 | 80.0 | 60.0 |" in table
