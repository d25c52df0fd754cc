"""Measure one engine configuration on a list of prompts: tokens/s and the speculation counters."""
from __future__ import annotations

import dataclasses
import time

from specdecode.engine.llm import LLM
from specdecode.engine.sequence import SpecStats
from specdecode.sampling import SamplingParams


@dataclasses.dataclass
class RunResult:
    tokens: int
    """Generated tokens."""
    seconds: float
    """Wall time of the generate calls."""
    stats: SpecStats
    """Speculation counters summed over the prompts."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def run_prompts(llm: LLM, prompts: list[str], params: SamplingParams, batch_size: int = 1) -> RunResult:
    """Generate for every prompt, `batch_size` prompts per generate call; counts generated tokens and time."""
    stats = SpecStats()
    tokens, seconds = 0, 0.0
    for i in range(0, len(prompts), batch_size):
        start = time.perf_counter()
        outputs = llm.generate(prompts[i:i + batch_size], params)
        seconds += time.perf_counter() - start
        for out in outputs:
            tokens += len(out.outputs[0].token_ids)
            stats.merge(out.metrics)
    return RunResult(tokens, seconds, stats)
