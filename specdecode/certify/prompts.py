"""Prompts for `specdecode certify`: held-out ShareGPT first turns when the data set is in the cache (or asked for),
else a small built-in set of chat prompts; rendered with the model's chat template and cut to a token budget."""
from __future__ import annotations

from specdecode.errors import ConfigError

BUILTIN = [
    "What is the capital of France?",
    "Explain how a hash table works.",
    "Write a Python function that reverses a linked list.",
    "Give me three tips for a job interview.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What is the difference between a virus and a bacterium?",
    "Write a short poem about the sea.",
    "How do I make a cup of green tea?",
    "Translate 'good morning, how are you?' into Spanish.",
    "Why is the sky blue?",
    "List the planets of the solar system in order.",
    "What does HTTP stand for, and what is it used for?",
    "Write an email asking my manager for a day off.",
    "How does compound interest work? Give an example.",
    "Suggest a name for a coffee shop run by cats.",
    "What are the main causes of climate change?",
    "Explain recursion to a ten-year-old.",
    "Write a SQL query that counts the orders of each customer.",
    "What should I pack for a weekend hiking trip?",
    "Describe the water cycle.",
    "How do vaccines train the immune system?",
    "Tell me a joke about programmers.",
    "What is the Pythagorean theorem?",
    "Give me a recipe for pancakes.",
]
"""Used when ShareGPT is not in the cache: everyday chat requests of the kind the default model answers."""

SOURCES = ("auto", "sharegpt", "builtin")


def prompt_texts(source: str, count: int) -> tuple[list[str], str]:
    """Up to `count` user messages and the name of where they came from. auto = ShareGPT's held-out first turns
    if the data set is already downloaded, else the built-in set; sharegpt fetches it if needed."""
    if source not in SOURCES:
        raise ConfigError(f"--prompts must be one of {', '.join(SOURCES)}, got {source!r}")
    if source == "builtin" or (source == "auto" and not _sharegpt_cached()):
        return BUILTIN[:count], "builtin"
    from specdecode.catalog import sharegpt

    texts = []
    for record in sharegpt.iter_records(sharegpt.fetch(quiet=True)):
        conversation = sharegpt.to_conversation(record)
        if conversation is None or not sharegpt.is_heldout(conversation.base_id):
            continue
        first = next(m["content"] for m in conversation.messages if m["role"] == "user")
        texts.append(first)
        if len(texts) == count:
            break
    return texts, "sharegpt-heldout"


def _sharegpt_cached() -> bool:
    from specdecode.catalog.registry import cache_dir
    from specdecode.catalog import sharegpt

    dataset = sharegpt._dataset()
    path = cache_dir() / "data" / "sharegpt" / dataset.member.rsplit("/", 1)[-1]
    return path.is_file() and path.stat().st_size == dataset.size


def prompt_ids(tokenizer, texts: list[str], max_prompt_tokens: int) -> list[list[int]]:
    """Each text as one user turn in the chat template, keeping the last max_prompt_tokens tokens (the end of the
    template, which asks for the answer, is what matters)."""
    out = []
    for text in texts:
        ids = tokenizer.encode_chat([{"role": "user", "content": text}])
        if ids:
            out.append(ids[-max_prompt_tokens:])
    if not out:
        raise ConfigError("no usable prompt: every prompt encoded to zero tokens")
    return out
