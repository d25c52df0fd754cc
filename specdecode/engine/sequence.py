"""A request in flight (its tokens, cache slot, random numbers, statistics) and the outputs users receive."""
from __future__ import annotations

import dataclasses

import torch

from specdecode.model.tokenizer import IncrementalDetokenizer, Tokenizer
from specdecode.sampling import DRAFT, RequestRandom, SamplingParams, StepUniforms, TokenLogprob, raced


@dataclasses.dataclass
class SpecStats:
    """Counters of one request (or of many, summed). Rates are derived, never stored."""

    steps: int = 0
    """Target passes after prefill."""
    drafts: int = 0
    """Steps in which a non-empty draft was verified."""
    draft_tokens: int = 0
    """Draft tokens proposed (tree nodes)."""
    accepted_tokens: int = 0
    """Draft tokens accepted by the verifier."""
    emitted_tokens: int = 0
    """Tokens appended to the output (accepted + one correction/bonus per step, + the prefill token)."""
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)
    """accepted_per_pos[i]: steps whose accepted path reached depth i + 1."""
    draft_time: float = 0.0
    """Seconds spent proposing (wall time of the batched steps this request took part in)."""
    verify_time: float = 0.0
    """Seconds spent in target passes and verification."""

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (for a tree, proposed counts every node)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Tokens emitted per target step (accepted + 1), the quantity that buys the speedup."""
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0

    def record(self, report, row: int) -> None:
        """This request's row of a step's StepReport (engine/step.py)."""
        self.record_step(report.draft_lens[row], report.accepted_lens[row], report.draft_time, report.verify_time)

    def record_step(self, draft_len: int, accepted: int, draft_time: float, verify_time: float) -> None:
        self.steps += 1
        self.drafts += draft_len > 0
        self.draft_tokens += draft_len
        self.accepted_tokens += accepted
        self.draft_time += draft_time
        self.verify_time += verify_time
        if accepted > len(self.accepted_per_pos):
            self.accepted_per_pos.extend([0] * (accepted - len(self.accepted_per_pos)))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def merge(self, other: "SpecStats") -> None:
        for f in dataclasses.fields(self):
            if f.name != "accepted_per_pos":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        for i, n in enumerate(other.accepted_per_pos):
            if i < len(self.accepted_per_pos):
                self.accepted_per_pos[i] += n
            else:
                self.accepted_per_pos.append(n)

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(acceptance_rate=self.acceptance_rate, mean_accepted_len=self.mean_accepted_len)
        return out


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    """Per generated token, when SamplingParams.logprobs asked for them."""


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: SpecStats


class Sequence:
    """One request being generated. Invariant between steps: the target cache holds every token but the last."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer, eos_ids: list[int]):
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.token_ids = list(prompt_ids)
        self.num_prompt = len(prompt_ids)
        self.slot = -1
        self.reused = 0
        """Prompt tokens whose keys and values the slot already held when this request took it (prefix caching)."""
        self.prefilled = 0
        """Prompt tokens in its cache so far (reused, then chunks of a long prompt; the last prefill runs the rest)."""
        self.prefill_tokens = 0
        """Tokens the last prefill covered (the prompt; prompt and output so far for one recomputed after preemption)."""
        self.random = RequestRandom(params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,))))
        self.stats = SpecStats()
        self.eos_ids = (set() if params.ignore_eos else set(eos_ids)) | set(params.stop_token_ids or ())
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.text = ""
        self.text_shown = 0
        """Characters of text already returned by append (the rest is held back or not generated yet)."""
        self.stop_holdback = max(map(len, params.stop), default=1) - 1
        """Characters at the end of the text that may begin a stop string (0 without stop strings)."""
        self.finish_reason: str | None = None
        self.grammar = None
        """The request's structured-output state (speculation/grammar.py), set by the engine that made it."""
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        """Per generated token (SamplingParams.logprobs): kept in step with output_ids."""

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def uniforms(self, n: int) -> list[float]:
        """n uniforms of a plain sequence, for proposers whose draws are not tied to output positions."""
        return self.random.next(n)

    def step_uniforms(self) -> StepUniforms:
        """The verifier's uniforms for the next step (its first new token is output position num_generated)."""
        return StepUniforms(self.random, self.num_generated)

    def race_at(self, depth: int) -> tuple[int, int] | None:
        """(key, output position) of the race that decides the token a depth-`depth` draft guesses (0: the next
        step's first new token), or None when this request's tokens are not raced (greedy, or rejection sampled)."""
        return (self.random.key, self.num_generated + depth) if raced(self.params) else None

    def draft_uniforms(self, depth: int, count: int) -> list[float]:
        """Uniforms for drawing `count` drafts at tree depth `depth` of the next step: tied to the output position
        they guess, so a request's drafts do not depend on how deep other requests in its batch draft."""
        return [self.random.uniform(self.num_generated + depth, DRAFT, i) for i in range(count)]

    def append(self, new_ids: list[int], max_len: int, logprobs: list[TokenLogprob] | None = None) -> str:
        """Add generated tokens one at a time up to the first that ends the request: an EOS, the max_tokens-th or
        the context's last token, or one whose text completes a stop string (the text is cut before the stop
        string; the token stays, as in vLLM). Tokens after it are dropped. Returns the text that may be shown now.

        While stop strings are set, the last len(longest stop) - 1 characters are held back until the request
        finishes: they could be the start of a stop string the next tokens complete, and text once shown cannot
        be taken back. logprobs: one per new token, kept for the tokens kept."""
        params = self.params
        for i, token in enumerate(new_ids):
            self.token_ids.append(token)
            if self.logprobs is not None and logprobs is not None:
                self.logprobs.append(logprobs[i])
            if token in self.eos_ids:
                self.finish_reason = "stop"
            elif self.num_generated >= params.max_tokens or len(self.token_ids) >= max_len:
                self.finish_reason = "length"
            if self.grammar is not None and not self.finished:
                self.grammar.consume([token])
                if self.grammar.stopped:  # the grammar is complete: nothing more may follow
                    self.finish_reason = "stop"
            self._add_text(self.detokenizer.add([token], final=self.finished))
            if self.finished:
                break
        shown = len(self.text) if self.finished else max(self.text_shown, len(self.text) - self.stop_holdback)
        delta, self.text_shown = self.text[self.text_shown:shown], shown
        return delta

    def _add_text(self, delta: str) -> None:
        """Extend the text; a stop string it completes ends the request there."""
        if not delta:
            return
        # A match must end inside the new text, so it starts at most len(longest stop) - 1 characters before it.
        scan_from = max(0, len(self.text) - self.stop_holdback)
        self.text += delta
        hits = [i for i in (self.text.find(s, scan_from) for s in self.params.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.finish_reason = "stop"

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.token_ids[:self.num_prompt],
            outputs=[CompletionOutput(0, self.text, self.output_ids, self.finish_reason,
                                      None if self.logprobs is None else list(self.logprobs))],
            finished=self.finished, metrics=self.stats)
