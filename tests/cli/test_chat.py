"""`specdecode chat`: history through the chat template, streaming, /reset, Ctrl-D; old turns dropped to fit."""
import builtins

import pytest

from specdecode.cli import main
from specdecode.cli.chat import Conversation
from specdecode.engine.llm import LLM
from specdecode.model.tokenizer import Tokenizer


def chat(monkeypatch, capsys, lines, *argv):
    """Run `specdecode chat` on typed lines (then Ctrl-D); returns (exit code, stdout + stderr, prompts it
    generated for)."""
    typed = iter(lines)

    def fake_input(prompt=""):
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None

    prompts = []
    stream = LLM.stream
    monkeypatch.setattr(builtins, "input", fake_input)
    monkeypatch.setattr(LLM, "stream", lambda self, ids, params: prompts.append(ids) or stream(self, ids, params))
    code = main(["chat", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out + err, prompts


def test_history_reset_and_ctrl_d(tiny_models, monkeypatch, capsys):
    code, out, prompts = chat(monkeypatch, capsys, ["hello", "again", "/reset", "fresh"],
                              "--model", tiny_models["target"], "--max-tokens", 3, "--temperature", 0)
    assert code == 0  # Ctrl-D (EOF) leaves cleanly
    tokenizer = Tokenizer(tiny_models["target"])
    texts = [tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
    assert len(texts) == 3 and "(conversation reset)" in out
    assert texts[0] == "<|user|>hello\n<|assistant|>"
    assert texts[1].startswith("<|user|>hello\n<|assistant|>") and texts[1].endswith("<|user|>again\n<|assistant|>")
    assert texts[2] == "<|user|>fresh\n<|assistant|>"  # /reset forgot the first two turns


def test_exit_command_and_errors_keep_chatting(tiny_models, monkeypatch, capsys):
    long_message = "def add(a, b): return a + b " * 200  # longer than the tiny model's context
    code, out, prompts = chat(monkeypatch, capsys, [long_message, "hi", "/exit", "never read"],
                              "--model", tiny_models["target"], "--max-tokens", 2)
    assert code == 0 and len(prompts) == 2  # "never read" was not: /exit left
    assert "error: the prompt has" in out and "shorten the prompt" in out
    assert Tokenizer(tiny_models["target"]).decode(prompts[1], skip_special_tokens=False) == "<|user|>hi\n<|assistant|>"


def test_old_turns_dropped_to_fit(tiny_models):
    tokenizer = Tokenizer(tiny_models["target"])
    conversation = Conversation()
    for i in range(6):
        conversation.turns += [{"role": "user", "content": f"question {i} " * 5},
                               {"role": "assistant", "content": f"answer {i} " * 5}]
    conversation.turns.append({"role": "user", "content": "last one"})
    full = len(tokenizer.encode_chat(conversation.messages()))
    ids = conversation.prompt_ids(tokenizer, budget=full // 2)
    assert len(ids) <= full // 2
    assert conversation.turns[-1]["content"] == "last one" and conversation.turns[0]["role"] == "user"


def test_smollm2_chats(smollm2, monkeypatch, capsys):
    code, out, _ = chat(monkeypatch, capsys, ["What is the capital of France? Answer in one sentence."], "--max-tokens", 12,
                        "--temperature", 0, "--dtype", "float32", "--model", "smollm2-135m-instruct")
    assert code == 0 and "Paris" in out
