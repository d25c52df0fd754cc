"""Continuous batching: sequences join and leave between steps, each one holding a cache slot while it runs.

Both the offline `LLM.generate` loop and the server's background engine drive this one scheduler; an iteration
either prefills the sequences that just got a slot or runs one speculative step for every running sequence, and
then one chunk of a long prompt that arrived while others were decoding (chunked prefill). A joining sequence takes
the free slot that holds the longest beginning of its prompt and prefills only the rest (engine/prefix_cache.py).

When a prefill or a step raises, every slot it took is released. The server's scheduler (isolate_failures) then
finds the request at fault instead of failing the whole batch: if the step failed before it changed anything, its
sequences are retried one at a time and only one that fails alone is dropped.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from specdecode.engine.budget import DraftBudget
from specdecode.engine.sequence import Sequence, SpecStats
from specdecode.engine.step import StepReport, StepRunner


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
    failed: list[tuple[Sequence, Exception]] = dataclasses.field(default_factory=list)
    """Sequences dropped because the iteration raised on them (their slots are free again), with the error."""


CHUNKED_PREFILL_ABOVE = 256
"""A prompt with more tokens than this to prefill, arriving while other sequences decode, is prefilled in chunks
between their steps (alone it is prefilled in one piece: nothing waits for it)."""
MIN_CHUNK = 4
FIRST_CHUNK = 8
CHUNK_STEP_FRACTION = 0.8
"""Prompt tokens of a first chunk; later ones are sized from the last chunk's speed to last this fraction of the
step before them, so the running sequences' time between tokens stays under twice what it is without the long
prompt (on a CPU a prefilled token costs about a fifth of a one-token step: chunks are a few tokens, and the long
prompt's own first token comes later than in one piece, the price of not stalling everyone else)."""


class Scheduler:
    def __init__(self, runner: StepRunner, budget: DraftBudget, totals: SpecStats, num_slots: int,
                 isolate_failures: bool = False):
        """runner: runs prefills and steps; budget: draft tokens per sequence per step (and the controller that
        learns from each step); totals: where a finished sequence's counters are added.
        isolate_failures: a prefill or step that raises drops only the sequences at fault (they are reported in
        SchedulerOutput.failed); without it the error propagates, after the slots it took are released."""
        self.runner = runner
        self.budget = budget
        self.totals = totals
        self.num_slots = num_slots
        """Most sequences running at once (the runner's cache may have more slots: they stay free)."""
        self.isolate_failures = isolate_failures
        self.pool = runner.slots  # the cache's free slots and the prefixes they hold (shared by every scheduler)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.suspects: collections.deque[Sequence] = collections.deque()  # to step alone: their batch failed
        self.prefilling: list[Sequence] = []
        """Long prompts holding a slot, prefilled a chunk per iteration between the running sequences' steps."""
        self.chunk_rate: float | None = None  # prompt tokens per second of the last chunk
        self.prefill_alone = 0  # the next this many sequences join one at a time: their batch's prefill failed

    @property
    def free(self) -> list[int]:
        """The free cache slots (the runner's pool)."""
        return self.pool.free

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    @property
    def can_progress(self) -> bool:
        """Whether step() would do anything (work waiting for a slot when none is free and nothing runs is a
        leak, reported by slot_problem, not a reason to spin)."""
        return bool(self.running or self.prefilling or (self.waiting and len(self.pool)))

    def slot_problem(self) -> str | None:
        """None while every slot is either free or held by a running sequence."""
        free = self.pool.free
        held = len(free) + len(self.running) + len(self.prefilling)
        if held != self.pool.size or len(set(free)) != len(free):
            return f"cache slots leaked: {len(free)} free and {len(self.running)} running of {self.pool.size}"
        return None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is; returns its sequence (None if it is not here)."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        for seq in self.running + self.prefilling:
            if seq.request_id == request_id:
                self._release(seq)
                return seq
        return None

    def abort_all(self) -> list[Sequence]:
        dropped = list(self.waiting) + list(self.running) + list(self.prefilling)
        self.waiting.clear()
        for seq in list(self.running) + list(self.prefilling):
            self._release(seq)
        return dropped

    def _release(self, seq: Sequence, reusable: bool = True) -> None:
        """A sequence leaves; its slot keeps what its cache rows hold for a later prompt that begins the same way
        (reusable False: after a failure, when they may be half written)."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        self.runner.release(seq)
        if seq.slot >= 0:
            held = int(self.runner.cache.lengths[seq.slot]) if reusable else 0
            self.pool.give_back(seq.slot, seq.token_ids[:held])
            seq.slot = -1
        if self.budget.controller is not None:
            self.budget.controller.forget(seq.request_id)
        self.totals.merge(seq.stats)

    def _take_joining(self) -> list[Sequence]:
        joining = []
        longest = deepest = 0  # over `joining`: the most new tokens of a row, the longest reused prefix
        while (self.waiting and len(self.pool)
               and len(self.running) + len(self.prefilling) + len(joining) < self.num_slots
               and not (self.prefill_alone and joining)):
            seq = self.waiting[0]
            slot, reused = self.pool.choose(seq.token_ids)
            reused = self.runner.reusable(slot, reused)
            new_longest, new_deepest = max(longest, len(seq.token_ids) - reused), max(deepest, reused)
            if joining and new_deepest + new_longest > self.runner.cache.max_len:
                break  # it would not fit beside these: it joins in the next prefill
            self.waiting.popleft()
            seq.slot, _ = self.pool.take(seq.token_ids)
            seq.reused = seq.prefilled = reused
            if (self.runner.chunked_prefill and len(seq.token_ids) - reused > CHUNKED_PREFILL_ABOVE
                    and (self.running or self.prefilling)):
                self.prefilling.append(seq)  # a long prompt while others decode: in chunks, between their steps
            else:
                joining.append(seq)
                longest, deepest = new_longest, new_deepest
        self.prefill_alone = max(0, self.prefill_alone - len(joining))
        return joining

    def _take_active(self) -> list[Sequence]:
        while self.suspects:
            seq = self.suspects.popleft()
            if seq in self.running and not seq.finished:
                return [seq]
        return [s for s in self.running if not s.finished]

    def _failed(self, seqs: list[Sequence], exc: Exception, prefill: bool) -> list[tuple[Sequence, Exception]]:
        """After a prefill or step over seqs raised: free their slots, or (isolating) queue them to be retried
        alone when the runner changed nothing. Returns the sequences dropped."""
        if not self.isolate_failures or len(seqs) == 1 or self.runner.mutated or prefill is None:
            for seq in seqs:
                self._release(seq, reusable=False)
            if not self.isolate_failures:
                raise exc
            return [(seq, exc) for seq in seqs]
        if prefill:  # give the slots back and prefill them again, one at a time
            for seq in reversed(seqs):
                self.pool.give_back(seq.slot, None)
                seq.slot = -1
                self.waiting.appendleft(seq)
            self.prefill_alone = len(seqs)
        else:
            self.suspects.extend(seqs)
        return []

    def _prefill_chunk(self, deltas: dict[str, str], step_seconds: float | None):
        """The next chunk of the first long prompt: a little shorter than the step that just ran (so the running
        sequences' time between tokens less than doubles while it lasts), or all of the rest when nothing else runs.
        The last chunk draws the first token and the sequence joins the running ones. Returns (joined, failed)."""
        seq = self.prefilling[0]
        left = len(seq.token_ids) - seq.prefilled
        if step_seconds is None or not self.running:
            tokens = left
        else:
            budget = CHUNK_STEP_FRACTION * step_seconds
            tokens = max(MIN_CHUNK, int(self.chunk_rate * budget)) if self.chunk_rate else FIRST_CHUNK
        try:
            if tokens >= left:
                self.prefilling.remove(seq)
                deltas.update(zip([seq.request_id], self.runner.prefill([seq])))
                self.running.append(seq)
                return [seq], []
            start = time.perf_counter()
            self.runner.prefill_chunk(seq, tokens)
            self.chunk_rate = tokens / max(time.perf_counter() - start, 1e-6)
            self.runner.slots.stats.chunks += 1
            return [], []
        except Exception as exc:
            return [], self._failed([seq], exc, prefill=None)

    def step(self) -> SchedulerOutput:
        runner, controller = self.runner, self.budget.controller
        start = time.perf_counter()
        joining = self._take_joining()
        deltas: dict[str, str] = {}
        active: list[Sequence] = []
        failed: list[tuple[Sequence, Exception]] = []
        report = None
        if joining:
            try:
                deltas.update(zip((s.request_id for s in joining), runner.prefill(joining)))
                self.running += joining
            except Exception as exc:
                failed = self._failed(joining, exc, prefill=True)
                joining = []
        else:
            active = self._take_active()
            if active:
                try:
                    budgets = self.budget.for_step(active)
                    deltas.update(zip((s.request_id for s in active), runner.step(active, budgets)))
                    report = runner.last_report
                    if controller is not None:
                        wall = time.perf_counter() - start - report.join_time
                        controller.observe(active, max(budgets), report, wall)
                except Exception as exc:
                    failed = self._failed(active, exc, prefill=False)
                    active, report = [], None
            if self.prefilling:
                joined, chunk_failed = self._prefill_chunk(deltas, time.perf_counter() - start if active else None)
                joining += joined
                failed += chunk_failed
        finished = [s for s in self.running if s.finished]
        for seq in finished:
            self._release(seq)
        return SchedulerOutput(deltas, joining, active, finished, report, time.perf_counter() - start, failed)
