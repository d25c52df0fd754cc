"""Structured output: a request's grammar (JSON schema, any JSON object, a regex, a Lark grammar or a list of
choices), compiled by llguidance, masks the target's logits at the root and at every node of a draft tree, from the
grammar's state after the node's own path, so that plain decoding and every speculative method sample the same
constrained distribution (a draft the grammar forbids has probability 0 there and is never accepted).

llguidance (MIT, Microsoft's guidance-ai; a Rust Earley parser with a token trie, no Python dependencies) was chosen
over xgrammar (Apache-2.0) because its wheel needs nothing else (xgrammar's pulls torch and transformers ranges that
would fight our pinned CPU torch) and its mask costs ~0.02-0.1 ms per position on SmolLM2's 49,152-token
vocabulary on this CPU, far under a decoding step.
"""
from __future__ import annotations

import json

import torch

from specdecode.errors import ConfigError
from specdecode.sampling import check_structured

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON comes as Python's json.dumps writes it (one space after , and :, no newlines): a small model left free to
choose whitespace can emit it forever; a schema's own "x-guidance" options override this."""


def _grammar_text(spec: dict) -> str:
    import llguidance

    kind, value = next(iter(spec.items()))
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_LAYOUT)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in value))
    return llguidance.LLMatcher.grammar_from_lark(value)


def lark_literal(text: str, tokenizer) -> str:
    """`text` as a Lark terminal that the model can write: the quoted text, or - when the tokenizer writes it as one
    token that llguidance holds as special (Qwen2.5's <tool_call>, an added token: llguidance matches such tokens
    only by id, never by their text) - that token, `<[id]>`."""
    import json

    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1 and _ll_tokenizer(tokenizer).is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def _ll_tokenizer(tokenizer):
    """llguidance's view of our tokenizer, built once per tokenizer (~0.3 s for SmolLM2's)."""
    import llguidance

    cached = getattr(tokenizer, "_llguidance", None)
    if cached is None:
        cached = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                        eos_token=list(tokenizer.eos_token_ids) or None)
        tokenizer._llguidance = cached
    return cached


class Grammar:
    """One request's grammar state: advanced by the tokens it emits; masks for a step's root and tree nodes."""

    def __init__(self, spec: dict, tokenizer, vocab_size: int):
        import llguidance

        check_structured(spec)
        try:
            text = _grammar_text(spec)
        except ValueError as exc:
            raise ConfigError(f"structured output: {exc}") from None
        self.tokenizer = _ll_tokenizer(tokenizer)
        self.matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if self.matcher.is_error():
            raise ConfigError(f"structured output: the grammar does not compile: {self.matcher.get_error()}")
        self.vocab_size = vocab_size
        self.words = (self.tokenizer.vocab_size + 31) // 32

    def copy(self) -> "Grammar":
        """An independent state at the same point (another choice of the same request)."""
        twin = object.__new__(Grammar)
        twin.__dict__.update(self.__dict__)
        twin.matcher = self.matcher.deep_copy()
        return twin

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (the request ends)."""
        return self.matcher.is_stopped()

    def consume(self, tokens: list[int]) -> None:
        for token in tokens:
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"structured output: token {token} was emitted against the grammar "
                                   f"({self.matcher.get_error()})")

    def forced(self, after: list[int] = ()) -> list[int]:
        """A draft of what the grammar forces next from the current state advanced by the tokens `after` (the
        state is left as it was; [] if the grammar rejects them): the forced bytes (e.g. a schema's next key and
        its quotes) as the tokenizer would write them. The tokens llguidance itself calls forced are accepted with
        probability 1; the rest of the bytes' tokenization is a guess the model almost always takes (it could
        spell the same bytes with other tokens, which the grammar allows too)."""
        after = list(after)
        taken = self.matcher.try_consume_tokens(after) if after else 0
        try:
            if taken != len(after) or self.matcher.is_stopped():
                return []
            tokens = list(self.matcher.compute_ff_tokens())
            guess = self.tokenizer.tokenize_bytes(self.matcher.compute_ff_bytes())
            return guess if len(guess) > len(tokens) and guess[:len(tokens)] == tokens else tokens
        finally:
            if taken:
                self.matcher.rollback(taken)

    def allowed_prefix(self, path: list[int]) -> int:
        """How many leading tokens of `path` the grammar allows from the current state (the state is left as it
        was)."""
        taken = self.matcher.try_consume_tokens(path) if path else 0
        if taken:
            self.matcher.rollback(taken)
        return taken

    def accepts(self, path: list[int]) -> bool:
        """Whether the grammar allows this run of tokens from the current state (the state is left as it was)."""
        return self.allowed_prefix(path) == len(path)

    def _mask(self, out: torch.Tensor) -> None:
        out[:] = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)[:self.words]

    def tree_masks(self, paths: list[list[int]]) -> torch.Tensor:
        """Allowed-token masks [len(paths), V] (bool) for positions after each path of tokens from the current
        state (a tree node's path from the root; [] is the root). A path the grammar rejects gets the root's
        mask: its node can never be accepted (its own token has probability 0 at its parent), so its row is
        never read."""
        words = torch.zeros(len(paths), self.words, dtype=torch.int32)
        for i, path in enumerate(paths):
            taken = self.matcher.try_consume_tokens(path) if path else 0
            if taken == len(path):
                self._mask(words[i])
            else:
                words[i] = words[0] if i else 0
            if taken:
                self.matcher.rollback(taken)
        bits = (words[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [N, words, 32]
        mask = bits.reshape(len(paths), -1)[:, :self.vocab_size].bool()
        if mask.shape[1] < self.vocab_size:  # the model's vocabulary is padded past the tokenizer's
            mask = torch.cat([mask, mask.new_zeros(len(paths), self.vocab_size - mask.shape[1])], 1)
        empty = ~mask.any(1)
        if empty.any():  # the grammar is complete: only end-of-sequence may follow
            mask[empty.nonzero()[:, :1], torch.tensor(self.tokenizer.eos_tokens)] = True
        return mask
