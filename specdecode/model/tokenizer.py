"""Tokenizer of a checkpoint: tokenizer.json (the `tokenizers` library) plus tokenizer_config.json
(special tokens, chat template) and generation_config.json (EOS ids), or the same read from a GGUF file;
and an incremental detokenizer for streaming whose work per token does not grow with the text.
"""
from __future__ import annotations

import functools

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from specdecode.errors import CheckpointError
from specdecode.model.gguf import find_gguf
from specdecode.model.gguf_cache import gguf_tokenizer_spec


def _read_json(path: Path, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path} is missing")
        return {}
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); re-save the checkpoint") from exc


def _token_content(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialisation
        return value.get("content")
    return value


class Tokenizer:
    """A checkpoint's tokenizer: from a Hugging Face directory (tokenizer.json + configs) or a GGUF's metadata."""

    def __init__(self, model_dir: str | Path, config_eos: list[int] | None = None):
        model_dir = Path(model_dir)
        gguf_path = find_gguf(model_dir)
        if gguf_path is not None:
            spec = gguf_tokenizer_spec(gguf_path)
            self.backend = spec.backend
            self.bos_token, self.eos_token, self.pad_token = spec.bos_token, spec.eos_token, spec.pad_token
            self.add_bos_token = spec.add_bos_token
            self.chat_template = spec.chat_template
            eos_ids = list(spec.eos_token_ids)
        else:
            eos_ids = self._read_hf_dir(model_dir)
        self.bos_token_id = self.backend.token_to_id(self.bos_token) if self.bos_token else None
        self.pad_token_id = self.backend.token_to_id(self.pad_token) if self.pad_token else None
        if self.eos_token and self.backend.token_to_id(self.eos_token) is not None:
            eos_ids.append(self.backend.token_to_id(self.eos_token))
        eos_ids += config_eos or []
        self.eos_token_ids = sorted(set(eos_ids))

    def _read_hf_dir(self, model_dir: Path) -> list[int]:
        """Set the backend and special tokens from tokenizer.json and its configs; returns the EOS ids of
        generation_config.json."""
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: specdecode needs a fast tokenizer (tokenizer.json)")
        try:
            self.backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises its own exception type
            raise CheckpointError(f"{path} is corrupt ({exc}); re-save the tokenizer") from exc
        cfg = _read_json(model_dir / "tokenizer_config.json", required=False)
        gen = _read_json(model_dir / "generation_config.json", required=False)
        self.bos_token = _token_content(cfg.get("bos_token"))
        self.eos_token = _token_content(cfg.get("eos_token"))
        self.pad_token = _token_content(cfg.get("pad_token"))
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        self.chat_template = cfg.get("chat_template")
        eos = gen.get("eos_token_id")
        return ([eos] if isinstance(eos, int) else list(eos)) if eos is not None else []

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab()

    def special_tokens(self) -> dict[str, str | None]:
        return {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE token may be part of a UTF-8 character, which decode()
        would show as U+FFFD); other tokenizers: the UTF-8 of its decoded text."""
        piece = self.backend.id_to_token(token)
        decoder = _byte_decoder()
        if piece is not None and all(ch in decoder for ch in piece):
            return bytes(decoder[ch] for ch in piece)
        return self.backend.decode([token], skip_special_tokens=False).encode("utf-8")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Render chat messages with the checkpoint's Jinja chat template (a plain fallback if it has none).
        tools: function definitions in OpenAI's shape, for a template that writes them into the prompt (as
        transformers passes them: the template sees `tools`, None without)."""
        if not self.chat_template:
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
        return _compiled_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation rendered with the chat template (which writes any BOS itself)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str):
    """A chat template compiled once (compiling SmolLM2's costs 3.8 ms, ~13x a render and encode)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # A checkpoint's template is untrusted code: sandboxed, it cannot reach Python objects' internals (as
    # refusing pickled weights would be pointless otherwise). raise_exception is what HF templates call.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_template_error
    env.filters["tojson"] = _tojson
    return env.from_string(source)


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for the 256 byte values (GPT-2's table), inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    """transformers' tojson for chat templates: plain json.dumps, where jinja2's own escapes <, >, & and ' for
    HTML (a tool's description or a call's arguments would reach the model as \\u003c...)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_template_error(message: str):
    import jinja2

    raise jinja2.TemplateError(message)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, decoding only a short window each time.

    A multi-byte character split across tokens decodes to U+FFFD until its last byte arrives, so text is held
    back while the window ends in U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-4:]) if prompt_ids else []  # context for spaces/merges
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, new_ids: list[int], final: bool = False) -> str:
        """Text added by new_ids; final=True also releases text held back for an incomplete character."""
        self.ids.extend(new_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if (full.endswith("\ufffd") and not final) or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return delta
