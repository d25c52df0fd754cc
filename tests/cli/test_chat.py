"""`specdecode chat`: history through the chat template, streaming, /reset, Ctrl-D; old turns dropped to fit."""
import builtins
import re

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


def test_a_paste_is_one_message(tiny_models, monkeypatch, capsys):
    """A function pasted in a terminal in bracketed-paste mode arrives as one message, newlines kept (it was one
    message per line, each answered); so do lines between two lines of three quotes."""
    code, out, prompts = chat(monkeypatch, capsys, [
        "\x1b[200~def add(a, b):", "    return a + b", "\x1b[201~",  # the terminal's markers, line by line
        '"""', "class Stack:", "    pass", '"""',
        "what does it do?\x1b[200~\nx = 1\x1b[201~"],  # readline's bracketed paste: one line, newlines kept
        "--model", tiny_models["target"], "--max-tokens", 2, "--temperature", 0)
    assert code == 0 and len(prompts) == 3
    texts = [Tokenizer(tiny_models["target"]).decode(p, skip_special_tokens=False) for p in prompts]
    assert texts[0] == "<|user|>def add(a, b):\n    return a + b\n<|assistant|>"
    assert texts[1].endswith("<|user|>class Stack:\n    pass\n<|assistant|>")
    assert texts[2].endswith("<|user|>what does it do?\nx = 1\n<|assistant|>")


def test_each_answer_ends_with_its_figures(tiny_models, monkeypatch, capsys):
    """One line after each answer: tokens, tokens/s and how many tokens the drafts gave."""
    code, out, _ = chat(monkeypatch, capsys, ["hello", "again"], "--model", tiny_models["target"],
                        "--speculative-model", tiny_models["draft"], "--num-speculative-tokens", 3, "--no-adaptive",
                        "--max-tokens", 12, "--temperature", 0)
    lines = re.findall(r"^(\d+) tokens, [\d.]+ tokens/s; drafts gave (\d+) of them \(draft_model: \d+% of (\d+) "
                       r"drafted tokens accepted\)$", out, re.M)
    assert code == 0 and len(lines) == 2, out
    for tokens, gave, drafted in lines:
        assert 0 < int(gave) <= int(drafted) and int(gave) < int(tokens) <= 12
    code, out, _ = chat(monkeypatch, capsys, ["hello"], "--model", tiny_models["target"], "--max-tokens", 4)
    assert re.search(r"^\d+ tokens, [\d.]+ tokens/s$", out, re.M), out  # no speculation: no drafts to count


def test_ctrl_c_stops_the_answer_and_the_next_one_is_whole(tiny_models, monkeypatch, capsys):
    """Ctrl-C (a real SIGINT) mid-answer stops it between two steps; the next answer is the one a fresh chat gives
    (the stopped request gave its cache rows back)."""
    import os
    import signal

    from specdecode.cli import chat as chat_cli

    flags = ("--model", tiny_models["target"], "--max-tokens", 24, "--temperature", 0)
    _, fresh, _ = chat(monkeypatch, capsys, ["def add"], *flags)
    deltas = []
    real_print = print

    def write(*args, **kwargs):
        if args and args[0] not in ("", " [stopped]") and not str(args[0]).endswith("accepted)"):
            deltas.append(args[0])
            if len(deltas) == 2:
                os.kill(os.getpid(), signal.SIGINT)
        real_print(*args, **kwargs)

    answer = chat_cli.answer
    monkeypatch.setattr(chat_cli, "answer", lambda llm, conv, params, dim=False: answer(llm, conv, params, write, dim))
    code, out, prompts = chat(monkeypatch, capsys, ["def add", "/reset", "def add"], *flags)
    assert code == 0 and "[stopped]" in out and len(prompts) == 2
    first, second = out.split("[stopped]")
    assert "".join(deltas[:2]) in first and len(deltas) > 2  # stopped after two pieces; the next answer went on
    fresh_answer, fresh_figures = fresh.strip().splitlines()[-2:]
    assert fresh_answer in second and fresh_figures.split(",")[0] in second  # the whole answer, as a fresh chat
