"""Per-token latency, percentiles and the accepted-length histogram, against brute force."""
import random

import numpy as np
import pytest

from specdecode.bench.measure import EngineTotals, LatencyClock, Trace, accepted_length_counts, percentile
from specdecode.engine.sequence import SpecStats


def test_percentile_matches_numpy():
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        values = [rng.random() for _ in range(n)]
        for q in (0, 50, 99, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([], 50) == 0.0


def test_accepted_length_counts_match_the_steps():
    rng = random.Random(1)
    stats, accepted = SpecStats(), []
    for _ in range(300):
        draft_len = rng.choice([0, 3, 5])
        n = rng.randint(0, draft_len)
        stats.record_step(draft_len, n, 0.0, 0.0)
        if draft_len:
            accepted.append(n)
    counts = accepted_length_counts(stats)
    assert sum(counts) == stats.drafts == len(accepted)
    assert counts == [accepted.count(n) for n in range(max(accepted) + 1)]


def test_latency_clock_spreads_a_burst_over_its_tokens(monkeypatch):
    now = iter([0.0, 0.5, 0.6, 0.9, 1.0])  # start, then the time of each delivery
    monkeypatch.setattr("specdecode.bench.measure.time.perf_counter", lambda: next(now))
    clock = LatencyClock()
    clock.delivered(1)  # prefill's token at 0.5
    clock.delivered(1)  # 0.1 later
    clock.delivered(3)  # a burst of 3, 0.3 after the previous one
    clock.delivered(0)  # nothing new: no time is read, nothing counted
    assert clock.ttft == pytest.approx(0.5)
    assert clock.latencies == pytest.approx([0.1, 0.1, 0.1, 0.1])


def test_totals_summary_shares_and_rates():
    stats = SpecStats()
    stats.record_step(4, 2, draft_time=0.25, verify_time=0.5)
    stats.record_step(4, 4, draft_time=0.25, verify_time=0.5)
    totals = EngineTotals()
    totals.add(Trace(list(range(9)), seconds=2.0, ttft=0.1, token_latencies=[0.2] * 8, stats=stats))
    s = totals.summary()
    assert s["tokens_per_s"] == 4.5
    assert s["mean_accepted_len"] == 4.0 and s["acceptance_rate"] == 0.75
    assert (s["draft_share"], s["verify_share"], s["other_share"]) == pytest.approx((0.25, 0.5, 0.25))
    assert s["accepted_len_counts"] == [0, 0, 1, 0, 1]
    assert s["latency_p50_s"] == pytest.approx(0.2)
