"""The converted copy of a GGUF: the first load writes it, later loads read it (without parsing the GGUF) and
give the same weights and tokenizer; a damaged, stale or half-written copy is never used but converted again."""
import os
import tempfile
from pathlib import Path

import pytest
import torch

from specdecode.errors import CheckpointError
from specdecode.model import gguf as gguf_module
from specdecode.model import gguf_cache
from specdecode.model.linear import linear_backend
from specdecode.model.loading import load_model, read_config
from specdecode.model.tokenizer import Tokenizer

from .gguf_files import tiny_model, write_gguf

pytest.importorskip("gguf")

CHATML = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")
TEXTS = ["def add(a, b):\n    return a + b\n", "numbers 1234567, unicode: café 東京 🙂", "<|bos|>special<|eos|> x",
         ""]
MESSAGES = [{"role": "user", "content": "hi there"}]


@pytest.fixture
def gguf_file(tiny_models, tmp_path) -> Path:
    """A Q4_1 llama GGUF with a chat template, alone in a folder of its own."""
    (tmp_path / "model").mkdir()
    return write_tiny_gguf(tmp_path / "model" / "tiny.gguf", tiny_models, seed=0)


def write_tiny_gguf(path: Path, tiny_models, seed: int) -> Path:
    vocab = Tokenizer(tiny_models["target"]).vocab_size
    return write_gguf(path, tiny_model("llama", vocab, seed=seed), tiny_models["tok"] / "tokenizer.json", "llama",
                      "Q4_1", pre="llama-bpe", chat_template=CHATML, add_bos=True)


@pytest.fixture
def no_gguf_parse(monkeypatch):
    """Make any parse of a GGUF fail the test (call it after the loads that may parse)."""

    def forbid():
        gguf_module._open_cached.cache_clear()
        monkeypatch.setattr(gguf_module, "GGUFCheckpoint", lambda path: pytest.fail(f"parsed {path}"))

    yield forbid
    gguf_module._open_cached.cache_clear()


def weights(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def tokenizer_outputs(tok: Tokenizer) -> tuple:
    return ([tok.encode(t) for t in TEXTS], [tok.decode(tok.encode(t), skip_special_tokens=False) for t in TEXTS],
            tok.apply_chat_template(MESSAGES), tok.encode_chat(MESSAGES), tok.special_tokens(), tok.eos_token_ids,
            tok.bos_token_id, tok.add_bos_token, tok.vocab_size)


def converted_files(gguf_path: Path) -> list[Path]:
    folder, = gguf_cache.cache_folders(Path(os.path.abspath(gguf_path)))
    return sorted(folder.glob(f"{gguf_path.stem}.specdecode-*"))


def test_second_load_reads_the_converted_file(gguf_file, capsys, no_gguf_parse):
    first = load_model(gguf_file, dtype="float32", device="cpu")
    first_tokenizer = tokenizer_outputs(Tokenizer(gguf_file))
    assert f"converting {gguf_file.name} to float32" in capsys.readouterr().err
    assert [p.name for p in converted_files(gguf_file)] == ["tiny.specdecode-float32.safetensors"]

    no_gguf_parse()
    second = load_model(gguf_file, dtype="float32", device="cpu")
    assert_same_weights(weights(second), weights(first))
    assert second.config == first.config and read_config(gguf_file) == first.config
    assert tokenizer_outputs(Tokenizer(gguf_file)) == first_tokenizer
    assert second.lm_head.weight is second.model.embed_tokens.weight  # still tied
    assert capsys.readouterr().err == ""  # a warm start says nothing


def test_each_dtype_has_its_own_file(gguf_file, capsys):
    full = weights(load_model(gguf_file, dtype="float32", device="cpu"))
    half = weights(load_model(gguf_file, dtype="bfloat16", device="cpu"))
    assert len(converted_files(gguf_file)) == 2
    assert_same_weights(half, {name: tensor.to(torch.bfloat16) for name, tensor in full.items()})
    capsys.readouterr()
    assert_same_weights(weights(load_model(gguf_file, dtype="bfloat16", device="cpu")), half)  # from its file
    int8 = load_model(gguf_file, dtype="bfloat16", device="cpu", quantization="int8")  # quantised after loading
    assert linear_backend(int8) == "int8"
    assert_same_weights(weights(int8), half)
    assert capsys.readouterr().err == ""


def corrupt_header_text(path: Path) -> None:
    """Change one character of the chat template stored in the file's metadata (the JSON header)."""
    data = bytearray(path.read_bytes())
    at = data.index(b"assistant")
    data[at] = ord("A")
    path.write_bytes(bytes(data))


def corrupt_tensor_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x40
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1000])


@pytest.mark.parametrize("damage, reason", [(truncate, "is unreadable"),
                                            (corrupt_tensor_byte, "weights fail their checksum"),
                                            (corrupt_header_text, "metadata fails its checksum")])
def test_damaged_file_is_converted_again(gguf_file, capsys, damage, reason):
    reference = weights(load_model(gguf_file, dtype="float32", device="cpu"))
    reference_tokenizer = tokenizer_outputs(Tokenizer(gguf_file))
    converted, = converted_files(gguf_file)
    damage(converted)
    capsys.readouterr()
    assert tokenizer_outputs(Tokenizer(gguf_file)) == reference_tokenizer  # from the GGUF: the copy is not trusted
    assert_same_weights(weights(load_model(gguf_file, dtype="float32", device="cpu")), reference)
    err = capsys.readouterr().err
    assert f"converting {gguf_file.name} to float32 (again: {converted.name} " in err and reason in err
    assert_same_weights(weights(load_model(gguf_file, dtype="float32", device="cpu")), reference)  # rebuilt
    assert capsys.readouterr().err == ""


def test_changed_gguf_is_converted_again(gguf_file, tiny_models, tmp_path, capsys):
    load_model(gguf_file, dtype="float32", device="cpu")
    other = write_tiny_gguf(tmp_path / "other.gguf", tiny_models, seed=1)
    assert other.stat().st_size == gguf_file.stat().st_size  # only the bytes differ
    expected = weights(load_model(other, dtype="float32", device="cpu"))
    gguf_file.write_bytes(other.read_bytes())
    capsys.readouterr()
    assert_same_weights(weights(load_model(gguf_file, dtype="float32", device="cpu")), expected)
    assert "is stale (tiny.gguf changed since it was converted)" in capsys.readouterr().err

    gguf_file.write_bytes(gguf_file.read_bytes()[:-5000])  # a cut GGUF is not hidden by its converted copy
    with pytest.raises(CheckpointError, match="is truncated"):
        load_model(gguf_file, dtype="float32", device="cpu")


def test_touched_gguf_keeps_its_conversion(gguf_file, capsys, monkeypatch, no_gguf_parse):
    reference = weights(load_model(gguf_file, dtype="float32", device="cpu"))
    stat = gguf_file.stat()
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # same bytes, new time (a copy, a touch)
    no_gguf_parse()
    assert_same_weights(weights(load_model(gguf_file, dtype="float32", device="cpu")), reference)  # re-hashed
    monkeypatch.setattr(gguf_cache, "sha256_file", lambda path: pytest.fail("hashed the GGUF again"))
    assert_same_weights(weights(load_model(gguf_file, dtype="float32", device="cpu")), reference)  # time noted
    assert capsys.readouterr().err.count("converting") == 1


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_interrupted_conversion_leaves_no_file(gguf_file, tmp_path, capsys, monkeypatch, failure):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))  # (the second place tried)

    def save_half(tensors, filename, metadata):
        Path(filename).write_bytes(b"\x00" * 1000)
        raise failure

    monkeypatch.setattr(gguf_cache, "save_file", save_half)
    if isinstance(failure, OSError):
        load_model(gguf_file, dtype="float32", device="cpu")  # loads all the same
        assert "could not keep the converted weights" in capsys.readouterr().err
    else:
        with pytest.raises(KeyboardInterrupt):
            load_model(gguf_file, dtype="float32", device="cpu")
    assert [p.name for p in gguf_file.parent.iterdir()] == [gguf_file.name]
    monkeypatch.undo()
    load_model(gguf_file, dtype="float32", device="cpu")
    assert "converting" in capsys.readouterr().err and len(converted_files(gguf_file)) == 1


def test_nothing_is_written_beside_the_gguf(gguf_file, tmp_path, capsys, monkeypatch, no_gguf_parse):
    """The converted copy of a float load lives in the specdecode cache, and a kept-quantized load (the default on
    CPUs) writes nothing at all: the user's folder holds only their file."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    from specdecode.model.quant import kernels
    if kernels() is not None:
        load_model(gguf_file, dtype="float32", device="cpu", quantization="gguf")
        assert not (tmp_path / "cache").exists()
    reference = weights(load_model(gguf_file, dtype="float32", device="cpu"))
    assert [p.name for p in gguf_file.parent.iterdir()] == [gguf_file.name]
    converted, = (tmp_path / "cache" / "converted").glob("*/tiny.specdecode-float32.safetensors")
    no_gguf_parse()
    assert_same_weights(weights(load_model(gguf_file, dtype="float32", device="cpu")), reference)
    Tokenizer(gguf_file)
    assert capsys.readouterr().err.count("converting") == 1
