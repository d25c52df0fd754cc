"""`specdecode chat`: an interactive conversation in the terminal, rendered with the model's chat template and
streamed as it is generated. /reset forgets the conversation; Ctrl-D (or /exit) leaves; Ctrl-C stops an answer.
"""
from __future__ import annotations

import sys

from specdecode.cli.model_flags import (add_model_args, add_quantization_arg, add_sampling_args, resolve_models,
                                        sampling_params, set_threads)
from specdecode.errors import SpecdecodeError

HELP = "Type a message. /reset starts over, /exit or Ctrl-D leaves, Ctrl-C stops an answer."


def register(sub) -> None:
    p = sub.add_parser("chat", help="chat with a model in the terminal (history, chat template, streaming)",
                       description="An interactive chat: each message is added to the conversation, rendered with "
                                   "the model's chat template and answered as it is generated. " + HELP)
    p.add_argument("--system", default=None, help="system prompt (default: the chat template's own, if any)")
    add_model_args(p)
    add_quantization_arg(p)
    add_sampling_args(p, temperature=0.2, top_p=0.9, max_tokens=512)
    p.set_defaults(func=cmd_chat)


class Conversation:
    """The messages so far; trims the oldest turns when the rendered prompt would not fit the context."""

    def __init__(self, system: str | None = None):
        self.system = system
        self.turns: list[dict] = []

    def messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def reset(self) -> None:
        self.turns = []

    def prompt_ids(self, tokenizer, budget: int) -> list[int]:
        """Token ids of the rendered conversation plus the generation prompt, dropping the oldest exchanges
        until it fits in `budget` tokens (the newest user message is always kept)."""
        while True:
            ids = tokenizer.encode_chat(self.messages())
            if len(ids) <= budget or len(self.turns) <= 1:
                return ids
            self.turns = self.turns[2:]  # one user message and its answer


def answer(llm, conversation: Conversation, params, write=print) -> str:
    """Generate and stream the assistant's reply to the conversation; returns the reply (also added to it)."""
    budget = max(1, llm.max_model_len - params.max_tokens)
    ids = conversation.prompt_ids(llm.tokenizer, budget)
    reply = []
    try:
        for delta in llm.stream(ids, params):
            reply.append(delta)
            write(delta, end="", flush=True)
    except KeyboardInterrupt:  # stop this answer, keep the conversation going
        write(" [stopped]", end="", flush=True)
    write()
    text = "".join(reply).strip()
    conversation.turns.append({"role": "assistant", "content": text})
    return text


def cmd_chat(args) -> int:
    from specdecode.engine.llm import LLM

    set_threads(args.threads)
    params = sampling_params(args)
    model_dir, config, name = resolve_models(args)
    llm = LLM(model=model_dir, dtype=args.dtype, device=args.device, speculative_config=config, max_num_seqs=1,
              quantization=args.quantization)
    conversation = Conversation(args.system)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"specdecode chat with {name}. {HELP}")
    while True:
        try:
            line = input(">>> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            if interactive:
                print()
            return 0
        message = line.strip()
        if not message:
            continue
        if message in ("/exit", "/quit", "/bye"):
            return 0
        if message == "/reset":
            conversation.reset()
            print("(conversation reset)")
            continue
        conversation.turns.append({"role": "user", "content": message})
        try:
            answer(llm, conversation, params)
        except SpecdecodeError as exc:  # e.g. a message longer than the context: say so, keep chatting
            conversation.turns.pop()
            print(f"error: {exc}", file=sys.stderr)
