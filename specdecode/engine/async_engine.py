"""The server's engine: one background thread steps the scheduler; asyncio handlers add requests and read each
request's new text from a queue of its own. Requests beyond the cache slots wait in the scheduler's queue, and
beyond `max_waiting` waiting requests new ones are refused rather than queued without bound.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import traceback
import uuid

from specdecode.engine.llm import LLM
from specdecode.engine.metrics import EngineMetrics
from specdecode.engine.scheduler import Scheduler, SchedulerOutput
from specdecode.engine.sequence import Sequence
from specdecode.sampling import SamplingParams

log = logging.getLogger("specdecode.engine")


class EngineOverloaded(Exception):
    """Every slot is busy and the waiting queue is full: try again later."""


class EngineDead(Exception):
    """The engine's thread is not running."""


class RequestAborted(Exception):
    """The request was aborted (its client went away)."""


class RequestFailed(Exception):
    """The step that carried this request raised; the message says why."""


@dataclasses.dataclass
class StreamDelta:
    """New output of one request."""

    text: str
    """Text added since the last delta."""
    token_ids: list[int]
    """Token ids added since the last delta."""
    finish_reason: str | None
    """None while running, then "stop" or "length"."""
    prompt_tokens: int
    completion_tokens: int
    """Tokens generated so far."""


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
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if item.finish_reason is not None:
            self.done = True
        return item

    def abort(self) -> None:
        """Stop generating; a reader still waiting on this stream gets RequestAborted."""
        if not self.done and not self.aborted:
            self.aborted = True
            self.engine.abort(self.request_id)
            self.queue.put_nowait(RequestAborted(self.request_id))


class AsyncEngine:
    def __init__(self, llm: LLM, max_waiting: int = 256):
        self.llm = llm
        self.max_waiting = max_waiting
        tree = llm.spec_config.tree_size if llm.proposer is not None else 0
        llm.runner.ensure_capacity(llm.max_num_seqs, llm.max_model_len, tree)
        if llm.proposer is not None and llm.controller is None:
            # Fixed K: the cost model still runs, for the realised-speedup gauge.
            llm.controller = llm.make_controller()
            llm.controller.fixed_k = llm.spec_config.num_speculative_tokens
        self.scheduler = Scheduler(llm, llm.max_num_seqs)
        self.metrics = EngineMetrics(max_positions=max(tree, 1))
        self._cond = threading.Condition()
        self._incoming: list[RequestStream] = []
        self._aborts: list[str] = []
        self._in_system = 0  # requests added and not yet finished or dropped (guarded by _cond)
        self._requests: dict[str, RequestStream] = {}  # engine thread only
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="specdecode-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def capacity(self) -> int:
        """Requests the engine holds at once: running in a slot or waiting for one."""
        return self.llm.max_num_seqs + self.max_waiting

    # -- requests (event-loop side) -------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None) -> RequestStream:
        """Queue a request; raises ConfigError for a bad prompt, EngineOverloaded when full, EngineDead."""
        if not self.alive:
            raise EngineDead("the engine is not running")
        seq = self.llm.make_sequence(prompt, params, request_id or uuid.uuid4().hex)
        stream = RequestStream(self, seq, asyncio.get_running_loop())
        with self._cond:
            if self._in_system >= self.capacity:
                raise EngineOverloaded(f"all {self.llm.max_num_seqs} slots are busy and {self.max_waiting} requests "
                                       "are already waiting; retry later")
            self._in_system += 1
            self._incoming.append(stream)
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    # -- the step loop (engine thread) ----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._incoming or self._aborts or self.scheduler.has_work or self._stopping):
                    self._cond.wait()
                if self._stopping:
                    break
                incoming, self._incoming = self._incoming, []
                aborts, self._aborts = self._aborts, []
            for stream in incoming:
                self._requests[stream.request_id] = stream
                self.scheduler.add(stream.seq)
            for request_id in aborts:
                self.scheduler.abort(request_id)
                self._forget(request_id)
            if self.scheduler.has_work:
                try:
                    self._publish(self.scheduler.step())
                except Exception as exc:  # a bug, not bad input (that is refused before it gets here)
                    log.error("engine step failed; failing its requests\n%s", traceback.format_exc())
                    self._fail_all(exc)
            self.metrics.running.set(len(self.scheduler.running))
            self.metrics.waiting.set(len(self.scheduler.waiting))
        for seq in self.scheduler.abort_all():
            self._deliver_error(seq.request_id, EngineDead("the engine shut down"))

    def _forget(self, request_id: str) -> RequestStream | None:
        stream = self._requests.pop(request_id, None)
        if stream is not None:
            with self._cond:
                self._in_system -= 1
        return stream

    def _publish(self, out: SchedulerOutput) -> None:
        now = time.perf_counter()
        batch: list[tuple[RequestStream, StreamDelta]] = []
        metrics = self.metrics
        for seq in out.prefilled:
            metrics.prompt_tokens.inc(seq.num_prompt)
        emitted = []
        for seq in out.prefilled + out.stepped:
            stream = self._requests.get(seq.request_id)
            if stream is None:
                emitted.append(0)
                continue
            new_ids = seq.token_ids[seq.num_prompt + stream.sent:]
            emitted.append(len(new_ids))
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
                                                  seq.num_generated)))
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

    def _fail_all(self, exc: Exception) -> None:
        for seq in self.scheduler.abort_all():
            self._deliver_error(seq.request_id, RequestFailed(f"generation failed: {exc}"))


def _put_all(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)
