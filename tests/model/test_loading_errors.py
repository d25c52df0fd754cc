"""Bad checkpoints fail early with a message naming the file or field to fix; sharded and reduced-precision
checkpoints load."""
import json
import shutil

import pytest
import torch

from specdecode.engine.llm import LLM
from specdecode.errors import CheckpointError, ConfigError, SpecdecodeError
from specdecode.model.loading import load_model
from specdecode.model.tokenizer import Tokenizer


@pytest.fixture
def ckpt(tiny_models, tmp_path):
    """A private copy of the tiny target checkpoint that a test may damage."""
    return shutil.copytree(tiny_models["target"], tmp_path / "ckpt")


def edit_config(ckpt, **changes):
    config = json.loads((ckpt / "config.json").read_text())
    config.update(changes)
    (ckpt / "config.json").write_text(json.dumps(config))


def test_unknown_architecture(ckpt):
    edit_config(ckpt, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match=r"model_type 'gpt2'.*config\.json.*llama") as info:
        load_model(ckpt)
    assert str(ckpt / "config.json") in str(info.value)


def test_missing_model_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_missing_model_file(ckpt, name):
    (ckpt / name).unlink()
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + " is missing"):
        load_model(ckpt)


def test_missing_tokenizer(ckpt):
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is missing"):
        LLM(model=ckpt, dtype="float32", device="cpu")


def test_corrupt_safetensors(ckpt):
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:200])  # truncated download
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupt"):
        load_model(ckpt)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json",
                                  "generation_config.json"])
def test_corrupt_json(ckpt, name):
    (ckpt / name).write_text('{"vocab_size": 30')
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        if name == "config.json":
            load_model(ckpt)
        else:
            Tokenizer(ckpt)


def test_pickled_weights_refused(ckpt):
    (ckpt / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2)}, ckpt / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pickled weights.*safetensors.*save_pretrained") as info:
        load_model(ckpt)
    assert "arbitrary code" in str(info.value)


@pytest.mark.parametrize("changes, detail", [
    ({"hidden_size": 96}, r"weight .* has shape"),
    ({"num_hidden_layers": 4}, r"missing \['model\.layers\.3"),
    ({"num_hidden_layers": 2}, r"unexpected \['model\.layers\.2"),
])
def test_weights_not_matching_config(ckpt, changes, detail):
    edit_config(ckpt, **changes)
    with pytest.raises(CheckpointError, match=detail) as info:
        load_model(ckpt)
    assert "config.json" in str(info.value)


@pytest.mark.parametrize("changes, field", [
    ({"num_attention_heads": 3, "num_key_value_heads": 2}, "num_key_value_heads"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling"),
])
def test_invalid_config_field(ckpt, changes, field):
    edit_config(ckpt, **changes)
    with pytest.raises(ConfigError, match=field) as info:
        load_model(ckpt)
    assert str(ckpt / "config.json") in str(info.value)


def test_dtype_typo(ckpt):
    with pytest.raises(ConfigError, match=r"dtype 'flaot16'.*bfloat16.*float16"):
        load_model(ckpt, dtype="flaot16")


def test_errors_are_specdecode_errors():
    """The CLI turns exactly these into one-line messages; they must share the base class."""
    assert issubclass(CheckpointError, SpecdecodeError) and issubclass(ConfigError, SpecdecodeError)


# -- checkpoints that must load ---------------------------------------------------------------------------------


def logits_of(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


IDS = [0, 5, 17, 42, 99, 3, 250, 7]


def test_sharded_checkpoint(tiny_models, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_models["target"], dtype=torch.float32)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    index = tmp_path / "sharded" / "model.safetensors.index.json"
    assert index.is_file() and not (tmp_path / "sharded" / "model.safetensors").exists()
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    assert len(shards) > 1
    ours = load_model(tmp_path / "sharded", dtype="float32")
    single = load_model(tiny_models["target"], dtype="float32")
    assert torch.equal(logits_of(ours, IDS), logits_of(single, IDS))

    (tmp_path / "sharded" / shards[-1]).unlink()
    with pytest.raises(CheckpointError, match=shards[-1].replace(".", r"\.") + r" is missing.*index\.json"):
        load_model(tmp_path / "sharded")
    index.write_text("{not json")
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json is corrupt"):
        load_model(tmp_path / "sharded")


@pytest.mark.parametrize("dtype, torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_reduced_precision_loading(tiny_models, dtype, torch_dtype):
    model = load_model(tiny_models["target"], dtype=dtype, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch_dtype}
    reference = logits_of(load_model(tiny_models["target"], dtype="float32"), IDS)
    logits = logits_of(model, IDS)
    assert torch.isfinite(logits).all()
    # Rounding the weights and activations moves logits a little, not the ranking of clear winners.
    assert (logits - reference).abs().max() < 0.05 * reference.abs().max()


def test_reduced_precision_checkpoint_upcast(tiny_models, tmp_path):
    """A checkpoint saved in bfloat16 loads in float32 with the same (rounded) values."""
    from specdecode.model.loading import save_model

    model = load_model(tiny_models["target"], dtype="float32")
    save_model(model, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_model(tmp_path / "bf16", dtype="float32")
    assert loaded.dtype == torch.float32
    expected = model.model.embed_tokens.weight.to(torch.bfloat16).float()
    assert torch.equal(loaded.model.embed_tokens.weight, expected)


def test_loading_builds_without_random_init_or_dynamo(tiny_models, tmp_path):
    """load_model builds on the meta device (no storage, no random init) and assigns the weights: nothing on that
    path may reach a meta-tensor decomposition, whose first use imports torch._dynamo (over a second per start)."""
    import subprocess
    import sys

    script = ("import sys, torch; from specdecode.model.loading import load_model; "
              f"model = load_model({str(tiny_models['target'])!r}, dtype='float32', device='cpu'); "
              "assert all(t.device.type == 'cpu' for t in [*model.parameters(), *model.buffers()]); "
              "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
