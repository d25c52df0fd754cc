"""Time one request through an engine, as its user sees it: the tokens, the wall time, the time to the first
token and the latency of every later token; then sum such traces into one engine's figures.

Per-token latency: when a step delivers n new tokens to the request dt seconds after the previous delivery,
each of those n tokens counts dt / n (a speculative burst spread evenly over its tokens), so plain decoding
(n = 1 every step) and speculation are measured by the same rule and p50/p99 compare directly. The first token
comes out of prefill and counts as time to first token instead.
"""
from __future__ import annotations

import dataclasses
import time

from specdecode.engine.llm import LLM
from specdecode.engine.sequence import SpecStats
from specdecode.sampling import SamplingParams


@dataclasses.dataclass
class Trace:
    """One request through one engine."""

    token_ids: list[int]
    """Generated tokens."""
    seconds: float
    """Wall time from the call to the last token."""
    ttft: float
    """Seconds to the first generated token."""
    token_latencies: list[float]
    """Seconds per token after the first (see the module docstring)."""
    stats: SpecStats | None = None
    """Speculation counters (specdecode engines only)."""
    cpu_seconds: float = 0.0
    """CPU time of the process (all its threads) while it ran, where the caller measured it (0: not measured)."""


class LatencyClock:
    """Turns the times at which a request's output grows into time to first token and per-token latencies."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.ttft: float | None = None
        self.latencies: list[float] = []

    def delivered(self, n: int) -> None:
        """n new tokens have just arrived."""
        if n <= 0:
            return
        now = time.perf_counter()
        if self.ttft is None:
            self.ttft = now - self.start
            n -= 1  # the first token's wait is the time to first token; any others arrived with it
            if n:
                self.latencies.extend([0.0] * n)
        else:
            self.latencies.extend([(now - self.last) / n] * n)
        self.last = now


def trace_generate(llm: LLM, prompt_ids: list[int], params: SamplingParams) -> Trace:
    """Generate for one prompt through the engine's own step loop (the one `LLM.generate` runs), noting after
    every iteration how many tokens the request gained."""
    seq = llm.make_sequence(prompt_ids, params)
    clock = LatencyClock()
    seen = 0
    for _ in llm._run([seq]):
        clock.delivered(seq.num_generated - seen)
        seen = seq.num_generated
    seconds = time.perf_counter() - clock.start
    return Trace(seq.output_ids, seconds, clock.ttft or seconds, clock.latencies, seq.stats)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between order statistics; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def accepted_length_counts(stats: SpecStats) -> list[int]:
    """counts[n]: drafting steps that accepted exactly n draft tokens (from the per-depth counters)."""
    reached = stats.accepted_per_pos  # reached[i]: steps whose accepted path reached depth i + 1
    counts = [stats.drafts - (reached[0] if reached else 0)]
    for i, n in enumerate(reached):
        counts.append(n - (reached[i + 1] if i + 1 < len(reached) else 0))
    return counts


@dataclasses.dataclass
class EngineTotals:
    """Traces of one engine on one workload, summed."""

    tokens: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    ttfts: list[float] = dataclasses.field(default_factory=list)
    token_latencies: list[float] = dataclasses.field(default_factory=list)
    stats: SpecStats = dataclasses.field(default_factory=SpecStats)
    outputs: list[list[int]] = dataclasses.field(default_factory=list)
    """Generated tokens per prompt, in prompt order."""

    def add(self, trace: Trace) -> None:
        self.tokens += len(trace.token_ids)
        self.seconds += trace.seconds
        self.cpu_seconds += trace.cpu_seconds
        self.ttfts.append(trace.ttft)
        self.token_latencies += trace.token_latencies
        if trace.stats is not None:
            self.stats.merge(trace.stats)
        self.outputs.append(trace.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict:
        """The figures a report shows (times in seconds; shares of wall time)."""
        stats = self.stats
        out = {"tokens": self.tokens, "seconds": self.seconds, "tokens_per_s": self.tokens_per_s,
               "ttft_mean_s": sum(self.ttfts) / len(self.ttfts) if self.ttfts else 0.0,
               "latency_p50_s": percentile(self.token_latencies, 50),
               "latency_p99_s": percentile(self.token_latencies, 99)}
        if self.cpu_seconds:  # the cost line: output tokens per CPU-second (one core busy), CPU-seconds per 1M tokens
            out.update(cpu_seconds=self.cpu_seconds, tokens_per_cpu_s=self.tokens / self.cpu_seconds,
                       cpu_s_per_million_tokens=1e6 * self.cpu_seconds / self.tokens if self.tokens else 0.0)
        if stats.steps:
            # SpecStats times cover proposing and the target passes (prefill counts as verifying); the rest of
            # the wall time is scheduling, commit bookkeeping, detokenising and Python overhead.
            draft_share = stats.draft_time / self.seconds if self.seconds else 0.0
            verify_share = stats.verify_time / self.seconds if self.seconds else 0.0
            out.update(steps=stats.steps, mean_accepted_len=stats.mean_accepted_len,
                       acceptance_rate=stats.acceptance_rate if stats.draft_tokens else None,
                       draft_share=draft_share, verify_share=verify_share,
                       other_share=max(0.0, 1.0 - draft_share - verify_share),
                       accepted_len_counts=accepted_length_counts(stats) if stats.drafts else [])
        return out
