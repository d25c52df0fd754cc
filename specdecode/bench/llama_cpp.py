"""llama.cpp as a peer of the speed benchmark (a binary it runs, never a dependency): plain greedy decoding
(`llama-completion`) and prompt lookup (`llama-lookup`) on the very prompt token ids we decode, timed by llama.cpp's
own perf print; then every engine's per-prompt figures as ratios to one reference row.

scripts/build_llama_cpp.sh DEST builds the binaries from the llama-cpp-python sdist on PyPI.

Same ids: we hand llama.cpp the prompt already rendered in our chat template, byte for byte (`-bf`, `--no-escape`),
with its own templating off (`-no-cnv`) and its BOS off (the template writes any BOS itself, as our encode_chat
assumes); `tokenize` asks `llama-tokenize` for the ids of that same text, so a run can check them against ours.

Timing, alike for every engine: decode tokens/s = tokens after the first / seconds after the first token (the first
comes out of prefill). For llama-completion those seconds are its perf print's eval time plus sampling time (we
count our sampling too); for llama-lookup, its "decoded N tokens in S seconds" line (its perf print counts the
verification batches as prompt eval).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

from specdecode.errors import ConfigError

BUILD_SCRIPT = "scripts/build_llama_cpp.sh"
REQUIRED = ("llama-completion", "llama-lookup", "llama-tokenize")
END_OF_TEXT = " [end of text]\n"
"""What llama.cpp's examples print after an end-of-generation token (whose own piece is empty)."""
"""Binaries a run needs; llama-quantize is optional (without it there is no Q8_0 row)."""


@dataclasses.dataclass
class PeerRun:
    """One engine's greedy decoding of one prompt."""

    engine: str
    """"llama.cpp" or "specdecode"."""
    mode: str
    """"plain", "lookup" (llama.cpp's prompt lookup) or our speculative configuration, e.g. "ngram adaptive"."""
    format: str
    """Weights as the engine runs them: the GGUF type for llama.cpp ("Q4_1"); for ours its kernels and dtype."""
    prompt: str
    """Which prompt ("category:index")."""
    prompt_tokens: int
    tokens: int
    """Tokens generated (llama-lookup may overshoot the limit by up to a draft)."""
    decode_tokens_per_s: float
    """Tokens after the first / seconds after the first token (module docstring)."""
    prompt_tokens_per_s: float
    """Prompt tokens / prefill seconds."""
    drafted: int = 0
    """Draft tokens proposed (speculative modes)."""
    accepted: int = 0
    """Draft tokens accepted."""
    eval_tokens_per_s: float | None = None
    """llama-completion's own eval tokens/s (its sampling left out), for reference."""
    text: str = ""
    """The generated text."""

    @property
    def name(self) -> str:
        return f"{self.engine} {self.mode} {self.format}"


_NUMBER = r"([0-9]+(?:\.[0-9]+)?)"
_PROMPT_EVAL = re.compile(rf"prompt eval time =\s*{_NUMBER} ms /\s*(\d+) tokens")
_EVAL = re.compile(rf"(?<!prompt )eval time =\s*{_NUMBER} ms /\s*(\d+) runs")
_SAMPLING = re.compile(rf"sampling time =\s*{_NUMBER} ms")
_LOOKUP = re.compile(rf"(encoded|decoded)\s+(\d+) tokens in\s+{_NUMBER} seconds")
_COUNTER = re.compile(r"\b(n_drafted|n_accept)\s*=\s*(\d+)")


def _last(pattern: re.Pattern, log: str, what: str) -> tuple[str, ...]:
    found = pattern.findall(log)
    if not found:
        raise ConfigError(f"llama.cpp printed no {what}; is it a build of scripts/build_llama_cpp.sh?")
    return found[-1] if isinstance(found[-1], tuple) else (found[-1],)


def parse_completion_log(log: str) -> dict:
    """llama-completion's perf print -> prompt and decode figures (the last print counts)."""
    p_ms, p_tokens = _last(_PROMPT_EVAL, log, "prompt eval time")
    e_ms, e_runs = _last(_EVAL, log, "eval time")
    (s_ms,) = _last(_SAMPLING, log, "sampling time")
    decode_seconds = (float(e_ms) + float(s_ms)) / 1000
    return {"prompt_tokens": int(p_tokens),
            "prompt_tokens_per_s": int(p_tokens) / (float(p_ms) / 1000),
            "eval_tokens_per_s": int(e_runs) / (float(e_ms) / 1000),  # llama.cpp's own figure, sampling left out
            "tokens": int(e_runs) + 1, "decode_tokens_per_s": int(e_runs) / decode_seconds}


def parse_lookup_log(log: str) -> dict:
    """llama-lookup's summary -> prompt and decode figures and its draft counters."""
    lines = {kind: (int(n), float(s)) for kind, n, s in _LOOKUP.findall(log)}
    if set(lines) != {"encoded", "decoded"}:
        raise ConfigError("llama-lookup printed no 'encoded/decoded N tokens in S seconds' lines")
    counters = dict(_COUNTER.findall(log))
    (p_tokens, p_seconds), (tokens, seconds) = lines["encoded"], lines["decoded"]
    return {"prompt_tokens": p_tokens,
            "prompt_tokens_per_s": p_tokens / p_seconds, "tokens": tokens,
            "decode_tokens_per_s": (tokens - 1) / seconds,
            "drafted": int(counters.get("n_drafted", 0)), "accepted": int(counters.get("n_accept", 0))}


class LlamaCpp:
    """The binaries of one llama.cpp build, run on one thread, greedy."""

    def __init__(self, bin_dir: str | Path, threads: int = 1):
        self.bin_dir = Path(bin_dir)
        self.threads = threads
        self._formats: dict[Path, str] = {}
        missing = [name for name in REQUIRED if not os.access(self.bin_dir / name, os.X_OK)]
        if missing:
            raise ConfigError(f"{self.bin_dir} has no {', '.join(missing)}: build llama.cpp with `{BUILD_SCRIPT} DEST` "
                              "and pass the bin directory it prints to --llama-cpp")

    def _run(self, binary: str, args: list[str]) -> tuple[str, str]:
        """(stdout, stderr) of one run (llama.cpp logs to stderr), or a one-line error."""
        done = subprocess.run([str(self.bin_dir / binary), *args], capture_output=True, text=True, errors="replace",
                              timeout=600, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise ConfigError(f"{binary} failed (exit {done.returncode}): {tail}")
        return done.stdout, done.stderr

    def _common(self, model: Path, prompt_file: Path, tokens: int, context: int, ignore_eos: bool = True) -> list[str]:
        return ["-m", str(model), "-bf", str(prompt_file), "--no-escape", "-n", str(tokens), "-c", str(context),
                "-t", str(self.threads), "-tb", str(self.threads), "--temp", "0", "--seed", "0",
                *(["--ignore-eos"] if ignore_eos else []),
                "--override-kv", "tokenizer.ggml.add_bos_token=bool:false"]

    def complete(self, model: Path, text: str, tokens: int, prompt_tokens: int, prompt: str = "",
                 ignore_eos: bool = True) -> PeerRun:
        """Plain greedy decoding of `tokens` tokens after the prompt text (of `prompt_tokens` ids); with
        ignore_eos=False it stops at an end-of-generation token."""
        with _prompt_file(text) as path:
            out, log = self._run("llama-completion", self._common(model, path, tokens, prompt_tokens + tokens + 16,
                                                                   ignore_eos) + ["-no-cnv", "--no-display-prompt"])
        return PeerRun("llama.cpp", "plain", self.weights_format(model), prompt,
                       text=out.removesuffix("\n\n").removesuffix(END_OF_TEXT), **parse_completion_log(log))

    def lookup(self, model: Path, text: str, tokens: int, prompt_tokens: int, draft: int, prompt: str = "",
               ignore_eos: bool = True) -> PeerRun:
        """Prompt lookup: n-grams of the context drafting at most `draft` tokens a step, verified greedily."""
        with _prompt_file(text) as path:
            out, log = self._run("llama-lookup", self._common(model, path, tokens, prompt_tokens + tokens + draft + 16,
                                                              ignore_eos) + ["--spec-draft-n-max", str(draft)])
        return PeerRun("llama.cpp", "lookup", self.weights_format(model), prompt, text=_echoed(out, text),
                       **parse_lookup_log(log))

    def speculative(self, model: Path, draft_model: Path, text: str, tokens: int, prompt_tokens: int, draft: int,
                    prompt: str = "") -> PeerRun:
        """llama-speculative: the draft model (same threads) drafting at most `draft` tokens a step, verified
        greedily; stops at an end-of-generation token."""
        if not os.access(self.bin_dir / "llama-speculative", os.X_OK):
            raise ConfigError(f"{self.bin_dir} has no llama-speculative: build it with `{BUILD_SCRIPT} DEST`")
        threads = [str(self.threads)] * 2
        with _prompt_file(text) as path:
            out, log = self._run("llama-speculative",
                                 self._common(model, path, tokens, prompt_tokens + tokens + draft + 16, False)
                                 + ["-md", str(draft_model), "-td", threads[0], "-tbd", threads[1],
                                    "--spec-draft-n-max", str(draft)])
        return PeerRun("llama.cpp", "speculative", self.weights_format(model), prompt, text=_echoed(out, text),
                       **parse_lookup_log(log))

    def weights_format(self, model: Path) -> str:
        """The GGUF's weight format as llama.cpp names it ("Q4_1"), from its general.file_type (read once)."""
        if model not in self._formats:
            import gguf

            from specdecode.model.gguf import open_gguf

            value = open_gguf(model).get("general.file_type")
            self._formats[model] = "unknown" if value is None else gguf.LlamaFileType(int(value)).name.removeprefix(
                "MOSTLY_")
        return self._formats[model]

    def pass_costs(self, model: Path, widths: list[int], repeats: int = 3) -> dict[int, float] | None:
        """Seconds of one batch of K prompt tokens for each K in widths (`llama-bench -p K -n 0`: a pass over K
        tokens from an empty context, the mean of `repeats`), or None without llama-bench in the build."""
        if not os.access(self.bin_dir / "llama-bench", os.X_OK):
            return None
        out, _ = self._run("llama-bench", ["-m", str(model), "-p", ",".join(map(str, widths)), "-n", "0",
                                           "-t", str(self.threads), "-r", str(repeats), "-o", "json"])
        return {int(row["n_prompt"]): row["avg_ns"] / 1e9 for row in json.loads(out)}

    def tokenize(self, model: Path, text: str) -> list[int]:
        """The ids llama.cpp gives the text (special tokens parsed, no BOS added), as llama-completion sees it."""
        with _prompt_file(text) as path:
            out, _ = self._run("llama-tokenize", ["-m", str(model), "-f", str(path), "--no-escape", "--no-bos", "--ids",
                                               "--log-disable"])
        found = re.search(r"\[([0-9,\s]*)\]", out)
        if found is None:
            raise ConfigError("llama-tokenize printed no id list")
        return [int(x) for x in found.group(1).split(",") if x.strip()]

    def requantize(self, model: Path, kind: str, into: Path) -> Path | None:
        """A `kind` (e.g. Q8_0) copy of a GGUF, made once into `into` (None without llama-quantize).

        From Q4_1 to Q8_0 this keeps the same weights nearly exactly: each Q4_1 value d*q + m moves to the nearest
        point of a Q8_0 grid whose step is the block's largest magnitude / 127, so by at most half that step, far
        under the Q4_1 step d (on SmolLM2-135M at most 5% of it). The Q8_0 row is thus the shipped model in another
        format, not the original bfloat16 weights quantized to 8 bits; its greedy text can still part from the
        Q4_1 file's where two logits are close."""
        quantize = self.bin_dir / "llama-quantize"
        if not os.access(quantize, os.X_OK):
            return None
        out = Path(into) / f"{Path(model).stem}.requantized-{kind}.gguf"
        if out.is_file() and out.stat().st_size > 0:
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        self._run("llama-quantize", ["--allow-requantize", str(model), str(partial), kind, str(self.threads)])
        os.replace(partial, out)
        return out


def _echoed(out: str, text: str) -> str:
    """The answer in the output of llama-lookup or llama-speculative, which echo the prompt's pieces first."""
    out = out.removeprefix("\n\n").removesuffix("\n\n\n\n").removeprefix(text)
    return out.removesuffix(END_OF_TEXT)


@contextlib.contextmanager
def _prompt_file(text: str):
    """The prompt text in a temporary file, bytes exactly as given (llama.cpp's -f would drop a final newline)."""
    handle, name = tempfile.mkstemp(prefix="specdecode-prompt-", suffix=".txt")
    with os.fdopen(handle, "wb") as f:
        f.write(text.encode("utf-8"))
    try:
        yield Path(name)
    finally:
        os.unlink(name)


def compare(runs: list[PeerRun], reference: str) -> list[dict]:
    """Per engine/mode/format (first-seen order): median tokens/s, and its decode tokens/s as a ratio to the
    reference row's on the same prompt (median and range over prompts); on how many prompts its greedy text is the
    reference's (over the shorter of the two), and the median number of leading characters they share."""
    ref = {r.prompt: r for r in runs if r.name == reference}
    groups: dict[str, list[PeerRun]] = {}
    for r in runs:
        groups.setdefault(r.name, []).append(r)
    out = []
    for name, rows in groups.items():
        paired = [r for r in rows if r.prompt in ref]
        ratios = [r.decode_tokens_per_s / ref[r.prompt].decode_tokens_per_s for r in paired]
        shared = [len(os.path.commonprefix([r.text, ref[r.prompt].text])) for r in paired]
        same = [n == min(len(r.text), len(ref[r.prompt].text)) for n, r in zip(shared, paired)]
        drafted = sum(r.drafted for r in rows)
        out.append({"name": name, "engine": rows[0].engine, "mode": rows[0].mode, "format": rows[0].format,
                    "prompts": len(rows),
                    "decode_tokens_per_s": statistics.median(r.decode_tokens_per_s for r in rows),
                    "prompt_tokens_per_s": statistics.median(r.prompt_tokens_per_s for r in rows),
                    "ratio_median": statistics.median(ratios) if ratios else None,
                    "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None),
                    "acceptance": sum(r.accepted for r in rows) / drafted if drafted else None,
                    "same_text": sum(same), "shared_chars": statistics.median(shared) if shared else None})
    return out
