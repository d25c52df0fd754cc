"""The cost gate (speculation/control.py CostGate) as the state machine it is: every transition asserted on the state
it leaves, for every order of winning and losing verdicts a request can see; and through SpecController, a request
whose drafting stops paying and then pays again. The clock is the test's: each step's wall time is set here."""
import itertools
import math
from types import SimpleNamespace

import pytest

from specdecode.engine.step import StepReport
from specdecode.sampling import SamplingParams
from specdecode.speculation.control import (GATE_EVIDENCE, MAX_PROBE_INTERVAL, PLAIN_REFRESH, CostGate,
                                            SpecController)
from specdecode.speculation.cost import CostModel

MAX_K, PROBE_EVERY = 4, 4
PLAIN = 0.010
"""Seconds of a plain step (one token)."""


class Request:
    """One request's steps through a gate, each at the wall time the test gives it."""

    def __init__(self, gate: CostGate, request_id: str = "r"):
        self.gate, self.id = gate, request_id
        gate.cap(request_id)  # (its state starts at its first question)

    @property
    def state(self) -> dict:
        return self.gate.requests[self.id]

    def plain(self, wall: float = PLAIN) -> None:
        self.gate.observe(self.id, 0, 1, wall, PLAIN)

    def draft(self, depth: int, tokens: int, wall: float) -> None:
        self.gate.observe(self.id, depth, tokens, wall, PLAIN)

    def verdict(self, win: bool) -> int:
        """Drafting steps at the request's cap until the gate judges them (the plain steps its timing asks for between
        them); how many it took. A win: every level accepted, each costing a quarter of a plain step ((d + 1) tokens
        in (1 + d / 4) plain steps' time); a loss: one accepted, in three plain steps' time (ratio 2/3)."""
        depth = self.gate.cap(self.id)
        assert depth > 0, "no verdict without drafting"
        steps = 0
        while True:
            assert steps < 2 * GATE_EVIDENCE, "the gate never judged these steps"
            if self.gate.timing(self.id):
                self.plain()
                continue
            if win:
                self.draft(depth, depth + 1, PLAIN * (1 + depth / 4))
            else:
                self.draft(depth, 2, 3 * PLAIN)
            steps += 1
            if self.state["steps"] == 0:  # judged: the sums start again
                return steps

    def plain_until_probe(self) -> int:
        """Plain steps a request held at cap 0 takes before the gate lets it probe at one level."""
        waited = 0
        while self.gate.cap(self.id) == 0:
            assert waited <= 2 * MAX_PROBE_INTERVAL, "never probed"
            self.plain()
            waited += 1
        assert self.gate.cap(self.id) == 1
        return waited


def promised(win: bool, cap: int, interval: int) -> tuple[int, int]:
    """(cap, probe interval) the gate's docstring promises after a verdict on drafting at `cap` (0: a probe at one
    level), the loss being by 2/3 of plain's rate at the cap's own depth (so its cut is a halving)."""
    if win:
        return min(MAX_K, max(1, 2 * cap)), PROBE_EVERY
    if cap == 0:
        return 0, min(2 * interval, MAX_PROBE_INTERVAL)
    return cap // 2, interval


def judged_again(state: dict) -> bool:
    """The sums a verdict judges are empty: the next verdict judges only the cap this one set."""
    return state["seconds"] == state["tokens"] == state["steps"] == state["deepest"] == 0


def test_a_new_request_starts_at_the_most_with_a_plain_step_to_time_its_rate():
    gate = CostGate(MAX_K, PROBE_EVERY)
    request = Request(gate)
    assert gate.cap("r") == MAX_K and gate.timing("r")
    assert {k: request.state[k] for k in ("cap", "interval", "wait", "plain")} == {
        "cap": MAX_K, "interval": PROBE_EVERY, "wait": PROBE_EVERY, "plain": None}
    request.plain()
    assert request.state["plain"] == PLAIN and not gate.timing("r")
    assert request.state["wait"] == PROBE_EVERY  # plain steps count towards a probe only at cap 0
    for _ in range(PLAIN_REFRESH - 1):
        request.draft(1, 1, 0.001)  # (fast steps: no verdict can lower the cap)
        assert not gate.timing("r")
    request.draft(1, 1, 0.001)
    assert gate.timing("r") and request.state["since_plain"] == PLAIN_REFRESH
    request.plain()
    assert not gate.timing("r") and request.state["since_plain"] == 0


def test_the_plain_rate_fades_and_a_stalled_step_counts_for_at_most_twice_the_kept_one():
    gate = CostGate(MAX_K, PROBE_EVERY)
    request = Request(gate)
    request.plain(0.010)
    request.plain(0.014)
    assert request.state["plain"] == pytest.approx(0.012)
    request.plain(1.0)  # a step stalled by other work: counted as 2 x 0.012
    assert request.state["plain"] == pytest.approx(0.018)


def test_a_verdict_waits_for_its_evidence_unless_drafting_takes_twice_plains_time():
    gate = CostGate(MAX_K, PROBE_EVERY)
    request = Request(gate)
    gate.observe("r", MAX_K, 1, 10 * PLAIN, None)
    gate.observe("r", MAX_K, 1, 10 * PLAIN, None)
    assert request.state["cap"] == MAX_K and request.state["steps"] == 2  # no plain rate known: nothing to judge by
    request.draft(MAX_K, 1, 10 * PLAIN)  # judged by the engine's plain step: 3 tokens in 30 plain steps' time
    assert request.state["cap"] == 0 and judged_again(request.state)

    gate = CostGate(MAX_K, PROBE_EVERY)
    request = Request(gate)
    request.plain()
    for step in range(math.ceil(GATE_EVIDENCE / 2) - 1):  # 2 tokens in 2.1 plain steps: losing, a little
        request.draft(MAX_K, 2, 2.1 * PLAIN)
        assert request.state["cap"] == MAX_K and request.state["steps"] == step + 1
    request.draft(MAX_K, 2, 2.1 * PLAIN)
    assert request.state["cap"] == MAX_K // 2 and judged_again(request.state)

    request.draft(2, 1, 2.1 * PLAIN)  # one token in 2.1 plain steps: judged at the second step
    assert request.state["cap"] == 2
    request.draft(2, 1, 2.1 * PLAIN)
    assert request.state["cap"] == 0 and request.state["wait"] == PROBE_EVERY and judged_again(request.state)


@pytest.mark.parametrize("depth, tokens, plain_steps, cap", [
    (MAX_K, 2, 3, MAX_K // 2),  # 2/3 of plain's rate: halved
    (MAX_K, 2, 7, 1),  # 2/7: cut by the ratio, below a halving
    (1, 2, 3, 0),  # a cap of 4 that drafted one level: cut below the deepest draft judged
    (2, 3, 4, 1),
])
def test_a_losing_verdict_cuts_by_half_by_its_ratio_or_below_its_deepest_draft(depth, tokens, plain_steps, cap):
    gate = CostGate(MAX_K, PROBE_EVERY)
    request = Request(gate)
    request.plain()
    while request.state["cap"] == MAX_K:
        request.draft(depth, tokens, plain_steps * PLAIN)
    assert request.state["cap"] == cap and request.state["interval"] == PROBE_EVERY and judged_again(request.state)
    assert gate.start_cap == cap  # what the next request starts at


def test_a_verdict_judges_only_the_drafts_since_the_last_one():
    """Four levels paid; then the controller drafts one level a step (the cap still 4) and loses: the cut goes below
    that one level, to 0, not below the four levels an earlier verdict judged."""
    gate = CostGate(MAX_K, PROBE_EVERY)
    request = Request(gate)
    request.plain()
    request.verdict(win=True)
    assert request.state["cap"] == MAX_K
    for _ in range(math.ceil(GATE_EVIDENCE / 2)):
        request.draft(1, 2, 3 * PLAIN)
    assert request.state["cap"] == 0 and judged_again(request.state)


def test_probes_back_off_to_the_most_and_a_paying_probe_resets_them_for_this_request_and_new_ones():
    """Held at cap 0, a request probes at one level after PROBE_EVERY plain steps; each losing probe doubles the wait
    (up to MAX_PROBE_INTERVAL), and every new request starts with it; one paying probe brings it back to PROBE_EVERY,
    for this request and the next."""
    gate = CostGate(MAX_K, PROBE_EVERY)
    request = Request(gate)
    request.plain()
    while request.state["cap"]:
        request.verdict(win=False)
    waits, interval = [], PROBE_EVERY
    while len(waits) < 2 or waits[-2] < MAX_PROBE_INTERVAL:
        waits.append(request.plain_until_probe())
        request.verdict(win=False)
        interval = min(2 * interval, MAX_PROBE_INTERVAL)
        assert (request.state["cap"], request.state["interval"], request.state["wait"]) == (0, interval, interval)
        fresh = Request(gate, "fresh")
        assert (gate.cap("fresh"), fresh.state["interval"], fresh.state["wait"]) == (0, interval, interval)
        gate.forget("fresh")
    doubling = [PROBE_EVERY * 2 ** i for i in range(int(math.log2(MAX_PROBE_INTERVAL / PROBE_EVERY)) + 1)]
    assert waits == doubling + [MAX_PROBE_INTERVAL]

    assert request.plain_until_probe() == MAX_PROBE_INTERVAL
    request.verdict(win=True)
    assert (request.state["cap"], request.state["interval"]) == (1, PROBE_EVERY)
    fresh = Request(gate, "fresh")
    assert (gate.cap("fresh"), fresh.state["interval"], fresh.state["wait"]) == (1, PROBE_EVERY, PROBE_EVERY)
    request.verdict(win=False)  # the paying probe's cap loses: the next probe comes after PROBE_EVERY, not 512
    assert request.state["cap"] == 0 and request.plain_until_probe() == PROBE_EVERY


ORDERS = ["".join(order) for n in (6, 7) for order in itertools.product("WL", repeat=n)]
"""Every order of wins (W) and losses (L) in six and seven verdicts: from the most, three losses reach cap 0, four
more a back-off of 64 plain steps; three wins climb back from 0 to the most."""


@pytest.mark.parametrize("verdicts", ORDERS)
def test_every_order_of_wins_and_losses(verdicts):
    """After each verdict: the cap and probe interval the gate promises (promised()), the sums emptied, the probe's
    wait set by a loss, the drafting steps it took to judge (GATE_EVIDENCE tokens in), the plain steps before each
    probe equal to the interval in force, and a new request starting where the verdict left."""
    gate = CostGate(MAX_K, PROBE_EVERY)
    request = Request(gate)
    request.plain()
    cap, interval = MAX_K, PROBE_EVERY
    for n, verdict in enumerate(verdicts):
        win = verdict == "W"
        if cap == 0:
            assert request.plain_until_probe() == interval, (verdicts[:n], interval)
        depth = gate.cap("r")
        steps = request.verdict(win)
        assert steps == math.ceil(GATE_EVIDENCE / (depth + 1 if win else 2))
        cap, interval = promised(win, cap, interval)
        state = request.state
        assert (state["cap"], state["interval"]) == (cap, interval), (verdicts[:n + 1], state)
        assert judged_again(state) and gate.cap("r") == cap  # (at cap 0: no probe before its wait)
        if not win:
            assert state["wait"] == interval
        fresh = Request(gate, "fresh")
        assert (gate.cap("fresh"), fresh.state["interval"], fresh.state["wait"]) == (cap, interval, interval)
        assert gate.timing("fresh")
        gate.forget("fresh")
    if verdicts.endswith("WWW"):
        assert (cap, interval) == (MAX_K, PROBE_EVERY)  # whatever came before, three wins restore the start


class FrozenCosts(CostModel):
    """Costs under which drafting every level always looks worth it: measurements do not move them, so the gate
    alone decides what a request drafts."""

    def __init__(self):
        super().__init__({k: {1: PLAIN} for k in range(MAX_K + 1)}, {1: PLAIN / 100}, max_batch=1)

    def observe(self, *args, **kwargs) -> None:
        pass


def decode(controller: SpecController, request_id: str, level_cost: float, done, most: int = 2000) -> list[int]:
    """Steps of one request through the controller until done(levels so far) holds, each drafting what choose() and
    caps() allow, with every draft accepted, and taking PLAIN + level_cost per level drafted; the levels of each."""
    seqs = [SimpleNamespace(request_id=request_id, params=SamplingParams())]
    levels = []
    while not done(levels):
        assert len(levels) < most, f"still not done after {most} steps: {levels[-40:]}"
        k = min(controller.choose(seqs), controller.caps(seqs)[0])
        wall = PLAIN + level_cost * k
        controller.observe(seqs, k, StepReport(1 + k, 0.0, wall, [k], [k], draft_depths=[k]), wall_time=wall)
        levels.append(k)
    return levels


def plain_runs_before_drafting(levels: list[int]) -> list[int]:
    """Lengths of the runs of plain steps that end in a drafting step."""
    runs, run = [], 0
    for k in levels:
        if k:
            if run:
                runs.append(run)
            run = 0
        else:
            run += 1
    return runs


def test_a_request_whose_drafting_stops_paying_then_pays_again_gets_its_cap_and_probe_interval_back():
    """Drafting pays, then each level costs two plain steps (the machine got busy), then a quarter again: the cap
    falls from the most to 0 and the probes back off to 4, 8, 16, then 32 plain steps; once drafting pays, the probe
    after those 32 wins and the cap climbs back to the most, the probe interval to its start: the next time drafting
    stops paying, the first probe comes after 4 plain steps. A new request started in between starts at the most."""
    controller = SpecController(FrozenCosts(), MAX_K, probe_every=PROBE_EVERY)
    gate = controller.gate
    paying, losing = PLAIN / 4, 2 * PLAIN

    def state() -> dict:
        return gate.requests["r"]

    start = decode(controller, "r", paying, lambda levels: len(levels) == 10)
    assert start == [0] + [MAX_K] * 9  # timed first, then the most

    falling = decode(controller, "r", losing, lambda _: state()["interval"] == 8 * PROBE_EVERY)
    assert sorted(set(falling), reverse=True) == [MAX_K, MAX_K // 2, 1, 0]
    assert 0 not in falling[:falling.index(1)]  # held at 0 only once one level lost
    assert plain_runs_before_drafting(falling) == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY]
    assert state()["cap"] == 0 and gate.start_interval == 8 * PROBE_EVERY

    rising = decode(controller, "r", paying, lambda _: gate.cap("r") == MAX_K)
    assert rising[:8 * PROBE_EVERY + 1] == [0] * (8 * PROBE_EVERY) + [1]  # the back-off in force, then the probe
    climb = rising[8 * PROBE_EVERY:]
    assert climb == sorted(climb) and set(climb) == {1, MAX_K // 2}
    assert (state()["cap"], state()["interval"]) == (MAX_K, PROBE_EVERY) and controller.probe_interval == PROBE_EVERY
    assert decode(controller, "next", paying, lambda levels: len(levels) == 3) == [0, MAX_K, MAX_K]
    assert gate.requests["next"]["interval"] == PROBE_EVERY  # a new request starts where "r" came back to
    controller.forget("next")

    again = decode(controller, "r", losing, lambda levels: levels[-2:] == [0, 1])
    assert again[:2] == [MAX_K] * 2 and plain_runs_before_drafting(again) == [PROBE_EVERY]
