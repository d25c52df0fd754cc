"""Hugging Face transformers' generate() on the same checkpoints, as a peer in the same run: plain decoding,
assisted generation (assistant_model = the same draft) and prompt lookup (prompt_lookup_num_tokens).

Batch 1; greedy (or sampling at a temperature, seeded per request); EOS either ends generation or, with
ignore_eos (like specdecode's), never does, so that every engine makes the same number of tokens. A streamer
times the tokens as generate() hands them out, with the same latency rule as specdecode's engines
(specdecode.bench.measure).
"""
from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from specdecode.bench.measure import LatencyClock, Trace

PEER_MODES = ("plain", "assisted", "prompt_lookup")


class _ClockStreamer:
    """transformers streamer interface: put() gets the prompt first, then each batch of new tokens."""

    def __init__(self):
        self.clock = LatencyClock()
        self.saw_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self.saw_prompt:
            self.saw_prompt = True
            return
        self.clock.delivered(value.numel())

    def end(self) -> None:
        pass


class TransformersEngine:
    """One transformers configuration: mode "plain", "assisted" (needs draft_dir) or "prompt_lookup"."""

    def __init__(self, mode: str, target_dir: Path, draft_dir: Path | None = None, prompt_lookup_num_tokens: int = 10,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", shared_target=None,
                 ignore_eos: bool = True):
        import transformers

        from specdecode.model.gguf import transformers_source

        if mode not in PEER_MODES:
            raise ValueError(f"unknown transformers mode {mode!r}; choose from {', '.join(PEER_MODES)}")
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.mode = mode
        self.device = torch.device(device)
        source, kwargs = transformers_source(target_dir)  # a GGUF target is read by transformers' GGUF loader
        self.model = shared_target or transformers.AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, **kwargs).to(self.device).eval()
        self.assistant = None
        config = copy.deepcopy(self.model.generation_config)
        config.do_sample = False
        if ignore_eos:
            config.eos_token_id = None  # EOS ends nothing: every engine generates exactly max_new_tokens
        config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
        for name in ("temperature", "top_p", "top_k"):  # unset, so greedy does not warn about sampling options
            setattr(config, name, None)
        if mode == "assisted":
            if draft_dir is None:
                raise ValueError("assisted generation needs the draft checkpoint")
            self.assistant = transformers.AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).to(
                self.device).eval()
        elif mode == "prompt_lookup":
            config.prompt_lookup_num_tokens = prompt_lookup_num_tokens
        self.config = config

    def settings(self) -> dict:
        """What this engine was run with (transformers' defaults filled in where unset), for the report."""
        out = {"mode": self.mode, "eos_ends_generation": self.config.eos_token_id is not None}
        if self.assistant is not None:
            assistant_config = self.assistant.generation_config
            defaults = getattr(assistant_config, "_get_default_generation_params", dict)()
            for name in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold"):
                value = getattr(assistant_config, name, None)
                out[name] = value if value is not None else defaults.get(name)
        if self.config.prompt_lookup_num_tokens:
            out.update(prompt_lookup_num_tokens=self.config.prompt_lookup_num_tokens,
                       max_matching_ngram_size=self.config.max_matching_ngram_size or 2)
        return out

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0) -> Trace:
        """One request; temperature > 0 samples from the target's distribution at that temperature (no top-k or
        top-p), seeded."""
        ids = torch.tensor([prompt_ids], device=self.device)  # [1, S]
        config = copy.copy(self.config)
        config.max_new_tokens = max_new_tokens
        if temperature > 0:
            torch.manual_seed(seed)
            config.do_sample, config.temperature, config.top_k, config.top_p = True, temperature, 0, 1.0
        streamer = _ClockStreamer()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                  assistant_model=self.assistant, streamer=streamer)
        clock = streamer.clock
        seconds = time.perf_counter() - clock.start
        return Trace(out[0, len(prompt_ids):].tolist(), seconds, clock.ttft or seconds, clock.latencies)
