"""Sampling parameters, logits -> processed probabilities (temperature, top-k, top-p), and each request's random
numbers.

Plain decoding, the draft proposers and the verifier all call `processed_probs`, so the distribution the
verifier preserves is exactly the one plain sampling draws from.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from specdecode.errors import ConfigError

SAMPLERS = ("auto", "race", "rejection")
"""SamplingParams.sampler's choices."""
MIN_TEMPERATURE = 1e-5
"""Temperatures below this are greedy: logits / 1e-40 overflow to inf and softmax would give NaN."""
MAX_TOP_K = 2**31 - 1
"""Largest top_k accepted (any k >= the vocabulary keeps every token; larger ones cannot become tensors)."""
MAX_N = 16
"""Most completions one request may ask for (SamplingParams.n)."""
MAX_LOGPROBS = 20
"""Most alternatives `logprobs` may ask for per token (OpenAI's top_logprobs limit)."""
TRUNCATION_CANDIDATES = (256, 4096)
"""Top-k/top-p rank this many of a row's most likely tokens first (then the next number), and sort the whole row
only if they are not enough to decide it."""


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
"""SamplingParams.structured's keys: exactly one of them."""


def check_structured(spec: dict) -> None:
    """A clear error for a structured-output spec of the wrong shape (its grammar is checked when compiled)."""
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in STRUCTURED_KINDS:
        raise ConfigError(f"structured must be a dict with exactly one of {', '.join(STRUCTURED_KINDS)}, "
                          f"got {spec!r}")
    kind, value = next(iter(spec.items()))
    if kind == "json_schema" and not isinstance(value, (dict, bool)):
        raise ConfigError("structured json_schema must be a JSON schema (a dict)")
    if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
        raise ConfigError(f"structured {kind} must be a non-empty string")
    if kind == "choice" and (not isinstance(value, list) or not value or
                             any(not isinstance(c, str) or not c for c in value)):
        raise ConfigError("structured choice must be a non-empty list of non-empty strings")


@dataclasses.dataclass
class SamplingParams:
    """Per-request decoding parameters, with vLLM's names and defaults."""

    temperature: float = 1.0
    """Softmax temperature; 0 (or anything below MIN_TEMPERATURE) means greedy (argmax)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 or -1 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p (the most likely token is always
    kept, however small top_p); 1 keeps all."""
    max_tokens: int = 16
    """Most tokens to generate."""
    stop: list[str] | str | None = None
    """Strings that end generation; the stop string itself is not returned, and token_ids end at the token that
    completed it. While streaming, the last len(longest stop) - 1 characters wait until they cannot begin one."""
    seed: int | None = None
    """Seed of this request's random numbers (None: a fresh one). With the default sampler the same seed gives the
    same text alone or in any batch, with or without speculation, adaptive or fixed K (same model, weights
    format, dtype and machine; bitwise so where the target's numerics are batch-invariant, as the default quantized
    kernels are: docs/exactness.md). Greedy ignores it."""
    ignore_eos: bool = False
    """Keep generating after an end-of-sequence token (benchmarks use it for fixed-length outputs)."""
    use_speculation: bool = True
    """Set False to decode this request without speculation."""
    sampler: str = "auto"
    """How a sampled request's tokens are drawn. "race": the exponential race (Gumbel-max) with noise keyed by
    (seed, output position, token), so a token depends only on the seed and the tokens before it and speculation
    verifies by identity: the same seed gives the same text with or without speculation, at any K, adaptive or
    fixed, alone or in any batch. "rejection": inverse-CDF draws verified by rejection sampling (SpecInfer's
    multi-draft rule), which accepts a sampled draft more often (min(1, p/q) against the race's coupling: 1.32 vs
    1.23 tokens per pass for the draft model at T=1 on SmolLM2, equal for methods whose guesses are one-hot) but
    lets the text depend on what was drafted. "auto" (default): the race for a request with a seed, rejection
    sampling without one (its text is fresh randomness anyway). Both are exact samples of the target's distribution
    (`specdecode certify --sampler`); greedy ignores it."""

    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output holds so far (OpenAI's; in [-2, 2])."""
    frequency_penalty: float = 0.0
    """Times the token's count in the output so far, subtracted from its logit (OpenAI's; in [-2, 2])."""
    repetition_penalty: float = 1.0
    """A token the prompt or the output holds has its logit divided by this when positive, multiplied when
    negative (vLLM's and transformers'; > 0, 1 = off)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> added to its logit (OpenAI's; each in [-100, 100])."""
    n: int = 1
    """Completions to generate for the prompt (1 to MAX_N); they share its prefill, and choice i > 0 draws with
    its own seed derived from (seed, i) (choice_seed), so seeded choices are reproducible and differ."""
    structured: dict | None = None
    """Structured output: exactly one of {"json_schema": schema}, {"json_object": True}, {"regex": pattern},
    {"grammar": Lark grammar}, {"choice": [strings]}; the target's distribution at every position (every tree
    node) is masked to the tokens the grammar allows there (speculation/grammar.py, llguidance), and the request
    ends when the grammar is complete."""
    min_p: float = 0.0
    """Keep only tokens whose probability (after temperature) is at least min_p times the most likely one's, before
    top-k and top-p (vLLM's and transformers' min_p); 0 = off."""
    logprobs: int | None = None
    """Return, for each generated token, its log-probability and those of the `logprobs` most likely tokens at that
    position (0: only the token's own); None = none. Values are the target's raw distribution: log-softmax of its
    logits before temperature, min_p, top-k and top-p (vLLM's default, "raw_logprobs"), taken from the very target
    pass that produced the token, with or without speculation."""
    stop_token_ids: list[int] | None = None
    """Tokens that end the request as its EOS does, even with ignore_eos (vLLM's name); a fill-in-the-middle
    request stops on its format's end tokens this way (model/fim.py)."""

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= MAX_TOP_K:
            raise ConfigError(f"top_k must be a non-negative integer up to {MAX_TOP_K} (0 or -1 = off), "
                              f"got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ConfigError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2 <= value <= 2:
                raise ConfigError(f"{name} must be a number in [-2, 2] (0 = off), got {value!r}")
        if (isinstance(self.repetition_penalty, bool) or not isinstance(self.repetition_penalty, (int, float))
                or not 0 < self.repetition_penalty <= 10):
            raise ConfigError(f"repetition_penalty must be in (0, 10] (1 = off), got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                    isinstance(k, bool) or not isinstance(k, int) or k < 0 or isinstance(v, bool)
                    or not isinstance(v, (int, float)) or not -100 <= v <= 100 for k, v in self.logit_bias.items()):
                raise ConfigError("logit_bias must map token ids (integers >= 0) to numbers in [-100, 100], got "
                                  f"{self.logit_bias!r}")
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()} or None
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ConfigError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.structured is not None:
            check_structured(self.structured)
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ConfigError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (alternatives per token) or "
                              f"None, got {self.logprobs!r}")
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or any(
                    isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
                raise ConfigError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
            self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Whether the logits are adjusted (penalties or logit_bias) before temperature: then each position's
        distribution depends on the tokens before it, and a tree node's on the path from the root to it."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias)


def penalize(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
             paths: list[list[int]]) -> torch.Tensor:
    """logits [N, V] of N positions of one request -> adjusted logits (float32): row i is the position after
    prompt_ids + output_ids + paths[i] (a tree node's path from the root, [] at the root; a chain's answer so far).
    In order: logit_bias added; repetition_penalty on every token the prompt or the output so far holds (divide a
    positive logit, multiply a negative one); frequency_penalty x count and presence_penalty once per token the
    output so far holds, subtracted (vLLM's order). The counts of row i include paths[i]: a penalty computed from
    the root's prefix for every node would be wrong (certify's broken variant `penalties_from_root`)."""
    logits = logits.float().clone()
    N, V = logits.shape
    device = logits.device
    if params.logit_bias:
        ids = [t for t in params.logit_bias if t < V]
        logits[:, ids] += torch.tensor([params.logit_bias[t] for t in ids], device=device)
    counts = torch.zeros(N, V, device=device)
    if output_ids:
        counts += torch.bincount(torch.tensor(output_ids, device=device), minlength=V)[:V].float()
    rows = [i for i, path in enumerate(paths) for _ in path]
    if rows:
        counts.index_put_((torch.tensor(rows, device=device), torch.tensor([t for p in paths for t in p],
                                                                           device=device)),
                          torch.ones(len(rows), device=device), accumulate=True)
    if params.repetition_penalty != 1:
        seen = counts > 0
        if prompt_ids:
            seen |= (torch.bincount(torch.tensor(prompt_ids, device=device), minlength=V)[:V] > 0)[None]
        r = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    if params.frequency_penalty:
        logits -= params.frequency_penalty * counts
    if params.presence_penalty:
        logits -= params.presence_penalty * (counts > 0).float()
    return logits


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request with n > 1: the request's own for choice 0, a mix of both after."""
    if seed is None or index == 0:
        return seed
    return _mix64((seed * 0x9E3779B97F4A7C15 + index) & (2**64 - 1)) >> 2


def processed_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Probabilities after temperature, min_p, top-k and top-p, per row.

    logits [N, V]; temperature, top_k, top_p, min_p [N] (temperature below MIN_TEMPERATURE = one-hot argmax; top_k
    <= 0 = off; min_p 0 or None = off). Returns [N, V] float32 rows that sum to 1. Rows without top-k or top-p are
    a plain softmax: no sort.
    """
    logits = logits.float()
    greedy = temperature < MIN_TEMPERATURE
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    probs = scaled.softmax(-1)
    if min_p is not None and bool((min_p > 0).any()):
        rows = ((min_p > 0) & ~greedy).nonzero().squeeze(1)
        kept = probs[rows]
        kept = torch.where(kept >= min_p[rows, None] * kept.max(-1, keepdim=True).values, kept, 0.0)
        probs[rows] = kept / kept.sum(-1, keepdim=True)
    top_k = torch.where(top_k < logits.shape[-1], top_k, 0)  # keeping the whole vocabulary = off
    truncated = ((top_k > 0) | (top_p < 1)) & ~greedy
    if truncated.any():
        rows = truncated.nonzero().squeeze(1)
        probs[rows] = truncate(probs[rows], top_k[rows], top_p[rows])
    if greedy.any():
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def truncate(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             candidates: tuple[int, ...] = TRUNCATION_CANDIDATES) -> torch.Tensor:
    """Top-k, then top-p of the renormalised rest, then renormalised: probs [N, V] rows of a softmax -> [N, V].

    top-p keeps a token while the mass before it is below top_p (the most likely token always stays: a top_p that
    rounds to 0 would otherwise drop every token). Sorting a 49k vocabulary costs milliseconds a row, so a row is
    decided among its `candidates[0]` most likely tokens when they suffice (top_k within them, or, without top-k,
    their mass reaches top_p), else among the next number of candidates, else by sorting the whole row.
    """
    N, V = probs.shape
    out = torch.zeros_like(probs)
    pending = torch.arange(N, device=probs.device)
    for m in [c for c in candidates if c < V] + [V]:
        rows, k, p = probs[pending], top_k[pending], top_p[pending]
        values, order = rows.topk(m, dim=-1) if m < V else rows.sort(dim=-1, descending=True)  # [n, m]
        decided = ((k > 0) & (k <= m)) | ((k <= 0) & (p < 1) & (values.sum(-1) >= p)) | (m == V)
        if decided.any():
            out[pending[decided]] = _truncate_ranked(values[decided], order[decided], k[decided], p[decided], V)
            pending = pending[~decided]
        if not len(pending):
            break
    return out


def _truncate_ranked(values: torch.Tensor, order: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     V: int) -> torch.Tensor:
    """truncate() on rows' m most likely tokens: values [n, m] descending, order [n, m] their ids -> [n, V]."""
    rank = torch.arange(values.shape[-1], device=values.device)
    values = values.masked_fill((top_k > 0)[:, None] & (rank[None, :] >= top_k[:, None]), 0.0)
    # Without top-k the rows are already normalised over the whole vocabulary (the ranked part may hold less).
    values = values / torch.where(top_k > 0, values.sum(-1), 1.0)[:, None]
    mass_before = values.cumsum(-1) - values
    drop = mass_before >= top_p[:, None]
    drop[:, 0] = False
    values = values.masked_fill(drop, 0.0)
    values = values / values.sum(-1, keepdim=True)
    return torch.zeros(len(values), V, dtype=values.dtype, device=values.device).scatter_(-1, order, values)


def params_tensors(params: list[SamplingParams], repeats: list[int] | None = None,
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """temperature, top_k, top_p, min_p tensors with each request's values repeated `repeats[i]` times (min_p is
    None when no request sets it)."""
    repeats = repeats or [1] * len(params)
    temperature = torch.tensor([p.temperature for p, r in zip(params, repeats) for _ in range(r)], device=device)
    top_k = torch.tensor([p.top_k for p, r in zip(params, repeats) for _ in range(r)], device=device)
    top_p = torch.tensor([p.top_p for p, r in zip(params, repeats) for _ in range(r)], device=device)
    min_p = None
    if any(p.min_p for p in params):
        min_p = torch.tensor([p.min_p for p, r in zip(params, repeats) for _ in range(r)], device=device).float()
    return temperature.float(), top_k.long(), top_p.float(), min_p


@dataclasses.dataclass
class TokenLogprob:
    """One generated token's log-probability under the target, and the most likely tokens at its position."""

    token: int
    logprob: float
    top: list[tuple[int, float]]
    """(token, log-probability) of the `logprobs` most likely tokens, most likely first."""


def token_logprobs(logits: torch.Tensor, tokens: list[int], alternatives: list[int]) -> list[TokenLogprob]:
    """logits [N, V] of the positions that produced `tokens` (one per row) -> their log-softmax values and each
    row's `alternatives[i]` most likely tokens; one transfer to the host."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
    k = max(alternatives, default=0)
    if k:
        top_values, top_ids = logp.topk(k, dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    values = chosen.tolist()
    return [TokenLogprob(t, v, list(zip(top_ids[i][:a], top_values[i][:a])) if a else [])
            for i, (t, v, a) in enumerate(zip(tokens, values, alternatives))]


def sample_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: probs [N, V] (rows need not be normalised), u [N] uniforms in [0, 1) -> tokens [N].

    The first index whose cumulative mass exceeds u * total is never a zero-probability token.
    """
    cdf = probs.double().cumsum(-1)  # [N, V]
    target = u.to(cdf) * cdf[:, -1]
    return torch.searchsorted(cdf, target[:, None], right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def sample_from(probs: torch.Tensor, u: float) -> int:
    """One inverse-CDF draw from probs [V]."""
    return int(sample_rows(probs[None], torch.tensor([u]))[0])


# -- each request's random numbers --------------------------------------------------------------------------------
#
# A request's uniforms are addressed, not drawn from a stream: the one that decides something about output position
# j is a hash of (the request's key, j, what it decides, which one), so what a request gets never depends on how
# many numbers other requests in its batch needed, or on how many drafts an earlier step verified. The hash is
# splitmix64's output function, evaluated at a distinct counter per number.

DRAW, ACCEPT, DRAFT, SEQUENTIAL, RACE = 0, 1, 2, 3, 4
"""Streams: the token drawn at a position; accepting the i-th draft tried there; a proposer's i-th draft there;
a plain sequence of numbers for proposers that want one; the exponential race's noise for token x there."""
_GAMMA = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _mix64_array(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _counter(position: int, stream: int, index: int) -> int:
    return (position << 24) | (stream << 20) | index  # index < 2**20, stream < 16


class RequestRandom:
    """The random numbers of one request, keyed by its seed (same seed, same numbers)."""

    def __init__(self, seed: int):
        self.key = _mix64((seed + _GAMMA) & _MASK)
        self._sequential = 0

    def uniform(self, position: int, stream: int, index: int = 0) -> float:
        """The uniform in [0, 1) for decision `index` of kind `stream` about output position `position`."""
        z = _mix64((self.key + _GAMMA * (_counter(position, stream, index) + 1)) & _MASK)
        return (z >> 11) * 2.0 ** -53

    def next(self, n: int) -> list[float]:
        """n numbers of a plain sequence (each call continues where the last one stopped)."""
        start, self._sequential = self._sequential, self._sequential + n
        return [self.uniform(i >> 20, SEQUENTIAL, i & 0xFFFFF) for i in range(start, start + n)]


def position_uniforms(keys: list[int], starts: list[int], width: int, stream: int, index: int = 0) -> torch.Tensor:
    """[R, width] float64: row r, column d holds RequestRandom(key r).uniform(starts[r] + d, stream, index), for many
    rows at once."""
    key = np.array(keys, dtype=np.uint64)[:, None]  # [R, 1]
    positions = np.array(starts, dtype=np.uint64)[:, None] + np.arange(width, dtype=np.uint64)[None, :]  # [R, W]
    counters = (positions << np.uint64(24)) | np.uint64(stream << 20) | np.uint64(index)
    z = _mix64_array(key + np.uint64(_GAMMA) * (counters + np.uint64(1)))
    return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53)


class StepUniforms:
    """The uniforms of one speculative step of one request, whose first new token is output position `start`:
    what the verifier draws at tree depth d concerns position start + d."""

    def __init__(self, random: RequestRandom, start: int):
        self.random = random
        self.start = start

    def accept(self, depth: int, child: int) -> float:
        """For accepting the `child`-th draft tried at `depth`."""
        return self.random.uniform(self.start + depth, ACCEPT, child)

    def draw(self, depth: int) -> float:
        """For the token drawn at `depth` (a correction or the bonus)."""
        return self.random.uniform(self.start + depth, DRAW)


# -- the exponential race (Gumbel-max) ----------------------------------------------------------------------------
#
# A sampled request's token at output position j is the x that maximises p_j(x) / E_j(x), where p_j is the processed
# distribution after the tokens before j and E_j(x) = -log(1 - u) an Exp(1) variate keyed by (the request's key, j,
# x): the Gumbel-max trick written as a race of exponential clocks, an exact sample from p_j. Because the noise
# belongs to the position and not to what was drafted, the target's token after a given prefix is fixed before any
# draft is made: verification is identity (the drafts' path is kept while it equals the target's own tokens, as in
# greedy decoding), and the text depends on the seed and the prefix only: the same alone, in any batch, with or
# without speculation, at any K. A proposer that sees the same noise (race_gumbel) guesses the winner far more often
# than one that guesses the most likely token.

def raced(params: SamplingParams) -> bool:
    """Whether this request's tokens are the winners of the exponential race."""
    if params.greedy:
        return False
    return params.sampler == "race" or (params.sampler == "auto" and params.seed is not None)


_SIGNED = 1 << 63


def _signed(z: int) -> int:
    return z - (1 << 64) if z >= _SIGNED else z


def _lsr(z: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> shift) & ((1 << (64 - shift)) - 1)


def _mix64_tensor(z: torch.Tensor) -> torch.Tensor:
    """_mix64 on int64 tensors (multiplication wraps modulo 2**64, as uint64 arithmetic does)."""
    z = (z ^ _lsr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _lsr(z, 27)) * _signed(0x94D049BB133111EB)
    return z ^ _lsr(z, 31)


def race_uniforms(keys: list[int], positions: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """[N, M] float64: RequestRandom(key n).uniform(positions[n], RACE, tokens[n, m]), for tokens [N, M]."""
    key = torch.tensor([_signed(k) for k in keys], dtype=torch.int64)[:, None]
    base = torch.tensor([(p << 24) | (RACE << 20) for p in positions], dtype=torch.int64)[:, None]
    z = _mix64_tensor(key + _signed(_GAMMA) * ((base | tokens.cpu().long()) + 1))
    return _lsr(z, 11).double() * 2.0 ** -53


def race_gumbel(keys: list[int], positions: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """[N, M] float64 Gumbel noise -log(E) of the race at those tokens: log p + this ranks tokens as the race does
    (for proposers: the noise the target's own sample at that position will see)."""
    return -torch.log(-torch.log1p(-race_uniforms(keys, positions, tokens)))


def race_tokens(probs: torch.Tensor, keys: list[int], positions: list[int]) -> torch.Tensor:
    """The race's winners: probs [N, V] (processed, float32) with row n's noise keyed by (keys[n], positions[n]) ->
    tokens [N] (int64, on probs' device). The compiled kernel (kernels/race.cpp) where it builds, else the same
    arithmetic in torch (equal up to the last bit of log1p: a near-tie could go the other way, so a seed's text is
    reproducible on one machine and install, not across the two)."""
    from specdecode import kernels

    module = kernels.quant()
    if module is not None and probs.device.type == "cpu":
        return module.race_argmax(probs.float(), torch.tensor([_signed(k) for k in keys]),
                                  torch.tensor(positions, dtype=torch.int64))
    N, V = probs.shape
    u = race_uniforms(keys, positions, torch.arange(V).expand(N, V)).to(probs.device)
    ratio = probs.double() / -torch.log1p(-u)
    return ratio.masked_fill(~(probs > 0), -1.0).argmax(-1)
