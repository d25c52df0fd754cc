"""Prometheus metrics of one engine, named like vLLM's, in a registry of its own (never the global default one,
so two engines in a process, or tests, do not collide). Counters only count; rates are left to the dashboard
(docs/metrics.md gives the PromQL beside each name; /dashboard and docs/grafana/specdecode.json draw them).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdecode.engine.scheduler import SchedulerOutput

PREFIX = "specdecode:"
SPEEDUP_DECAY = 0.98
"""Weight of the past in the realised-speedup gauge (it follows roughly the last 50 steps)."""

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0, 80.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class EngineMetrics:
    def __init__(self, max_positions: int = 16):
        self.registry = CollectorRegistry()
        r = self.registry
        self.num_drafts = Counter(PREFIX + "spec_decode_num_drafts", "Sequence-steps that verified a draft.",
                                  registry=r)
        self.num_draft_tokens = Counter(PREFIX + "spec_decode_num_draft_tokens", "Draft tokens proposed.",
                                        registry=r)
        self.num_accepted_tokens = Counter(PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                           registry=r)
        self.num_emitted_tokens = Counter(PREFIX + "spec_decode_num_emitted_tokens",
                                          "Tokens the verifier emitted in steps that drafted: accepted + one per "
                                          "step (before stop conditions cut any).", registry=r)
        self.accepted_per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (0-based).", ["position"],
                                        registry=r)
        self._pos_children = [self.accepted_per_pos.labels(position=str(i)) for i in range(max_positions)]
        self.drafts_per_pos = Counter(PREFIX + "spec_decode_num_drafts_per_pos",
                                      "Sequence-steps whose draft reached each position (0-based depth; a tree counts "
                                      "once per level): the denominator of the acceptance at that position.",
                                      ["position"], registry=r)
        self._drafted_children = [self.drafts_per_pos.labels(position=str(i)) for i in range(max_positions)]
        self.draft_tokens_by_method = Counter(PREFIX + "spec_decode_num_draft_tokens_by_method",
                                              "Draft tokens proposed, by the method that proposed them.", ["method"],
                                              registry=r)
        self.accepted_tokens_by_method = Counter(PREFIX + "spec_decode_num_accepted_tokens_by_method",
                                                 "Draft tokens accepted, by the method that proposed them.",
                                                 ["method"], registry=r)
        self.method = "unknown"
        """The label of the by-method counters (watch() sets the engine's)."""
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.prefix_cache_queries = Counter(PREFIX + "prefix_cache_queries",
                                            "Tokens of the sequences prefilled (a preempted one again when it "
                                            "rejoins; vLLM's name).", registry=r)
        self.prefix_cache_hits = Counter(PREFIX + "prefix_cache_hits",
                                         "Of those, tokens whose keys and values the cache already held.", registry=r)
        self.preemptions = Counter(PREFIX + "num_preemptions",
                                   "Running requests whose KV blocks were taken back when the pool ran short "
                                   "(recomputed when they rejoin; vLLM's name).", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                ["finished_reason"], registry=r)
        self.failed_requests = Counter(PREFIX + "request_failure", "Requests that failed inside the engine.",
                                       registry=r)
        self.draft_time = Histogram(PREFIX + "spec_decode_draft_time_seconds", "Time proposing, per step.",
                                    buckets=_STEP_BUCKETS, registry=r)
        self.verify_time = Histogram(PREFIX + "spec_decode_verify_time_seconds",
                                     "Time in the target pass, verification and commit, per step.",
                                     buckets=_STEP_BUCKETS, registry=r)
        self.accepted_per_step = Histogram(PREFIX + "spec_decode_accepted_tokens_per_step",
                                           "Draft tokens accepted per sequence per step that drafted.",
                                           buckets=tuple(range(max_positions + 1)), registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between successive deliveries of new tokens to a request.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to the last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge(PREFIX + "num_requests_running",
                             "Requests holding a cache row: decoding, or their long prompt being prefilled in chunks.",
                             registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests queued for a slot.", registry=r)
        self.speedup = Gauge(PREFIX + "spec_decode_realised_speedup",
                             "Recent tokens emitted x measured plain-step time / actual time (1 = plain decoding).",
                             registry=r)
        self.speedup.set(1.0)
        self.plain_equivalent_seconds = Counter(PREFIX + "spec_decode_plain_equivalent_seconds",
                                                "Seconds plain decoding would have taken for the tokens decode steps "
                                                "emitted (the cost model's plain-step time).", registry=r)
        self.actual_seconds = Counter(PREFIX + "spec_decode_actual_seconds",
                                      "Seconds those decode steps took: realised speedup over a window = rate of "
                                      "plain_equivalent_seconds / rate of this.", registry=r)
        self.batch_size = Histogram(PREFIX + "decode_batch_size", "Sequences per decode step.",
                                    buckets=_BATCH_BUCKETS, registry=r)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc",
                              "Share (0-1) of the KV cache in use: paged, blocks referenced by a request; slots "
                              "layout, positions (slots x context) that hold tokens.", registry=r)
        self.blocks_used = Gauge(PREFIX + "kv_cache_blocks_used", "Paged KV-cache blocks referenced by requests.",
                                 registry=r)
        self.blocks_cached = Gauge(PREFIX + "kv_cache_blocks_cached",
                                   "Paged KV-cache blocks no request holds that keep indexed content (a later prompt "
                                   "may share them; evicted first when the pool needs room).", registry=r)
        self.blocks_free = Gauge(PREFIX + "kv_cache_blocks_free",
                                 "Paged KV-cache blocks a request can take now (empty and cached).", registry=r)
        self._plain_equivalent = 0.0  # decayed seconds plain decoding would have taken for the same tokens
        self._actual = 0.0  # decayed seconds actually taken

    def watch(self, scheduler, max_model_len: int, method: str | None, proposer=None) -> None:
        """Read the engine's state at each scrape from now on: the KV cache's use from the scheduler's running
        sequences (its slots of max_model_len positions); method names the by-method counters (None = plain); a
        proposer that combines sources (auto: `counts`, source -> [proposed, accepted]) gives the by-source ones."""
        capacity = scheduler.num_slots * max_model_len
        runner = scheduler.runner

        def kv_usage() -> float:  # the scrape's thread: copy the list the engine thread changes
            if runner.paged:
                pool = runner.cache.pool
                return pool.used / pool.num_blocks
            return sum(len(seq.token_ids) for seq in list(scheduler.running)) / capacity

        def pool_figure(name: str):
            def read() -> float:
                return getattr(runner.cache.pool, name) if runner.paged else 0.0
            return read

        self.kv_usage.set_function(kv_usage)
        self.blocks_used.set_function(pool_figure("used"))
        self.blocks_free.set_function(pool_figure("available"))
        self.blocks_cached.set_function(lambda: len(runner.cache.pool.cached) if runner.paged else 0.0)
        self.method = method or "none"
        counts = getattr(proposer, "counts", None)
        if isinstance(counts, dict):
            self.registry.register(_SourceCounts(counts))

    def record_step(self, out: SchedulerOutput, emitted: list[int], plain_step_time: float | None) -> None:
        """A decode step: `emitted[i]` tokens went to out.stepped[i]; plain_step_time = the cost model's estimate of
        a plain step at this batch size (None without a cost model)."""
        report = out.report
        self.draft_time.observe(report.draft_time)
        self.verify_time.observe(report.verify_time)
        self.batch_size.observe(len(out.stepped))
        drafts = draft_tokens = accepted_tokens = 0
        depths = report.draft_depths or report.draft_lens  # (a chain's depth is its length)
        for drafted, accepted, depth in zip(report.draft_lens, report.accepted_lens, depths):
            if not drafted:
                continue
            drafts += 1
            draft_tokens += drafted
            accepted_tokens += accepted
            self.accepted_per_step.observe(accepted)
            for pos in range(min(depth, len(self._drafted_children))):
                self._drafted_children[pos].inc()
            for pos in range(min(accepted, len(self._pos_children))):
                self._pos_children[pos].inc()
        if drafts:
            self.num_drafts.inc(drafts)
            self.num_draft_tokens.inc(draft_tokens)
            self.num_accepted_tokens.inc(accepted_tokens)
            self.num_emitted_tokens.inc(accepted_tokens + drafts)
            self.draft_tokens_by_method.labels(method=self.method).inc(draft_tokens)
            self.accepted_tokens_by_method.labels(method=self.method).inc(accepted_tokens)
        total = sum(emitted)
        self.generation_tokens.inc(total)
        if plain_step_time is not None and out.stepped:
            # Plain decoding emits one token per sequence per step.
            plain = total / len(out.stepped) * plain_step_time
            self.plain_equivalent_seconds.inc(plain)
            self.actual_seconds.inc(out.wall_time)
            self._plain_equivalent = SPEEDUP_DECAY * self._plain_equivalent + plain
            self._actual = SPEEDUP_DECAY * self._actual + out.wall_time
            self.speedup.set(self._plain_equivalent / self._actual)

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)

    def samples(self) -> dict[str, float]:
        """The values render() writes, but histogram buckets and creation times, keyed as it writes them:
        'name' or 'name{label="value"}'."""
        values = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith(("_bucket", "_created")):
                    continue
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return values


class _SourceCounts:
    """Draft tokens proposed and accepted per source of a combining proposer, read at each scrape (a node that two
    sources proposed counts for both)."""

    def __init__(self, counts: dict[str, list[int]]):
        self.counts = counts

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        proposed = CounterMetricFamily(PREFIX + "spec_decode_num_draft_tokens_by_source",
                                       "Draft tokens in verified trees, by the source that proposed them (auto).",
                                       labels=["source"])
        accepted = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_by_source",
                                       "Draft tokens accepted, by the source that proposed them (auto).",
                                       labels=["source"])
        for source, (p, a) in list(self.counts.items()):
            proposed.add_metric([source], p)
            accepted.add_metric([source], a)
        yield proposed
        yield accepted
