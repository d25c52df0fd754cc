"""Continuous batching: sequences join and leave between steps, each one holding a cache row (and, paged, the
blocks its tokens fill) while it runs.

Both the offline `LLM.generate` loop and the server's background engine drive this one scheduler; an iteration
either prefills the sequences that just got a row or runs one speculative step for every running sequence, with the
next chunk of a long prompt that arrived while others were decoding riding in the step's target pass (chunked
prefill). A joining sequence reuses the keys and values the cache holds of its prompt's beginning and prefills only
the rest (engine/prefix_cache.py).

Paged, memory is admitted by blocks: a request joins when the blocks of its prompt and first step fit beside what
the running ones need for their next step; requests that share a beginning not yet in the cache join one after the
other, so that the first one's blocks are shared by the rest (a system prompt prefilled once per wave). When a step
needs more blocks than the pool has left, the most recently admitted request is preempted: its full blocks stay
indexed, its row is freed, and it waits at the front of the queue to be recomputed from its tokens - with the
batch-invariant kernels, into the same numbers, so its output is unchanged.

When a prefill or a step raises, every slot it took is released. The server's scheduler (isolate_failures) then
finds the request at fault instead of failing the whole batch: if the step failed before it changed anything, its
sequences are retried one at a time and only one that fails alone is dropped.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from specdecode.engine.budget import DraftBudget
from specdecode.plan import MAX_PREFILL_TOKENS
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
    preempted: int = 0
    """Sequences preempted this iteration (back in the queue, to be recomputed)."""


CHUNKED_PREFILL_ABOVE = 256
RIDING_ABOVE = 32
"""A prompt with more tokens than this to prefill is prefilled in chunks: in chunks of about LONE_CHUNK_SECONDS while
nothing else runs; while others decode, one of more than RIDING_ABOVE rides in their steps (prefilled apart, a
prompt of a few hundred tokens held every stream's next token for seconds)."""
LONE_CHUNK_SECONDS = 1.0
LONE_FIRST_CHUNK = 64
"""A long prompt prefilled while nothing else runs goes in chunks of about a second (the first of LONE_FIRST_CHUNK
tokens, later ones sized from the last chunk's speed), so that a client that gives up frees the engine, and a
request that arrives starts, within about a second instead of after the whole prefill. They cost nothing measurable:
the 1.5B prefilled 1,024 tokens at 66-70 tok/s in chunks of 64-256 and at 63-64 in one piece (one thread, AMD EPYC;
a chunk's attention reads the cache in place, and its smaller activations stay in cache)."""
MIN_CHUNK = 4
FIRST_CHUNK = 8
STEP_BUDGET_SECONDS = 0.5
CHUNK_STEP_FRACTION = 0.8
"""While others decode, a long prompt's chunks ride in their steps' target pass (each layer's weights read once for
both; runner.rides_chunks): the first of FIRST_CHUNK tokens, later ones scaled from the last step's time so that a
step lasts STEP_BUDGET_SECONDS, or 1 + CHUNK_STEP_FRACTION times a step without a chunk where that is longer. Every
stream's next token comes within about the budget, and the long prompt has the rest of it. Where a chunk cannot ride
(a proposer that reads the target's features), it runs after the step, sized from its own speed to fill what the
step left of the budget (at least CHUNK_STEP_FRACTION of the step). With chunks of 0.8 of a step run apart, a
4k-token prompt beside six decoding streams waited 2.6x its prefill alone (docs/bench/mix_2026-12-07)."""


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
        self.ride_tokens = FIRST_CHUNK  # prompt tokens of the next chunk that rides in a step
        self.free_step: float | None = None  # seconds of the last step that carried no chunk
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
        if self.runner.paged and not self.running and not self.prefilling and self.runner.cache.pool.used:
            return f"KV-cache blocks leaked: {self.runner.cache.pool.used} held with no request running"
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

    def _detach(self, seq: Sequence, reusable: bool = True) -> None:
        """Take a sequence out of the running ones: the proposer's state and its cache row go back; what the row
        holds stays for a later prompt that begins the same way (reusable False: after a failure, when it may be
        half written)."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        self.runner.release(seq)
        self.runner.free_row(seq, reusable)

    def _release(self, seq: Sequence, reusable: bool = True) -> None:
        """A sequence leaves for good (its counters join the totals)."""
        self._detach(seq, reusable)
        if self.budget.controller is not None:
            self.budget.controller.forget(seq.request_id)
        self.totals.merge(seq.stats)

    def _preempt(self, seq: Sequence) -> None:
        """Take a running (or prefilling) sequence's row and blocks back; it rejoins first, recomputed from its
        tokens (the full blocks it leaves indexed are likely still there)."""
        self._detach(seq)
        seq.prefilled = seq.reused = 0
        self.waiting.appendleft(seq)
        self.pool.stats.preemptions += 1

    def _take_joining(self) -> list[Sequence]:
        runner = self.runner
        joining = []
        longest = deepest = 0  # over `joining`: the most new tokens of a row, the longest reused prefix
        sharing = [s for s in self.prefilling]  # whose blocks later joiners with the same beginning should wait for
        # blocks admitted but not taken yet, and those the running sequences' next step takes
        promised = sum(runner.blocks_to_finish(s) for s in self.prefilling) + runner.step_headroom(self.running)
        while (self.waiting and len(self.pool)
               and len(self.running) + len(self.prefilling) + len(joining) < self.num_slots
               and not (self.prefill_alone and joining)):
            seq = self.waiting[0]
            slot, reused, blocks = runner.place(seq)
            new_longest, new_deepest = max(longest, len(seq.token_ids) - reused), max(deepest, reused)
            if joining and (new_deepest + new_longest > runner.cache.max_len
                            or (len(joining) + 1) * new_longest > MAX_PREFILL_TOKENS):
                break  # it would not fit beside these: it joins in the next prefill
            if runner.paged:
                if runner.prefix_caching and self._shares_unindexed(seq, reused, joining + sharing):
                    break  # it begins as one that is being prefilled: it joins when those blocks are indexed
                chunked = self._chunked(seq, reused)
                width = len(seq.token_ids) - reused if chunked else new_longest  # a batch is padded to its longest
                need = runner.admission_blocks(seq, blocks, reused + width)
                if not chunked and new_longest > longest:  # the rows already joining take more, padded wider
                    need += sum(runner.admission_blocks(s, [], s.prefilled + new_longest)
                                - runner.admission_blocks(s, [], s.prefilled + longest) for s in joining)
                if need + promised > runner.cache.pool.available and (joining or self.running or self.prefilling):
                    break  # not enough blocks yet: it waits for others to finish (alone, it always fits: the plan
                    # sizes the pool for one sequence of max_model_len, and its steps draft no further than that)
                promised += need
            self.waiting.popleft()
            runner.take(seq, slot, reused, blocks)
            if self._chunked(seq, reused):
                self.prefilling.append(seq)  # a long prompt while others decode: in chunks, between their steps
                sharing.append(seq)
            else:
                joining.append(seq)
                longest, deepest = new_longest, new_deepest
        self.prefill_alone = max(0, self.prefill_alone - len(joining))
        return joining

    def _chunked(self, seq: Sequence, reused: int) -> bool:
        """Whether a joining prompt is prefilled in chunks: one of more than MAX_PREFILL_TOKENS always (the
        activations' bound), a long one too (so as not to stall the others, nor an abort or a newcomer): more than
        CHUNKED_PREFILL_ABOVE tokens, or RIDING_ABOVE while others decode and its chunks can ride in their steps."""
        left = len(seq.token_ids) - reused
        riding = self.running and self.runner.rides_chunks
        return left > MAX_PREFILL_TOKENS or (self.runner.chunked_prefill
                                              and left > (RIDING_ABOVE if riding else CHUNKED_PREFILL_ABOVE))

    def _shares_unindexed(self, seq: Sequence, reused: int, others: list[Sequence]) -> bool:
        """Whether seq's next full block after what it reuses is one that another joining or prefilling sequence is
        about to compute (the n choices of one request, with the very same tokens, copy the prefill instead)."""
        end = reused + self.runner.cache.block_size
        if end > len(seq.token_ids) - 1:
            return False
        head = seq.token_ids[:end]
        return any(o.token_ids[:end] == head and o.token_ids != seq.token_ids for o in others)

    def _make_room(self, active: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """The step's sequences and budgets after preempting, most recently admitted first (prefilling ones before
        running ones, and running ones left out of the step before those in it: a sequence retried alone after its
        batch failed is not blamed for the blocks the others hold), until the step's blocks fit the pool (one
        sequence alone always fits: the plan sizes the pool for one of max_model_len)."""
        budgets = self.budget.for_step(active)
        while self.runner.shortfall(active, budgets) > 0:
            if self.prefilling:
                self._preempt(self.prefilling[-1])
                continue
            idle = [s for s in self.running if s not in active and not s.finished]  # beside a suspect retried alone
            if idle:
                self._preempt(idle[-1])
                continue
            if len(active) == 1:
                break
            victim = next(s for s in reversed(self.running) if s in active)  # the most recently admitted
            self._preempt(victim)
            active = [s for s in active if s is not victim]
            budgets = self.budget.for_step(active)
        return active, budgets

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
        if prefill:  # give the rows and their blocks back and prefill them again, one at a time
            for seq in reversed(seqs):
                self.runner.free_row(seq, reusable=False)
                self.waiting.appendleft(seq)
            self.prefill_alone = len(seqs)
        else:
            self.suspects.extend(seqs)
        return []

    def _prefill_chunk(self, deltas: dict[str, str], step_seconds: float | None):
        """The next chunk of the long prompt with the fewest tokens left (a short one that had to be chunked does
        not wait out a file-sized one): what the step that just ran leaves of STEP_BUDGET_SECONDS (at least
        CHUNK_STEP_FRACTION of it), or about LONE_CHUNK_SECONDS when nothing else runs. The last chunk draws the
        first token and the sequence joins the running ones. Returns (joined, failed)."""
        seq = self._shortest_prefilling()
        left = len(seq.token_ids) - seq.prefilled
        if step_seconds is None or not self.running:
            tokens = max(MIN_CHUNK, min(int(self.chunk_rate * LONE_CHUNK_SECONDS), MAX_PREFILL_TOKENS)) \
                if self.chunk_rate else LONE_FIRST_CHUNK
        else:
            budget = max(CHUNK_STEP_FRACTION * step_seconds, STEP_BUDGET_SECONDS - step_seconds)
            tokens = max(MIN_CHUNK, min(int(self.chunk_rate * budget), MAX_PREFILL_TOKENS)) if self.chunk_rate \
                else FIRST_CHUNK
        if not self.runner.chunk_fits(seq, min(tokens, left) + (self.runner.tree_room + 1 if tokens >= left else 0)):
            if self.running:
                return [], []  # the pool is short: the running sequences free blocks as they finish
            others = [s for s in self.prefilling if s is not seq]
            if others:
                self._preempt(others[-1])
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

    def _shortest_prefilling(self) -> Sequence:
        """Of the prompts being prefilled, the one with the fewest tokens left (the next to get a chunk)."""
        return min(self.prefilling, key=lambda s: len(s.token_ids) - s.prefilled)

    def _riding_chunk(self, active: list[Sequence], budgets: list[int]) -> tuple[Sequence, int] | None:
        """The long prompt (the fewest tokens left first) and how many of its tokens ride in this step, or None:
        none is being prefilled, it cannot ride, its last token is next (that one goes through prefill, which draws
        the first token), or the pool has no room for the step and the chunk together."""
        if not self.prefilling or not self.runner.rides_chunks:
            return None
        seq = self._shortest_prefilling()
        tokens = min(self.ride_tokens, len(seq.token_ids) - seq.prefilled - 1)
        if tokens < 1 or not self.runner.chunk_fits_beside(active, budgets, seq, tokens):
            return None
        return seq, tokens

    def _rode(self, tokens: int, seconds: float) -> None:
        """After a step that carried `tokens` of a prompt in `seconds`: the next chunk scaled towards the budget."""
        target = max(STEP_BUDGET_SECONDS, (1 + CHUNK_STEP_FRACTION) * (self.free_step or 0.0))
        scale = min(2.0, max(0.5, target / max(seconds, 1e-6)))
        self.ride_tokens = max(MIN_CHUNK, min(int(tokens * scale), MAX_PREFILL_TOKENS))
        self.runner.slots.stats.chunks += 1

    def step(self) -> SchedulerOutput:
        runner, controller = self.runner, self.budget.controller
        start = time.perf_counter()
        preempted = self.pool.stats.preemptions
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
            riding = None
            if active:
                try:
                    active, budgets = self._make_room(active)
                    riding = self._riding_chunk(active, budgets)
                    deltas.update(zip((s.request_id for s in active), runner.step(active, budgets, riding)))
                    report = runner.last_report
                    wall = time.perf_counter() - start - report.join_time
                    if riding is not None:
                        self._rode(riding[1], wall)
                    else:
                        self.free_step = wall
                        if controller is not None:  # (a step that carried a chunk says little about drafting)
                            controller.observe(active, max(budgets), report, wall)
                except Exception as exc:
                    failed = self._failed(active, exc, prefill=False)
                    active, report, riding = [], None, None
            if self.prefilling and riding is None:
                joined, chunk_failed = self._prefill_chunk(deltas, time.perf_counter() - start if active else None)
                joining += joined
                failed += chunk_failed
        finished = [s for s in self.running if s.finished]
        for seq in finished:
            self._release(seq)
        return SchedulerOutput(deltas, joining, active, finished, report, time.perf_counter() - start, failed,
                               self.pool.stats.preemptions - preempted)
