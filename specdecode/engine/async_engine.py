"""The server's engine: one background thread steps the scheduler; asyncio handlers add requests and read each
request's new text from a queue of its own. Requests beyond the cache slots wait in the scheduler's queue, and
beyond `max_waiting` waiting requests new ones are refused rather than queued without bound.

A request that makes a step fail fails alone (the scheduler retries the batch one sequence at a time); its client
gets a generic message and the details go to the log. If the thread itself dies, every request it held fails and
`health()` says so, as it does when one step has run for longer than `stall_timeout`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable

from specdecode.engine.llm import LLM
from specdecode.engine.metrics import EngineMetrics
from specdecode.engine.scheduler import SchedulerOutput
from specdecode.engine.sequence import Sequence
from specdecode.errors import ConfigError
from specdecode.hardware import return_free_memory
from specdecode.sampling import SamplingParams, params_tensors

log = logging.getLogger("specdecode.engine")

STALL_TIMEOUT = 300.0
"""Seconds one engine iteration may take before health() reports the engine stalled (a prefill of many long
prompts on a CPU can take minutes)."""


class EngineOverloaded(Exception):
    """Every slot is busy and the waiting queue is full: try again later."""


class EngineDead(Exception):
    """The engine's thread is not running."""


class RequestAborted(Exception):
    """The request was aborted (its client went away)."""


class RequestFailed(Exception):
    """The engine could not generate this request; the message is safe to show to its client."""


@dataclasses.dataclass
class StreamDelta:
    """New output of one request."""

    text: str
    """Text added since the last delta (while stop strings are set, the last characters wait until they cannot begin
    one, so text may lag token_ids; the final delta brings the rest)."""
    token_ids: list[int]
    """Token ids added since the last delta (after a stop string, up to the token that completed it)."""
    finish_reason: str | None
    """None while running, then "stop" or "length"."""
    prompt_tokens: int
    completion_tokens: int
    """Tokens generated so far."""
    logprobs: list | None = None
    """TokenLogprob of each of token_ids, when the request asked for logprobs."""


class RequestStream:
    """The async iterator of one request's deltas; `abort()` frees its slot (safe to call at any time)."""

    def __init__(self, engine: "AsyncEngine", seq: Sequence, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.seq = seq
        self.request_id = seq.request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = loop
        self.arrival = time.perf_counter()
        self.first_token_time: float | None = None
        self.last_token_time = 0.0
        self.sent = 0  # generated tokens already delivered
        self.done = False  # the reader has seen the last delta or an error
        self.aborted = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamDelta:
        if self.done:
            raise StopAsyncIteration
        item = None if self.aborted else await self.queue.get()
        if self.aborted:  # whatever was still queued is dropped: after abort() the reader sees RequestAborted
            self.done = True
            raise RequestAborted(self.request_id)
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if item.finish_reason is not None:
            self.done = True
        return item

    def abort(self) -> None:
        """Stop generating; the reader's next (or pending) read raises RequestAborted."""
        if not self.done and not self.aborted:
            self.aborted = True
            self.engine.abort(self.request_id)
            self.queue.put_nowait(RequestAborted(self.request_id))  # wakes a reader blocked on the queue


class AsyncEngine:
    def __init__(self, llm: LLM, max_waiting: int = 256, stall_timeout: float = STALL_TIMEOUT,
                 clock: Callable[[], float] = time.monotonic):
        """clock: seconds for the stall check (tests pass a fake one)."""
        self.llm = llm
        self.max_waiting = max_waiting
        self.stall_timeout = stall_timeout
        self._clock = clock
        tree = llm.tree_size
        llm.runner.ensure_capacity(llm.max_num_seqs, llm.max_model_len, tree)
        if llm.proposer is not None and llm.controller is None:
            # Fixed K: the cost model still runs, for the realised-speedup gauge.
            llm.controller = llm.make_controller()
            llm.controller.fixed_k = llm.spec_config.num_speculative_tokens
        self.scheduler = llm.make_scheduler(llm.max_num_seqs, isolate_failures=True)
        self.metrics = EngineMetrics(max_positions=max(tree, 1))
        self.metrics.watch(self.scheduler, llm.max_model_len,
                           llm.spec_config.method if llm.proposer is not None else None, llm.proposer)
        self._cond = threading.Condition()
        self._incoming: list[RequestStream] = []
        self._aborts: list[str] = []
        self._in_system = 0  # requests added and not yet finished or dropped (guarded by _cond)
        self._accepting = False  # (guarded by _cond) the thread runs and will see what is added
        self._requests: dict[str, RequestStream] = {}  # engine thread only
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._busy_since: float | None = None  # when the current iteration started (None between iterations)
        self._problem: str | None = None  # set by the engine thread: why it cannot make progress
        self._death: BaseException | None = None
        self.iterations = 0  # (guarded by _cond) loop iterations finished, for tests that synchronise with them

    # -- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> None:
        with self._cond:
            self._accepting = True
        self._thread = threading.Thread(target=self._run, name="specdecode-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and self._accepting and not self._stopping)

    def health(self) -> str | None:
        """None when the engine can serve, else why it cannot (dead, stalled in a step, or slots leaked)."""
        if not self.alive:
            cause = f" ({type(self._death).__name__})" if self._death is not None else ""
            return f"the engine is not running{cause}"
        busy = self._busy_since
        if busy is not None and self._clock() - busy > self.stall_timeout:
            return (f"the engine has been inside one iteration for {self._clock() - busy:.0f} s "
                    f"(more than {self.stall_timeout:g} s)")
        return self._problem

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is held (True), or until timeout seconds passed (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._in_system == 0, timeout)

    @property
    def capacity(self) -> int:
        """Requests the engine holds at once: running in a slot or waiting for one."""
        return self.llm.max_num_seqs + self.max_waiting

    # -- requests (event-loop side) -------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, grammar=None) -> RequestStream:
        """Queue a request; raises ConfigError for a bad prompt, EngineOverloaded when full, EngineDead. grammar: a
        structured request's compiled grammar (else it is compiled here)."""
        if not self.alive:
            raise EngineDead("the engine is not running")
        self._check(prompt, params)
        seq = self.llm.make_sequence(prompt, params, request_id or uuid.uuid4().hex, grammar)
        stream = RequestStream(self, seq, asyncio.get_running_loop())
        with self._cond:
            if not self._accepting:
                raise EngineDead("the engine is not running")
            if self._in_system >= self.capacity:
                raise EngineOverloaded(f"all {self.llm.max_num_seqs} slots are busy and {self.max_waiting} requests "
                                       "are already waiting; retry later")
            self._in_system += 1
            self._incoming.append(stream)
            self._cond.notify_all()
        return stream

    def _check(self, prompt: str | list[int], params: SamplingParams) -> None:
        """What the engine thread will do with this request's own data must not fail there."""
        if not isinstance(prompt, str):
            vocab = self.llm.target.config.vocab_size
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
                raise ConfigError(f"prompt token ids must be integers in [0, {vocab})")
        try:
            params_tensors([params])
        except Exception as exc:  # e.g. "Overflow when unpacking long long"
            raise ConfigError(f"the sampling parameters cannot be used: {exc}") from None

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify_all()

    # -- the step loop (engine thread) ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug in the loop itself: every request it holds fails below
            self._death = exc
            log.exception("the engine thread died")
        finally:
            self._drain()

    def _loop(self) -> None:
        scheduler = self.scheduler
        while True:
            if not (self._incoming or self._aborts or scheduler.can_progress):  # (read without the lock: a hint)
                return_free_memory()  # going idle: the heap's freed activations go back (a few ms)
            with self._cond:
                while not (self._incoming or self._aborts or scheduler.can_progress or self._stopping):
                    self._cond.wait()
                if self._stopping:
                    return
                incoming, self._incoming = self._incoming, []
                aborts, self._aborts = self._aborts, []
            for stream in incoming:
                self._requests[stream.request_id] = stream
                scheduler.add(stream.seq)
            for request_id in aborts:
                scheduler.abort(request_id)
                self._forget(request_id)
            if scheduler.can_progress:
                self._busy_since = self._clock()
                out = scheduler.step()
                try:
                    self._publish(out)
                except Exception as exc:  # a bug in the bookkeeping: the requests of this iteration fail, not all
                    for seq in out.prefilled + out.stepped + [seq for seq, _ in out.failed]:
                        scheduler.abort(seq.request_id)
                        self._fail(seq, exc)
                self._busy_since = None
            problem = scheduler.slot_problem()
            if problem is not None and problem != self._problem:
                log.error("%s", problem)
            self._problem = problem
            self.metrics.running.set(len(scheduler.running) + len(scheduler.prefilling))
            self.metrics.waiting.set(len(scheduler.waiting))
            with self._cond:
                self.iterations += 1
                self._cond.notify_all()

    def _drain(self) -> None:
        """The thread is ending: no request is taken any more, and every one held gets EngineDead."""
        with self._cond:
            self._accepting = False
            incoming, self._incoming = self._incoming, []
        for stream in incoming:
            self._requests[stream.request_id] = stream
        try:
            self.scheduler.abort_all()
        except Exception:
            log.exception("releasing the engine's sequences failed")
        reason = "the engine shut down" if self._death is None else "the engine stopped after an internal error"
        for request_id in list(self._requests):
            self._deliver_error(request_id, EngineDead(reason))

    def _forget(self, request_id: str) -> RequestStream | None:
        stream = self._requests.pop(request_id, None)
        if stream is not None:
            with self._cond:
                self._in_system -= 1
                self._cond.notify_all()
        return stream

    def _publish(self, out: SchedulerOutput) -> None:
        now = time.perf_counter()
        batch: list[tuple[RequestStream, StreamDelta]] = []
        metrics = self.metrics
        for seq in out.prefilled:
            metrics.prompt_tokens.inc(seq.num_prompt)
            metrics.prefix_cache_queries.inc(seq.prefill_tokens)
            metrics.prefix_cache_hits.inc(seq.reused)
        metrics.preemptions.inc(out.preempted)
        emitted = []
        for seq in out.prefilled + out.stepped:
            stream = self._requests.get(seq.request_id)
            if stream is None:
                emitted.append(0)
                continue
            new_ids = seq.token_ids[seq.num_prompt + stream.sent:]
            emitted.append(len(new_ids))
            logprobs = None if seq.logprobs is None else seq.logprobs[stream.sent:stream.sent + len(new_ids)]
            stream.sent += len(new_ids)
            if new_ids:
                if stream.first_token_time is None:
                    stream.first_token_time = now
                    metrics.ttft.observe(now - stream.arrival)
                else:
                    metrics.itl.observe(now - stream.last_token_time)
                stream.last_token_time = now
            text = out.deltas.get(seq.request_id, "")
            if text or new_ids or seq.finished:
                batch.append((stream, StreamDelta(text, new_ids, seq.finish_reason, seq.num_prompt,
                                                  seq.num_generated, logprobs)))
        if out.report is not None:
            controller = self.llm.controller
            plain = controller.costs.step_time(len(out.stepped), 0) if controller is not None else None
            metrics.record_step(out, emitted[len(out.prefilled):], plain)
        else:
            metrics.generation_tokens.inc(sum(emitted))
        for seq in out.finished:
            stream = self._forget(seq.request_id)
            if stream is not None:
                metrics.e2e.observe(now - stream.arrival)
                metrics.requests.labels(finished_reason=seq.finish_reason).inc()
        self._send(batch)
        for seq, exc in out.failed:
            self._fail(seq, exc)

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        """One request failed inside the engine: log why, tell its client only that it failed."""
        if seq.request_id not in self._requests:  # already answered (or aborted)
            return
        error_id = uuid.uuid4().hex[:12]
        log.error("request %s failed (error %s)", seq.request_id, error_id,
                  exc_info=(type(exc), exc, exc.__traceback__))
        self.metrics.failed_requests.inc()
        self._deliver_error(seq.request_id, RequestFailed(
            f"generation failed because of an internal error in the engine (error id {error_id} in the server's log)"))

    def _send(self, batch: list[tuple[RequestStream, object]]) -> None:
        """Hand items to their event loops: one wake-up per loop per step, not one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in batch:
            by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                pass

    def _deliver_error(self, request_id: str, exc: Exception) -> None:
        stream = self._forget(request_id)
        if stream is not None:
            self._send([(stream, exc)])


def _put_all(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)
