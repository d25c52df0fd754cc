"""`specdecode chat`: an interactive conversation in the terminal, rendered with the model's chat template and
streamed as it is generated. A pasted block (a function, a traceback) is one message whatever its newlines: the
terminal's bracketed paste marks it, through readline where Python has it; lines between two lines of three quotes
are one message too. /reset forgets the conversation; Ctrl-D (or /exit) leaves; Ctrl-C stops an answer. After each
answer one dim line says its tokens per second and how many of its tokens the drafts gave.
"""
from __future__ import annotations

import signal
import sys
import threading
import time

from specdecode.cli.model_flags import (add_model_args, add_quantization_arg, add_sampling_args, resolve_models,
                                        sampling_params, set_threads)
from specdecode.errors import SpecdecodeError

HELP = ("Type a message; a paste is one message (or put it between two lines of \"\"\"). /reset starts over, /exit or "
        "Ctrl-D leaves, Ctrl-C stops an answer.")
PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"
"""What a terminal in bracketed-paste mode writes around pasted text."""
FENCE = '"""'
"""A line of three quotes alone starts a multi-line message; the next one ends it."""
DIM, PLAIN = "\x1b[2m", "\x1b[0m"


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


def read_message(read=input, interactive: bool = False) -> str:
    """One message from the terminal: a line; a bracketed paste (however many lines, with or without readline
    holding it as one); or the lines between two lines of three quotes. Raises EOFError / KeyboardInterrupt."""
    more = "... " if interactive else ""
    line = read(">>> " if interactive else "")
    if line.strip() == FENCE:  # an explicit block: the lines up to the next fence
        lines = []
        while (line := read(more)).strip() != FENCE:
            lines.append(line)
        return "\n".join(lines)
    if PASTE_START in line:  # a paste the terminal marked, arriving line by line (no readline)
        lines = [line]
        while PASTE_END not in line:
            line = read("")
            lines.append(line)
        line = "\n".join(lines)
    return line.replace(PASTE_START, "").replace(PASTE_END, "")


def bracketed_paste() -> str:
    """Turn on the terminal's bracketed paste for the chat's input; returns what turns it off again. With readline
    (GNU's, 8.1+), readline does it and hands a paste over as one line, newlines kept; without, the terminal is told
    directly and read_message joins the marked lines."""
    try:
        import readline

        readline.parse_and_bind("set enable-bracketed-paste on")
        return ""
    except ImportError:
        sys.stdout.write("\x1b[?2004h")
        return "\x1b[?2004l"


class StopOnInterrupt:
    """While active, Ctrl-C sets `stopped` instead of raising: the answer ends between two steps, and the engine's
    caches stay whole for the next message (a KeyboardInterrupt raised inside a step could leave them half written).
    Only the main thread may set a signal handler: elsewhere (tests, notebooks) Ctrl-C raises as usual."""

    def __init__(self):
        self.stopped = False
        self.previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._stop)
        return self

    def _stop(self, signum, frame):
        self.stopped = True

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def answer(llm, conversation: Conversation, params, write=print, dim: bool = False) -> str:
    """Generate and stream the assistant's reply to the conversation; returns the reply (also added to it). Ctrl-C
    stops the reply where it is; then one line (dim on a terminal) of its figures."""
    budget = max(1, llm.max_model_len - params.max_tokens)
    ids = conversation.prompt_ids(llm.tokenizer, budget)
    reply = []
    start = time.perf_counter()
    first = None
    stream = llm.stream(ids, params)
    stopped = False
    try:
        with StopOnInterrupt() as interrupt:
            for delta in stream:
                first = first or time.perf_counter()
                reply.append(delta)
                write(delta, end="", flush=True)
                if interrupt.stopped:
                    break
            stopped = interrupt.stopped
    except KeyboardInterrupt:  # (raised where no handler could be set)
        stopped = True
    finally:
        stream.close()  # the engine releases the request's rows
    if stopped:
        write(" [stopped]", end="", flush=True)
    write()
    line = figures(llm.last_stats, time.perf_counter() - (first or start), llm.spec_config)
    write(f"{DIM}{line}{PLAIN}" if dim else line, flush=True)
    text = "".join(reply).strip()
    conversation.turns.append({"role": "assistant", "content": text})
    return text


def figures(stats, seconds: float, config) -> str:
    """The line after an answer: its tokens, their rate after the first (the prompt's prefill is not in it), and
    how many of them the drafts gave (tokens the target accepted from them; the rest came one per target pass)."""
    tokens = stats.emitted_tokens if stats is not None else 0
    rate = (tokens - 1) / seconds if tokens > 1 and seconds > 0 else 0.0
    line = f"{tokens} tokens, {rate:.1f} tokens/s"
    if config is not None and stats is not None:
        line += (f"; drafts gave {stats.accepted_tokens} of them ({config.method}: {stats.acceptance_rate:.0%} of "
                 f"{stats.draft_tokens} drafted tokens accepted)")
    return line


def cmd_chat(args) -> int:
    from specdecode.engine.llm import LLM

    set_threads(args.threads)
    params = sampling_params(args)
    model_dir, config, name = resolve_models(args)
    llm = LLM(model=model_dir, dtype=args.dtype, device=args.device, speculative_config=config, max_num_seqs=1,
              quantization=args.quantization)
    conversation = Conversation(args.system)
    interactive = sys.stdin.isatty()
    restore = ""
    if interactive:
        restore = bracketed_paste()
        print(f"specdecode chat with {name}. {HELP}")
    try:
        while True:
            try:
                message = read_message(input, interactive).strip()
            except (EOFError, KeyboardInterrupt):
                if interactive:
                    print()
                return 0
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
                answer(llm, conversation, params, dim=sys.stdout.isatty())
            except SpecdecodeError as exc:  # e.g. a message longer than the context: say so, keep chatting
                conversation.turns.pop()
                print(f"error: {exc}", file=sys.stderr)
    finally:
        if restore:
            sys.stdout.write(restore)
            sys.stdout.flush()
