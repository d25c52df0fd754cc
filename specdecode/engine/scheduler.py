"""Continuous batching: sequences join and leave between steps, each one holding a cache slot while it runs.

Both the offline `LLM.generate` loop and the server's background engine drive this one scheduler; an iteration
either prefills the sequences that just got a slot or runs one speculative step for every running sequence.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import TYPE_CHECKING

from specdecode.engine.sequence import Sequence
from specdecode.engine.step import StepReport

if TYPE_CHECKING:
    from specdecode.engine.llm import LLM


@dataclasses.dataclass
class SchedulerOutput:
    """What one iteration did."""

    deltas: dict[str, str]
    """request_id -> text added this iteration."""
    prefilled: list[Sequence]
    """Sequences that joined and got their first token."""
    stepped: list[Sequence]
    """Sequences that took part in a speculative step (empty on a prefill iteration)."""
    finished: list[Sequence]
    """Sequences that finished this iteration and left (their slots are free again)."""
    report: StepReport | None
    """The step's report (None on a prefill iteration)."""
    wall_time: float
    """Seconds the iteration took."""


class Scheduler:
    def __init__(self, llm: "LLM", num_slots: int):
        self.llm = llm
        self.free = list(range(num_slots))[::-1]
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is; returns its sequence (None if it is not here)."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self._release(seq)
                return seq
        return None

    def abort_all(self) -> list[Sequence]:
        dropped = list(self.waiting) + list(self.running)
        self.waiting.clear()
        for seq in list(self.running):
            self._release(seq)
        return dropped

    def _release(self, seq: Sequence) -> None:
        llm = self.llm
        self.running.remove(seq)
        self.free.append(seq.slot)
        llm.runner.release(seq)
        if llm.controller is not None:
            llm.controller.forget(seq.request_id)
        llm.total_stats.merge(seq.stats)

    def step(self) -> SchedulerOutput:
        llm = self.llm
        start = time.perf_counter()
        joining = []
        while self.waiting and self.free:
            seq = self.waiting.popleft()
            seq.slot = self.free.pop()
            joining.append(seq)
        deltas: dict[str, str] = {}
        active: list[Sequence] = []
        report = None
        if joining:
            deltas.update(zip((s.request_id for s in joining), llm.runner.prefill(joining)))
            self.running += joining
        else:
            active = [s for s in self.running if not s.finished]
            if active:
                budgets = llm.budgets(active)
                deltas.update(zip((s.request_id for s in active), llm.runner.step(active, budgets)))
                report = llm.runner.last_report
                if llm.controller is not None:
                    wall = time.perf_counter() - start - report.join_time
                    llm.controller.observe(active, max(budgets), report, wall)
        finished = [s for s in self.running if s.finished]
        for seq in finished:
            self._release(seq)
        return SchedulerOutput(deltas, joining, active, finished, report, time.perf_counter() - start)
