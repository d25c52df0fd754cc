"""GGUF checkpoints: logits equal transformers' own GGUF loading (and, unquantised, the model that was written),
for every architecture and tensor type; tokenizers equal transformers' GGUF tokenizer; damaged or unsupported
files fail with one line naming the file and what is supported."""
from pathlib import Path

import numpy as np
import pytest
import torch

from specdecode.errors import CheckpointError, ConfigError
from specdecode.model import gguf as gguf_module
from specdecode.model.loading import load_model
from specdecode.model.tokenizer import Tokenizer

from .gguf_files import tiny_model, write_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

REQUIRED_TYPES = ("F32", "F16", "Q8_0", "Q4_1", "Q4_K")
CASES = ([(variant, qtype) for variant in ("llama", "mistral", "qwen2", "qwen3") for qtype in REQUIRED_TYPES]
         + [("llama", qtype) for qtype in ("BF16", "Q4_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q2_K", "Q3_K")])
IDS = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 64, 128], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]])
CHATML = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def written(tiny_models, tmp_path_factory):
    """Write (once per module) the GGUF of a case: returns (path, the source model)."""
    root = tmp_path_factory.mktemp("gguf")
    tokenizer_json = tiny_models["tok"] / "tokenizer.json"
    vocab = Tokenizer(tiny_models["target"]).vocab_size
    made = {}

    def write(variant: str, qtype: str, **kwargs) -> tuple[Path, torch.nn.Module]:
        key = (variant, qtype, tuple(sorted(kwargs.items())))
        if key not in made:
            folder = root / f"{variant}-{qtype}-{len(made)}"
            folder.mkdir()
            model = tiny_model(variant, vocab, tied=variant != "qwen2")  # qwen2: a separate output matrix
            made[key] = (write_gguf(folder / "model.gguf", model, tokenizer_json, variant, qtype, **kwargs), model)
        return made[key]

    return write


def transformers_logits(path: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.slow
@pytest.mark.parametrize("variant, qtype", CASES, ids=[f"{v}-{q}" for v, q in CASES])
def test_logits_equal_transformers_gguf_loading(written, variant, qtype):
    path, source = written(variant, qtype)
    ours = load_model(path, dtype="float32", device="cpu")
    with torch.no_grad():
        logits = ours(IDS).logits
    expected = transformers_logits(path)
    assert logits.abs().max() > 1.0  # a real signal, not all zeros
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    if qtype == "F32":  # unquantised: the model that was written, so the q/k permutation is undone exactly
        with torch.no_grad():
            torch.testing.assert_close(logits, source(IDS).logits, atol=1e-4, rtol=0)


def test_qk_permutation_matters(written, monkeypatch, tmp_path):
    """Negative control: without undoing llama.cpp's q/k row permutation the logits are far off."""
    path, source = written("llama", "F32")
    copy = tmp_path / "model.gguf"  # a file without a converted copy, which would hold the right weights
    copy.write_bytes(path.read_bytes())
    monkeypatch.setattr(gguf_module, "unpermute_rows", lambda weight, heads: weight)
    wrong = load_model(copy, dtype="float32", device="cpu")
    with torch.no_grad():
        assert (wrong(IDS).logits - source(IDS).logits).abs().max() > 1e-2


def test_config_from_metadata(written):
    path, source = written("qwen3", "Q8_0")
    config = load_model(path, dtype="float32", device="cpu").config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rope_theta", "tie_word_embeddings", "qk_norm", "model_type"):
        assert getattr(config, field) == getattr(source.config, field), field


def test_dtype_and_directory(written, tmp_path):
    path, _ = written("llama", "Q4_1")
    model = load_model(path.parent, dtype="bfloat16", device="cpu")  # a directory holding one .gguf
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    (tmp_path / "a.gguf").write_bytes(path.read_bytes())
    (tmp_path / "b.gguf").write_bytes(path.read_bytes())
    with pytest.raises(CheckpointError, match=r"holds 2 GGUF files \(a\.gguf, b\.gguf\); pass the one"):
        load_model(tmp_path)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="is a file but not a GGUF"):
        load_model(tmp_path / "notes.txt")


def one_line(exc) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_truncated_file(written, tmp_path):
    """A GGUF cut anywhere (in its header or metadata, in its tensor data) fails with one line saying how much of
    it is missing, not with the reader's numpy error."""
    path, _ = written("llama", "Q8_0")
    data = path.read_bytes()
    reader = gguf.GGUFReader(str(path))
    header_cuts = (0, 10,  # the magic, the version and the counts
                   reader.fields["general.architecture"].offset + 3, reader.fields["tokenizer.ggml.tokens"].offset + 99,
                   reader.tensors[-1].field.offset + 5)  # metadata, the token list, the last tensor's description
    for cut in header_cuts:
        message = truncated_message(tmp_path, data, cut)
        assert "ends inside its header, which needs at least" in message and f"the file has {cut:,}" in message
    for cut in (reader.data_offset + 10, len(data) // 2, len(data) - 1):  # tensor data
        message = truncated_message(tmp_path, data, cut)
        assert (f"its header describes {len(data):,} bytes, the file has {cut:,} ({len(data) - cut:,} missing)"
                in message)


def truncated_message(tmp_path: Path, data: bytes, cut: int) -> str:
    damaged = tmp_path / f"cut{cut}.gguf"
    damaged.write_bytes(data[:cut])
    with pytest.raises(CheckpointError) as info:
        load_model(damaged, dtype="float32")
    message = one_line(info)
    assert message.startswith(f"{damaged} is truncated: ") and message.endswith("; download it again")
    assert "reshape" not in message and "dtype" not in message
    return message


def test_corrupt_magic(written, tmp_path):
    path, _ = written("llama", "Q8_0")
    damaged = tmp_path / "bad.gguf"
    damaged.write_bytes(b"GGXX" + path.read_bytes()[4:])
    with pytest.raises(CheckpointError) as info:
        load_model(damaged, dtype="float32")
    assert str(damaged) in one_line(info) and "corrupt" in str(info.value)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError) as info:
        load_model(path)
    assert "'phi2' is not supported" in one_line(info) and "llama, qwen2, qwen3" in str(info.value)


def test_unsupported_tensor_type(written, tmp_path, monkeypatch):
    source, _ = written("llama", "Q8_0")
    path = tmp_path / "model.gguf"  # a file without a converted copy
    path.write_bytes(source.read_bytes())
    monkeypatch.setattr(gguf_module, "SUPPORTED_TENSOR_TYPES", ("F32", "F16"))
    with pytest.raises(ConfigError) as info:
        load_model(path)
    assert "type Q8_0, which specdecode cannot dequantise; supported: F32, F16" in one_line(info)


@pytest.mark.parametrize("pre", ["default", "smollm", "qwen2", "llama-bpe"])
def test_tokenizer_equals_transformers_gguf_tokenizer(written, pre):
    path, _ = written("llama", "Q8_0", pre=pre, chat_template=CHATML)
    ours = Tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = ["def add(a, b):\n    return a + b\n", "  leading spaces and\ttabs\n\n\nnewlines   ",
             "numbers 1234567 and 3.14159, unicode: café 東京 🙂 — ok", "<|bos|>special<|eos|> tokens<|pad|>",
             "Speculative decoding's verifier; it'll accept, we've seen. I'M LOUD", ""]
    for text in texts:
        assert ours.encode(text) == theirs(text, add_special_tokens=True)["input_ids"], (pre, text)
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
    messages = [{"role": "user", "content": "hi there"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages, tokenize=False,
                                                                            add_generation_prompt=True)
    assert ours.bos_token == "<|bos|>" and ours.eos_token == "<|eos|>" and ours.eos_token_ids == [1]


def test_llm_on_a_gguf_generates_as_on_the_hf_checkpoint(tiny_models, tmp_path):
    """The tiny target written as an F32 GGUF (weights and tokenizer) decodes exactly like its HF directory."""
    from specdecode.engine.llm import LLM
    from specdecode.sampling import SamplingParams

    source = load_model(tiny_models["target"], dtype="float32", device="cpu")
    path = write_gguf(tmp_path / "target.gguf", source, tiny_models["target"] / "tokenizer.json", "llama", "F32",
                      add_bos=True)  # as the directory's tokenizer_config.json says
    params = SamplingParams(temperature=0, max_tokens=12)
    prompts = ["def add(a, b):", "class Point:\n"]
    from_gguf = LLM(model=path, dtype="float32", device="cpu").generate(prompts, params)
    from_dir = LLM(model=tiny_models["target"], dtype="float32", device="cpu").generate(prompts, params)
    assert [o.outputs[0].token_ids for o in from_gguf] == [o.outputs[0].token_ids for o in from_dir]
    assert [o.prompt_token_ids for o in from_gguf] == [o.prompt_token_ids for o in from_dir]


def test_llama3_rope_freqs(tiny_models, tmp_path):
    """Llama 3.1+ GGUFs carry their rope scaling as a rope_freqs tensor: it becomes the llama3 rope_scaling."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    vocab = Tokenizer(tiny_models["target"]).vocab_size
    source = tiny_model("llama", vocab, rope_scaling=scaling, rope_theta=500000.0)
    plain = tiny_model("llama", vocab, rope_theta=500000.0).config
    rope_freqs = (plain.inv_freq() / source.config.inv_freq()).numpy()
    assert rope_freqs.min() == 1.0 and rope_freqs.max() == 8.0  # some frequencies are scaled, some not
    path = write_gguf(tmp_path / "llama3.gguf", source, tiny_models["tok"] / "tokenizer.json", "llama", "F32",
                      rope_freqs=rope_freqs)
    ours = load_model(path, dtype="float32", device="cpu")
    assert ours.config.rope_scaling == scaling
    positions = torch.arange(200, 210).expand(2, 10)  # far positions, where the scaling matters
    with torch.no_grad():
        logits = ours(IDS, positions=positions).logits
        torch.testing.assert_close(logits, source(IDS, positions=positions).logits, atol=1e-4, rtol=0)
        unscaled = tiny_model("llama", vocab, rope_theta=500000.0)  # same weights (same seed), no scaling
        assert (logits - unscaled(IDS, positions=positions).logits).abs().max() > 1e-3
    damaged = write_gguf(tmp_path / "odd.gguf", source, tiny_models["tok"] / "tokenizer.json", "llama", "F32",
                         rope_freqs=rope_freqs[::-1].copy())
    with pytest.raises(ConfigError) as info:
        load_model(damaged)
    assert "rope_freqs tensor is not Llama 3 rope scaling" in one_line(info) and str(damaged) in str(info.value)
