"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF, fetched once per run): logits equal transformers' GGUF
loading in float32, token ids equal transformers' GGUF tokenizer on 1,000+ strings, config and chat template."""
import random

import pytest
import torch

from specdecode.model.linear import prepare_for_inference
from specdecode.model.loading import load_model
from specdecode.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()


@pytest.fixture(scope="module")
def ours(smollm2):
    return load_model(smollm2, dtype="float32", device="cpu"), Tokenizer(smollm2)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2):
    return transformers.AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)


def test_config_from_metadata(ours):
    config = ours[0].config
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.rope_theta, config.max_position_embeddings) == (49152, 1e5, 8192)
    assert config.tie_word_embeddings and config.model_type == "llama"
    tokenizer = ours[1]
    # EOS: <|im_end|> (the metadata's), and <|endoftext|>, a control token that ends generation in llama.cpp too
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids, tokenizer.add_bos_token) == (1, [0, 2], False)


@pytest.mark.slow
def test_logits_equal_transformers(smollm2, ours, hf_tokenizer):
    """Same weights bit for bit; logits within 1e-4 with the plain matmul backend. (oneDNN's prepacked float32
    kernels sum in another order: 1.2e-4 at logits of magnitude 38 was measured with them.)"""
    model, tokenizer = ours
    ids = torch.tensor([tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name,
                                                           dtype=torch.float32).eval()
    theirs = hf.state_dict()
    for name, weight in model.state_dict().items():
        assert torch.equal(weight, theirs[name]), name
    prepare_for_inference(model, "plain")
    try:
        with torch.no_grad():
            expected = hf(ids).logits
            logits = model(ids).logits
    finally:
        prepare_for_inference(model)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert hf_tokenizer.decode(logits[0, -1].argmax()) == "The"


def corpus(n: int = 1200) -> list[str]:
    """Chat text, code, unicode, runs of whitespace and special tokens, mixed at random (fixed seed)."""
    rng = random.Random(0)
    words = ["the", "capital", "of", "France", "is", "Paris", "don't", "we'll", "I'M", "hello", "world", "naïve",
             "café", "Straße", "東京", "北京市", "😀", "🙂👍🏽", "Привет", "مرحبا", "שלום", "ελληνικά", "नमस्ते", "한국어",
             "def", "fibonacci(n):", "return", "x+=1", "{'a': [1, 2]}", "0x1F", "3.14159", "1234567890",
             "2024-01-01", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<file_sep>", "\\n",
             "https://example.com/a?b=c", "e=mc^2", "—", "…", "\u200b", "\t", "\r\n"]
    spaces = [" ", "  ", "   ", "\t", "\n", "\n\n", " \n ", "\t\t", "    ", "\n    ", "\u00a0", "\u3000"]
    code = ["def add(a, b):\n    return a + b\n", "class Stack:\n    def __init__(self):\n        self.items = []\n",
            "for i in range(10):\n\tprint(i ** 2)  # square\n", "if x == 1:\n        pass\n    else:\n  y = '''doc'''",
            "#include <stdio.h>\nint main() { printf(\"%d\\n\", 42); }", "SELECT * FROM t WHERE id = 7;"]
    texts = list(code)
    chat = ["What is the capital of France?", "Write a Python function that reverses a string.",
            "Explain hash tables in two sentences.", "Can you help me?  Sure!!! 100% :)"]
    for question in chat:
        texts.append(f"<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
                     "<|im_start|>assistant\n")
    while len(texts) < n:
        parts = [rng.choice(words) + rng.choice(spaces if rng.random() < 0.3 else [" "])
                 for _ in range(rng.randint(1, 12))]
        if rng.random() < 0.2:
            parts.insert(rng.randint(0, len(parts)), rng.choice(code))
        text = "".join(parts)
        texts.append(text if rng.random() < 0.8 else rng.choice(spaces) + text + rng.choice(spaces))
    return texts


def test_token_ids_equal_transformers_gguf_tokenizer(ours, hf_tokenizer):
    tokenizer = ours[1]
    texts = corpus()
    assert len(texts) >= 1000
    mismatches = [t for t in texts if tokenizer.encode(t) != hf_tokenizer(t, add_special_tokens=True)["input_ids"]]
    assert not mismatches, f"{len(mismatches)} of {len(texts)} differ, e.g. {mismatches[:3]!r}"
    for text in texts[:200]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)


def test_chat_template_equals_transformers(ours, hf_tokenizer):
    tokenizer = ours[1]
    for messages in ([{"role": "user", "content": "hi"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]):
        expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tokenizer.apply_chat_template(messages) == expected
        assert tokenizer.encode_chat(messages) == hf_tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False)
