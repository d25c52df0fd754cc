"""The adaptive speculation controller against synthetic costs, and wired into LLM on tiny checkpoints."""
import random
from types import SimpleNamespace

import pytest
import torch

from specdecode.engine.step import StepReport
from specdecode.sampling import SamplingParams
from specdecode.speculation.calibrate import measure_costs
from specdecode.speculation.control import SpecController, best_tree_width
from specdecode.speculation.cost import CostModel, Curve

BATCHES = (1, 2, 4, 8, 16, 32)
MAX_K = 5


def synthetic_costs(memory_s=0.010, per_token_s=0.0005, draft_s=0.001, draft_per_seq_s=0.00002,
                    cls=CostModel) -> CostModel:
    """A roofline-shaped target: a pass costs max(weight reads, compute), compute growing with tokens verified."""
    target = {k: {b: max(memory_s, per_token_s * b * (1 + k)) for b in BATCHES} for k in range(MAX_K + 1)}
    draft = {b: draft_s + draft_per_seq_s * b for b in BATCHES}
    return cls(target, draft, max_batch=32)


def seqs_of(n, use_speculation=True):
    return [SimpleNamespace(request_id=str(i), params=SamplingParams(use_speculation=use_speculation))
            for i in range(n)]


def brute_force_best(costs: CostModel, batch: int, a: float) -> int:
    def throughput(k):
        per_seq = (1 - a ** (k + 1)) / (1 - a)
        return batch * per_seq / costs.step_time(batch, k)
    return max(range(MAX_K + 1), key=throughput)


def test_curve_interpolates_and_extrapolates():
    curve = Curve({1: 1.0, 4: 4.0, 8: 6.0})
    assert curve(1) == 1.0 and curve(0.5) == 1.0
    assert curve(2) == pytest.approx(2.0)
    assert curve(6) == pytest.approx(5.0)
    assert curve(16) == pytest.approx(10.0)  # along the last segment
    assert Curve({2: 3.0})(4) == pytest.approx(6.0)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("a", [0.3, 0.6, 0.8, 0.95])
def test_best_k_matches_brute_force(batch, a):
    costs = synthetic_costs()
    controller = SpecController(costs, MAX_K)
    k, _ = controller.best_k(batch, [[a] * MAX_K] * batch)
    assert k == brute_force_best(costs, batch, a)


def test_speculates_when_memory_bound_and_not_when_compute_bound():
    controller = SpecController(synthetic_costs(), MAX_K, prior_acceptance=0.8)
    assert controller.choose(seqs_of(1)) >= 3
    assert controller.choose(seqs_of(32)) == 0
    # Between the two, the chosen draft length never grows with the batch.
    chosen = [controller.choose(seqs_of(b)) for b in BATCHES]
    assert chosen == sorted(chosen, reverse=True)


def draw_accepted(rng, k: int, per_level: list[float], rows: int) -> list[int]:
    """Draft tokens accepted in each row when k levels are drafted and level j is accepted with per_level[j]."""
    accepted = []
    for _ in range(rows):
        n = 0
        while n < k and rng.random() < per_level[n]:
            n += 1
        accepted.append(n)
    return accepted


def feed(controller, seqs, k, accept_prob, steps, rng, draft_s=0.001):
    """accept_prob: one rate for every level, or a list of per-level rates; draft_s: reported seconds per level."""
    per_level = accept_prob if isinstance(accept_prob, list) else [accept_prob] * k
    for _ in range(steps):
        accepted = draw_accepted(rng, k, per_level, len(seqs))
        report = StepReport(width=1 + k, draft_time=draft_s * k, verify_time=0.01, draft_lens=[k] * len(seqs),
                            accepted_lens=accepted)
        controller.observe(seqs, k, report, wall_time=0.0101 + draft_s * k)


@pytest.mark.parametrize("a", [0.2, 0.5, 0.9])
def test_acceptance_estimate_follows_truncated_geometric_draws(a):
    controller = SpecController(synthetic_costs(), MAX_K, decay=0.99)
    seqs = seqs_of(4)
    feed(controller, seqs, k=4, accept_prob=a, steps=300, rng=random.Random(0))
    for seq in seqs:
        assert controller.acceptance(seq.request_id) == pytest.approx(a, abs=0.1)
    assert controller.global_acceptance == pytest.approx(a, abs=0.08)


def test_per_level_rates_are_learned_and_shape_the_choice():
    controller = SpecController(synthetic_costs(), MAX_K, decay=0.99)
    seqs = seqs_of(2)
    truth = [0.95, 0.5, 0.5, 0.5, 0.5]  # a good first guess, then a coin flip
    feed(controller, seqs, k=5, accept_prob=truth, steps=400, rng=random.Random(2))
    for got, want in zip(controller.rates(seqs[0].request_id), truth):
        assert got == pytest.approx(want, abs=0.08)
    costs = controller.costs

    def throughput(k, rates):
        reach, tokens = 1.0, 1.0
        for a in rates[:k]:
            reach *= a
            tokens += reach
        return tokens / costs.step_time(1, k)

    best = max(throughput(k, truth) for k in range(MAX_K + 1))
    assert throughput(controller.choose(seqs[:1]), truth) >= 0.97 * best


def test_a_bad_patch_is_forgotten_after_plain_steps():
    controller = SpecController(synthetic_costs(draft_s=0.005), MAX_K)  # a draft half as costly as the target
    good, bad = seqs_of(2)
    feed(controller, [good], k=5, accept_prob=0.95, steps=30, rng=random.Random(3), draft_s=0.005)
    assert controller.choose([good]) > 0
    feed(controller, [bad], k=5, accept_prob=0.0, steps=10, rng=random.Random(4), draft_s=0.005)
    assert controller.choose([bad]) == 0
    for _ in range(40):
        controller.observe([bad], 0, StepReport(1, 0.0, 0.01, [0], [0]), wall_time=0.0101)
    assert controller.choose([bad]) > 0  # back at the engine-wide rates, which are good


def test_calibration_smoothing_is_linear_in_k_and_monotone():
    from specdecode.speculation.calibrate import _smooth

    noisy = {0: {1: 1.0, 2: 1.1, 4: 2.5}, 1: {1: 1.6, 2: 1.5, 4: 3.0}, 2: {1: 1.4, 2: 2.0, 4: 3.4},
             3: {1: 2.0, 2: 1.9, 4: 3.6}}
    out = _smooth(noisy)
    for b in (1, 2, 4):
        steps = [out[k + 1][b] - out[k][b] for k in (1, 2)]
        assert steps[0] == pytest.approx(steps[1]) and steps[0] >= 0
        assert out[1][b] >= out[0][b]
    for k in out:
        assert out[k][1] <= out[k][2] <= out[k][4]


def test_low_acceptance_turns_speculation_off_then_probes():
    controller = SpecController(synthetic_costs(), MAX_K, probe_every=8)
    seqs = seqs_of(1)
    assert controller.choose(seqs) > 0
    feed(controller, seqs, k=3, accept_prob=0.02, steps=60, rng=random.Random(1))
    choices = []
    for _ in range(20):
        k = controller.choose(seqs)
        choices.append(k)
        report = StepReport(1 + k, 0.001 * k, 0.01, [k], [0])
        controller.observe(seqs, k, report, wall_time=0.0101 + 0.001 * k)
    assert choices.count(0) >= 15
    assert 1 in choices  # a probe re-measures the acceptance rate now and then


def test_a_delegated_proposer_is_asked_every_step_until_it_stops_drafting():
    """auto trims its own trees: it gets the whole budget each step, and after probe_every steps in which it drafted
    nothing, once every probe_every steps; a step it drafts in brings every step back."""
    controller = SpecController(synthetic_costs(), MAX_K, probe_every=4)
    controller.delegated = True
    seqs = seqs_of(2)

    def step(drafted: int) -> int:
        k = controller.choose(seqs)
        report = StepReport(1 + drafted, 0.0, 0.01, [drafted, 0], [0, 0])
        controller.observe(seqs, k, report, wall_time=0.011)
        return k

    assert [step(0) for _ in range(12)] == [MAX_K] * 4 + [MAX_K, 0, 0, 0] * 2
    assert step(1) == MAX_K and step(0) == MAX_K  # it drafted: asked every step again
    assert controller.choose(seqs_of(2, use_speculation=False)) == 0


def test_failed_probes_back_off():
    """Once speculation is off, a speculator whose drafts are never accepted is probed after 8, 16, 32, ... plain
    steps, not every 8; a drafting step faster than plain ones brings the interval back to 8, one accepted draft
    that does not pay for its wider pass does not."""
    controller = SpecController(synthetic_costs(), MAX_K, probe_every=8)
    seqs = seqs_of(1)
    feed(controller, seqs, k=3, accept_prob=0.0, steps=60, rng=random.Random(1))
    drafted = []
    for step in range(400):
        k = controller.choose(seqs)
        if k:
            drafted.append(step)
        controller.observe(seqs, k, StepReport(1 + k, 0.001 * k, 0.01, [k], [0]), wall_time=0.0101 + 0.001 * k)
    gaps = [b - a for a, b in zip(drafted, drafted[1:])]
    assert 3 <= len(drafted) <= 7, drafted  # without backing off: a probe every 9 steps, 44 of them
    assert gaps == sorted(gaps) and gaps[-1] >= 4 * gaps[0]

    interval = controller.probe_interval
    controller.probing = True
    controller.observe(seqs, 1, StepReport(2, 0.001, 0.01, [1], [1]), wall_time=0.025)  # 2 tokens in 2.5 plain steps
    assert controller.probe_interval == 2 * interval
    controller.observe(seqs, 1, StepReport(2, 0.001, 0.01, [1], [1]), wall_time=0.0111)
    assert controller.probe_interval == 8


def test_requests_without_speculation_count_as_plain_rows():
    controller = SpecController(synthetic_costs(), MAX_K)
    assert controller.choose(seqs_of(2, use_speculation=False)) == 0
    mixed = seqs_of(1) + seqs_of(3, use_speculation=False)
    # Only one of four rows gains from drafting, but all four pay for the wider pass: K must be smaller.
    assert controller.choose(mixed) <= controller.choose(seqs_of(4))


def test_costs_rescale_to_measurements_and_learn_overhead():
    costs = synthetic_costs()
    before = costs.step_time(4, 2)
    for _ in range(100):
        costs.observe(4, verified_k=2, draft_k=2, draft_time=2 * 2 * costs.draft(4),
                      verify_time=2 * costs.target[2](4), wall_time=2 * costs.target[2](4) + 4 * costs.draft(4) + 0.003)
    assert costs.target_scale == pytest.approx(2.0, rel=1e-3)
    assert costs.draft_scale == pytest.approx(2.0, rel=1e-3)
    assert costs.overhead_time(4, True) == pytest.approx(0.003, rel=1e-3)
    assert costs.overhead_time(4, False) == pytest.approx(0.003, rel=1e-3)  # borrowed from speculative steps
    assert costs.overhead_time(8, True) == pytest.approx(0.006, rel=1e-3)  # nearest batch, scaled
    assert costs.step_time(4, 2) == pytest.approx(2 * before + 0.003, rel=1e-3)
    costs.reset()
    assert costs.step_time(4, 2) == pytest.approx(before)


def test_fixed_k_overrides_the_choice():
    controller = SpecController(synthetic_costs(), MAX_K)
    controller.fixed_k = 2
    assert controller.choose(seqs_of(32)) == 2


def test_measure_costs_on_a_real_model(tiny_models):
    from specdecode.model.loading import load_model

    target = load_model(tiny_models["target"], dtype="float32", device="cpu")
    costs = measure_costs(target, target, max_batch=3, max_k=2, context=16, repeats=1)
    for k in range(3):
        assert costs.target[k].xs == [1, 2, 3]
        assert all(0 < t < 5 for t in costs.target[k].ys)
    assert costs.draft.xs == [1, 2, 3] and all(t > 0 for t in costs.draft.ys)


def test_kept_times_are_read_back_instead_of_timed(tiny_models, tmp_path, monkeypatch):
    """A calibration kept under a name is what the next start uses, without timing a pass; another name (other
    models, kernels, threads or shapes) is timed and kept beside it."""
    from specdecode.model.loading import load_model
    from specdecode.speculation import calibrate

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    target = load_model(tiny_models["target"], dtype="float32", device="cpu")
    first = measure_costs(target, target, max_batch=3, max_k=2, context=16, repeats=1, stored_as="pair-a")

    def refuse(*args):
        raise AssertionError("timed again")

    timing = calibrate._timed_pass
    monkeypatch.setattr(calibrate, "_timed_pass", refuse)
    again = measure_costs(target, target, max_batch=3, max_k=2, context=16, repeats=1, stored_as="pair-a")
    assert [c.ys for c in again.target] == [c.ys for c in first.target] and again.draft.ys == first.draft.ys
    with pytest.raises(AssertionError, match="timed again"):
        measure_costs(target, target, max_batch=3, max_k=2, context=16, repeats=1, stored_as="pair-b")
    monkeypatch.setattr(calibrate, "_timed_pass", timing)
    (tmp_path / "calibration" / "pair-a.json").write_text("{not json")  # damaged: timed again, kept anew
    measure_costs(target, target, max_batch=3, max_k=2, context=16, repeats=1, stored_as="pair-a")
    monkeypatch.setattr(calibrate, "_timed_pass", refuse)
    measure_costs(target, target, max_batch=3, max_k=2, context=16, repeats=1, stored_as="pair-a")
    assert calibrate.calibration_name("a", 1) != calibrate.calibration_name("a", 2)


class CountingModel:
    """A stand-in target for start-up timing: counts its passes and their shapes; each costs rows x width."""

    device = torch.device("cpu")

    def __init__(self):
        self.shapes = []

    def make_cache(self, slots, max_len):
        return SimpleNamespace(lengths=torch.zeros(slots, dtype=torch.long), slots=slots, max_len=max_len)

    def __call__(self, ids, cache, slots, **_):
        assert ids.shape[0] <= cache.slots and ids.shape[1] < cache.max_len
        self.shapes.append(tuple(ids.shape))
        return SimpleNamespace(logits=torch.zeros(*ids.shape, 2))


def test_start_up_timing_is_bounded_whatever_the_sizes(monkeypatch):
    """The largest K and batch the flags allow: a subset of draft lengths, no pass over MAX_CALIBRATED_TOKENS, and
    once the time budget is spent nothing new is started (counted in passes, not seconds)."""
    from specdecode.speculation import calibrate as control

    clock = [0.0]
    monkeypatch.setattr(control.time, "perf_counter", lambda: clock[0])
    model = CountingModel()
    original = control._timed_pass

    def timed(m, cache, batch, width, context):  # a fake clock: each pass takes rows x width microseconds
        original(m, cache, batch, width, context)
        clock[0] += batch * width * 1e-6
        return batch * width * 1e-6

    monkeypatch.setattr(control, "_timed_pass", timed)
    costs = measure_costs(model, None, max_batch=4096, max_k=64, nodes_per_level=4, repeats=3, budget_seconds=1e9)
    assert len(model.shapes) < 400 and max(b * w for b, w in model.shapes) <= control.MAX_CALIBRATED_TOKENS
    assert len(costs.target) == 65
    for b in (1, 7, 64, 4096):  # every draft length and batch has a cost, rising with both
        row = [costs.target_time(b, k) for k in range(65)]
        assert all(x <= y for x, y in zip(row, row[1:])) and row[0] > 0
    assert costs.target_time(4096, 64) > costs.target_time(64, 64) > costs.target_time(1, 64)
    model.shapes.clear()
    measure_costs(model, None, max_batch=4096, max_k=64, nodes_per_level=4, repeats=3, budget_seconds=0.0)
    assert model.shapes == [(1, 1)] * 2  # out of time at once: one warm-up and one timed pass of the cheapest


class FrozenCosts(CostModel):
    """Costs the test decides: measurements do not rescale them (so the choice of K is deterministic)."""

    def observe(self, *args, **kwargs) -> None:
        pass


def test_adaptive_llm_is_lossless_and_respects_disable_by_batch_size(tiny_models):
    from specdecode.engine.llm import LLM

    prompts = ["def add(a, b):", "class Point:", "for i in range(10):"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(tiny_models["target"], dtype="float32", max_num_seqs=4).generate(prompts, params)
    config = {"model": str(tiny_models["draft"]), "num_speculative_tokens": 3, "adaptive": True}
    adaptive = LLM(tiny_models["target"], dtype="float32", speculative_config=config, max_num_seqs=4)
    assert adaptive.controller is not None
    # The tiny draft costs as much as its target, so measured costs would (rightly) say never to draft; with costs
    # where drafting pays, the adaptive path must draft, and stay exact.
    adaptive.controller.costs = synthetic_costs(cls=FrozenCosts)
    outputs = adaptive.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    stats = adaptive.total_stats
    assert stats.draft_tokens > 0 and stats.accepted_tokens > 0, "the adaptive engine must have speculated"

    disabled = LLM(tiny_models["target"], dtype="float32",
                   speculative_config={**config, "disable_by_batch_size": 3}, max_num_seqs=4)
    disabled.controller.costs = synthetic_costs(cls=FrozenCosts)
    outputs = disabled.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert disabled.total_stats.draft_tokens == 0


def simulated_throughput(costs: CostModel, batch: int, rates: list[float], k: int | None, steps: int = 2000,
                         seed: int = 0) -> float:
    """Tokens per modelled second of `steps` steps over `batch` sequences whose drafts are accepted level by level
    with probabilities `rates`; k None = the adaptive controller chooses each step, else always k."""
    controller = SpecController(costs, MAX_K)
    controller.fixed_k = k
    seqs = seqs_of(batch)
    rng = random.Random(seed)
    tokens = seconds = 0.0
    for _ in range(steps):
        chosen = controller.choose(seqs)
        accepted = draw_accepted(rng, chosen, rates, batch)
        step_time = costs.step_time(batch, chosen)
        report = StepReport(width=1 + chosen, draft_time=costs.draft_time(batch, chosen),
                            verify_time=costs.target_time(batch, chosen), draft_lens=[chosen] * batch,
                            accepted_lens=accepted)
        controller.observe(seqs, chosen, report, wall_time=step_time)
        tokens += batch + sum(accepted)
        seconds += step_time
    return tokens / seconds


@pytest.mark.parametrize("batch, rates, draft_s", [
    (1, [0.0] * MAX_K, 0.001),  # a useless draft
    (1, [0.3] * MAX_K, 0.001),
    (1, [0.8] * MAX_K, 0.001),
    (1, [0.95, 0.2, 0.2, 0.2, 0.2], 0.001),  # good at depth 1 only
    (1, [0.9] * MAX_K, 0.008),  # a draft almost as costly as the target
    (4, [0.6] * MAX_K, 0.001),
    (32, [0.9] * MAX_K, 0.001),  # compute bound: speculation cannot pay
])
def test_adaptive_never_loses_to_plain_decoding(batch, rates, draft_s):
    """On a deterministic cost model (no wall clock): the adaptive controller's throughput is at least plain
    decoding's, less 2% for its optimistic start and the one-level probes it makes while speculation is off, and
    within 10% of the best fixed K."""
    costs = synthetic_costs(draft_s=draft_s)
    adaptive = simulated_throughput(costs, batch, rates, None)
    plain = simulated_throughput(costs, batch, rates, 0)
    best_fixed = max(simulated_throughput(costs, batch, rates, k) for k in range(1, MAX_K + 1))
    assert adaptive >= 0.98 * plain
    assert adaptive >= 0.9 * max(best_fixed, plain)


@pytest.mark.parametrize("draft_wall, stops", [(0.040, True), (0.015, False)])
def test_drafting_steps_slower_than_plain_steps_stop(draft_wall, stops):
    """The model says drafting pays (2 of 3 tokens accepted), but the stopwatch decides: 3 tokens in 40 ms lose to
    a plain step's one token in 10 ms, so the request stops drafting (probing now and then); in 15 ms they win."""
    controller = SpecController(synthetic_costs(), MAX_K, probe_every=8)
    seqs = seqs_of(1)

    def step(k, wall):
        report = StepReport(1 + k, 0.001 * k, 0.01, [k], [min(k, 2)], draft_depths=[k])
        controller.observe(seqs, k, report, wall_time=wall)

    step(0, 0.010)
    for _ in range(10):
        step(3, draft_wall)
    choices = []
    for _ in range(20):
        k = controller.choose(seqs)
        choices.append(k)
        step(k, 0.010 if k == 0 else draft_wall)
    if stops:
        assert choices.count(0) >= 15 and 1 in choices
    else:
        assert 0 not in choices


ACCURACY = [[0.35, 0.11, 0.06, 0.06, 0.04, 0.03], [0.31, 0.1, 0.06]]
"""Per depth, P(the rank-r guess is right): SmolLM2's shipped EAGLE head's card, roughly."""


def test_tree_width_follows_what_a_wide_pass_costs():
    levels = {1: 0.001, 2: 0.0012, 4: 0.0015}
    flat = {w: 0.010 for w in range(1, 22)}  # a GPU: verifying 21 tokens costs what one does
    assert best_tree_width(flat, levels, ACCURACY, 5, [1, 2, 4])[0] == 4
    # This CPU: width 2 costs 1.05 plain steps, width 5 1.8, then ~0.45 a token.
    cpu = {1: 0.020, 2: 0.021, 3: 0.026, 4: 0.031, 5: 0.036}
    cpu.update({w: 0.036 + 0.009 * (w - 5) for w in range(6, 22)})
    nodes, speedup = best_tree_width(cpu, levels, ACCURACY, 5, [1, 2, 4])
    assert nodes == 1 and speedup > 1.0
    # The expected speedup is the shape's expected tokens over its time: a 1-node level of acceptance 0.35.
    assert speedup == pytest.approx(max(1.35 * 0.020 / (0.021 + 0.001),
                                        (1.35 + 0.35 * 0.31) * 0.020 / (0.026 + 0.002)))
    # A head that is never right: no shape pays (the controller then does not draft); the one that loses least is
    # the cheapest, a one-token chain, which is also the cheapest probe.
    assert best_tree_width(cpu, levels, [[0.0] * 6], 5, [1, 2, 4]) == (1, pytest.approx(0.020 / 0.022))


def gate_step(controller, seqs, k, wall, accepted=None):
    """One step at batch len(seqs) that drafted k levels in every row and took `wall` seconds."""
    accepted = [k if accepted is None else min(k, accepted)] * len(seqs)
    report = StepReport(1 + k, 0.001 * k, wall, [k] * len(seqs), accepted, draft_depths=[k] * len(seqs))
    controller.observe(seqs, k, report, wall_time=wall)


def test_cost_gate_halves_a_losing_cap_down_to_none_then_probes_with_back_off():
    """Drafting that yields 2 tokens in 3 plain steps' time: the request's cap goes 5 -> 2 -> 1 -> 0 as each
    verdict finds it slower than plain; then it decodes plainly and is probed at one level after probe_every plain
    steps, then after 2x, 4x as many while probes keep losing."""
    controller = SpecController(synthetic_costs(), MAX_K, probe_every=4)
    seqs = seqs_of(1)
    gate_step(controller, seqs, 0, 0.010)
    caps, probes, plain_run = [], [], 0
    for _ in range(120):
        cap = controller.caps(seqs)[0]
        caps.append(cap)
        k = min(controller.choose(seqs), cap)
        if k:
            if plain_run:
                probes.append(plain_run)
            plain_run = 0
        else:
            plain_run += 1
        gate_step(controller, seqs, k, 0.030 if k else 0.010, accepted=1)
    assert caps[0] == MAX_K
    assert sorted(set(caps[:20]), reverse=True) == [MAX_K, 2, 1, 0]
    assert probes[:3] == [4, 8, 16], probes  # plain steps before each probe window
    assert caps[-1] in (0, 1)


def test_cost_gate_settles_where_drafting_pays():
    """Each level costs 0.6 plain steps and only the first is ever accepted: one level pays (2 tokens in 1.6
    steps), two or more do not. The gate keeps the cap low, and the request beats plain decoding."""
    controller = SpecController(synthetic_costs(), MAX_K, probe_every=4)
    seqs = seqs_of(1)
    gate_step(controller, seqs, 0, 0.010)
    tokens = seconds = 0.0
    caps = []
    for _ in range(300):
        k = min(controller.choose(seqs), controller.caps(seqs)[0])
        caps.append(k)
        wall = 0.010 * (1 + 0.6 * k)
        gate_step(controller, seqs, k, wall, accepted=1)
        tokens += 1 + min(k, 1)
        seconds += wall
    assert tokens / seconds > 1.1 / 0.010
    assert caps[-100:].count(1) > 50 and max(caps[-100:]) <= 2


def test_cost_gate_uses_the_requests_own_plain_steps_and_new_requests_start_from_the_last_verdict():
    """A request with a long context has slow plain steps (20 ms against the engine's 10 ms): drafting at 15 ms a
    step for 1.5 tokens beats its own plain rate, so it keeps drafting, although it would lose to the engine's.
    A request that the gate held back hands its cap to the next request."""
    controller = SpecController(synthetic_costs(), MAX_K, probe_every=4)
    short, long_ = seqs_of(1), [SimpleNamespace(request_id="long", params=SamplingParams())]
    gate_step(controller, short, 0, 0.010)
    gate_step(controller, long_, 0, 0.020)
    for _ in range(30):
        gate_step(controller, long_, 2, 0.015 * 2, accepted=2)  # 3 tokens in 30 ms: 1.5 plain steps of 20 ms
    assert controller.caps(long_) == [2] or controller.caps(long_) == [MAX_K]
    for _ in range(12):
        gate_step(controller, short, 2, 0.040, accepted=1)  # 2 tokens in 4 plain steps of 10 ms: losing
    assert controller.caps(short) == [0]
    fresh = [SimpleNamespace(request_id="fresh", params=SamplingParams())]
    assert controller.caps(fresh) == [0] and controller.choose(fresh) == 0


def test_cost_gate_caps_each_row_of_a_batch():
    """In a batch the losing row is held back (DraftBudget caps it) while the others draft."""
    from specdecode.engine.budget import DraftBudget
    from specdecode.speculation.config import SpeculativeConfig
    controller = SpecController(synthetic_costs(), MAX_K, probe_every=4)
    seqs = seqs_of(2)
    for s in seqs:
        s.num_generated, s.token_ids = 0, [1, 2, 3]
        s.params = SamplingParams(max_tokens=100)
    gate_step(controller, seqs, 0, 0.010)
    for _ in range(30):  # row 0 accepts everything, row 1 nothing, in steps of 20 ms: row 1 loses
        report = StepReport(1 + 3, 0.003, 0.02, [3, 3], [3, 0], draft_depths=[3, 3])
        controller.observe(seqs, 3, report, wall_time=0.020)
    caps = controller.caps(seqs)
    assert caps[0] >= 3 and caps[1] == 0
    budget = DraftBudget(SpeculativeConfig(method="ngram", num_speculative_tokens=MAX_K), 1000, controller)
    budgets = budget.for_step(seqs)
    assert budgets[1] == 0 and budgets[0] > 0


def test_cost_gate_times_each_requests_plain_rate_itself():
    """A request's first decode step is plain, and so is one in every PLAIN_REFRESH drafting steps: the rate drafting
    must beat is measured on the request, not taken from the cost model (whose overhead may hold the proposer's own
    work); drafting steps that lose to that measured rate are cut."""
    from specdecode.speculation.control import PLAIN_REFRESH
    controller = SpecController(synthetic_costs(), MAX_K, probe_every=4)
    seqs = seqs_of(1)
    assert controller.caps(seqs) == [0]  # first: a plain step (DraftBudget gives the row no drafts)
    gate_step(controller, seqs, 0, 0.010)
    ks = []
    for _ in range(2 * PLAIN_REFRESH + 2):
        k = min(controller.choose(seqs), controller.caps(seqs)[0])
        ks.append(k)
        gate_step(controller, seqs, k, 0.008 if k else 0.010, accepted=k)  # drafting pays
    assert ks[:PLAIN_REFRESH] == [ks[0]] * PLAIN_REFRESH and ks[0] > 0
    assert ks[PLAIN_REFRESH] == 0 and ks.count(0) == 2


def test_cost_gate_carries_its_back_off_to_new_requests():
    """A method that loses on every request: each new request starts held at 0 with the back-off the last verdict
    left, so across short requests the probes grow rarer instead of costing every request one probe window."""
    controller = SpecController(synthetic_costs(), MAX_K, probe_every=4)
    drafted_steps = []
    for n in range(8):
        seqs = [SimpleNamespace(request_id=f"r{n}", params=SamplingParams())]
        drafted = 0
        for _ in range(40):  # a short request
            k = min(controller.choose(seqs), controller.caps(seqs)[0])
            drafted += k > 0
            gate_step(controller, seqs, k, 0.030 if k else 0.010, accepted=0)  # drafting never pays
        controller.forget(seqs[0].request_id)
        drafted_steps.append(drafted)
    assert drafted_steps[0] > 0
    assert sum(drafted_steps[4:]) <= drafted_steps[0] // 2, drafted_steps  # later requests hardly probe


def test_a_losing_verdict_cuts_the_cap_below_the_deepest_draft_it_judged():
    """The controller drafts one level (Lookahead's usual choice) under a gate cap of MAX_K, and those steps lose to
    plain ones: the first verdict turns drafting off (cap 0), instead of halving a cap that was never reached
    (MAX_K -> 2 -> 1 -> 0, each verdict another ~7 losing steps)."""
    controller = SpecController(synthetic_costs(), MAX_K, probe_every=64)
    seqs = seqs_of(1)
    gate_step(controller, seqs, 0, 0.010)
    assert controller.caps(seqs) == [MAX_K]
    steps = 0
    while controller.caps(seqs)[0] and steps < 50:
        gate_step(controller, seqs, 1, 0.016, accepted=0 if steps % 5 else 1)  # ~1.2 tokens per 1.6 plain steps
        steps += 1
    assert controller.caps(seqs) == [0] and steps <= 8, steps

    # A delegated proposer (auto) keeps its patience: the same losing steps halve its cap, MAX_K -> 2, still drafting.
    controller = SpecController(synthetic_costs(), MAX_K, probe_every=64)
    controller.delegated = True
    gate_step(controller, seqs, 0, 0.010)
    for step in range(8):
        gate_step(controller, seqs, 1, 0.016, accepted=0 if step % 5 else 1)
    assert controller.gate.cap(seqs[0].request_id) == MAX_K // 2 and controller.caps(seqs) == [MAX_K]
