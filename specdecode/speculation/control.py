"""How many tokens to draft each step: costs measured on this machine plus each request's acceptance rate.

With a per-level acceptance rate a, drafting K levels yields E = (1 - a^(K+1)) / (1 - a) tokens per step. A step
over B sequences costs target(B, K) + K * draft(B) + overhead(B); the controller picks the K in {0..K_max} with
the most expected tokens per second, K = 0 being plain decoding. At a large batch the target pass is compute
bound, verifying K more tokens per row costs about K times more, and the best K becomes 0 by itself.
"""
from __future__ import annotations

import bisect
import time

import torch

SCALE_RATE = 0.1
"""Weight of a new measurement in the running measured/calibrated cost ratios and overheads."""
REALISED_FADE = 0.98
"""Per plain step, how much of a request's evidence about its drafting steps' speed is kept."""
MAX_PROBE_INTERVAL = 512
"""Most plain steps between two probes of a speculator whose drafts keep failing."""


class Curve:
    """Seconds as a function of batch size: linear between measured points, flat before the first point,
    extended along the last segment after the last one (proportionally when there is one point)."""

    def __init__(self, points: dict[int, float]):
        self.xs = sorted(points)
        self.ys = [float(points[x]) for x in self.xs]

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x <= xs[0]:
            return ys[0]
        if len(xs) == 1:
            return ys[0] * x / xs[0]
        i = min(bisect.bisect_left(xs, x), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class CostModel:
    """Step time as a function of batch size B and draft length K.

    The shapes come from a start-up measurement (or synthetic points in tests): target[k][B] = seconds of a target
    pass over B rows verifying k draft levels, draft[B] = seconds of one draft forward. Running ratios of measured
    to calibrated time rescale them to the machine's current speed, and the rest of a step (Python bookkeeping,
    commit, proposer updates) is measured per batch size, separately for plain and speculative steps.
    """

    def __init__(self, target: dict[int, dict[int, float]], draft: dict[int, float] | None, max_batch: int):
        self.max_k = max(target)
        self.target = [Curve(target[k]) for k in range(self.max_k + 1)]
        self.draft = Curve(draft) if draft else None
        self.max_batch = max_batch
        self.reset()

    def reset(self) -> None:
        """Forget online measurements (keep the calibrated shapes)."""
        self.target_scale = 1.0
        self.draft_scale = 1.0
        self.overhead: dict[bool, list[float | None]] = {False: [None] * (self.max_batch + 1),
                                                         True: [None] * (self.max_batch + 1)}

    def target_time(self, batch: int, k: int) -> float:
        return self.target_scale * self.target[min(k, self.max_k)](batch)

    def draft_time(self, batch: int, k: int) -> float:
        return self.draft_scale * k * self.draft(batch) if self.draft is not None and k else 0.0

    def overhead_time(self, batch: int, speculative: bool) -> float:
        """Measured rest-of-step time; falls back to the other kind of step, then to the nearest batch size."""
        batch = min(batch, self.max_batch)
        for table in (self.overhead[speculative], self.overhead[not speculative]):
            if table[batch] is not None:
                return table[batch]
        for table in (self.overhead[speculative], self.overhead[not speculative]):
            known = [b for b in range(1, self.max_batch + 1) if table[b] is not None]
            if known:
                nearest = min(known, key=lambda b: abs(b - batch))
                return table[nearest] * batch / nearest
        return 0.0

    def step_time(self, batch: int, k: int) -> float:
        return self.target_time(batch, k) + self.draft_time(batch, k) + self.overhead_time(batch, k > 0)

    def observe(self, batch: int, verified_k: int, draft_k: int, draft_time: float, verify_time: float,
                wall_time: float) -> None:
        """One step over `batch` rows: the target verified `verified_k` levels, the draft ran `draft_k` forwards."""
        expected = self.target[min(verified_k, self.max_k)](batch)
        if expected > 0:
            self.target_scale += SCALE_RATE * (verify_time / expected - self.target_scale)
        modelled_draft = 0.0
        if self.draft is not None and draft_k:
            expected = draft_k * self.draft(batch)
            if expected > 0:
                self.draft_scale += SCALE_RATE * (draft_time / expected - self.draft_scale)
            modelled_draft = draft_time
        rest = max(0.0, wall_time - verify_time - modelled_draft)
        table = self.overhead[draft_k > 0]
        b = min(batch, self.max_batch)
        table[b] = rest if table[b] is None else table[b] + SCALE_RATE * (rest - table[b])


class SpecController:
    """Chooses the draft length of each step and learns from what each step did.

    Acceptance is learned per draft level j: a_j = P(level j accepted | the levels before it were). A step that
    drafted k levels and accepted n of them was a trial at levels 1..min(n + 1, k), a success at levels 1..n. Then
    E(K) = 1 + sum over j <= K of a_1 ... a_j (with one rate for every level, (1 - a^(K+1)) / (1 - a)); a draft's
    quality usually fades with depth, which one pooled rate would miss. Counts decay so that the estimates follow
    the text; a request's own counts are backed by the engine-wide rates as a prior. Those start optimistic on
    purpose: acceptance is only measured while drafting, so a fresh engine drafts and learns rather than
    deciding from a guess that speculation does not pay.
    """

    def __init__(self, costs: CostModel, max_k: int, nodes_per_level: int = 1, prior_acceptance: float = 0.85,
                 prior_weight: float = 8.0, decay: float = 0.95, probe_every: int = 16,
                 widths: list[int] | None = None):
        """widths: target pass width per row for each draft length 0..max_k (default 1 + nodes_per_level * k)."""
        self.costs = costs
        self.max_k = max_k
        self.nodes_per_level = nodes_per_level
        self.widths = list(widths) if widths else [1 + nodes_per_level * k for k in range(max_k + 1)]
        self.prior_weight = prior_weight
        self.decay = decay
        self.probe_every = probe_every
        self.prior_acceptance = prior_acceptance
        self.fixed_k: int | None = None
        """Set to always draft this many levels (benchmarks of fixed K); costs are still measured."""
        self.min_evidence = 8.0
        """Tokens of a request's recent drafting steps needed before their realised speed can throttle it."""
        self.reset_acceptance()

    def reset_acceptance(self) -> None:
        # Engine-wide successes and trials per level, starting from 10 imagined trials at the prior rate.
        self.global_hits = [10.0 * self.prior_acceptance] * self.max_k
        self.global_trials = [10.0] * self.max_k
        self.counts: dict[str, tuple[list[float], list[float]]] = {}  # request -> (hits, trials) per level
        # What drafting really gave each request: faded (seconds, tokens) of its drafting steps, against the
        # measured wall time of plain steps per batch size. The model above can be wrong (a longer context than
        # calibrated, a proposer slower than it looked, acceptance that fell); the stopwatch is not.
        self.realised: dict[str, list[float]] = {}
        self.plain_wall: dict[int, float] = {}
        self.steps_since_draft = 0
        # Plain steps before the next probe: doubles after each probe that gave fewer tokens per second than a plain
        # step, so a speculator that never pays (T=1 on a weak draft, a batch too wide to verify cheaply) costs a probe
        # per ever longer stretch, not one per 16 steps; a drafting step that pays brings it back.
        self.probe_interval = self.probe_every
        self.probing = False

    def reset(self) -> None:
        """Forget everything learned online (the calibrated cost shapes stay)."""
        self.costs.reset()
        self.reset_acceptance()

    # -- estimates ------------------------------------------------------------------------------------------

    def global_rates(self) -> list[float]:
        return [h / t for h, t in zip(self.global_hits, self.global_trials)]

    def rates(self, request_id: str, prior: list[float] | None = None) -> list[float]:
        """a_1..a_K of one request (the engine-wide rates until it has drafted)."""
        prior = prior or self.global_rates()
        counts = self.counts.get(request_id)
        if counts is None:
            return prior
        w = self.prior_weight
        return [(h + w * g) / (t + w) for h, t, g in zip(*counts, prior)]

    @property
    def global_acceptance(self) -> float:
        """Engine-wide share of level trials accepted."""
        return sum(self.global_hits) / sum(self.global_trials)

    def acceptance(self, request_id: str) -> float:
        """One request's share of level trials accepted (prior included)."""
        counts = self.counts.get(request_id)
        if counts is None:
            return self.global_acceptance
        w = self.prior_weight
        return (sum(counts[0]) + w * self.global_acceptance) / (sum(counts[1]) + w)

    def best_k(self, batch: int, rates: list[list[float]]) -> tuple[int, float]:
        """(K, expected tokens/s) maximising throughput for `batch` rows; rates[r] = a_1..a_K of each row that
        speculates."""
        tokens = float(batch)  # K = 0: one token per row
        best_k, best = 0, tokens / self.costs.step_time(batch, 0)
        reach = [1.0] * len(rates)  # probability that each row's draft is accepted up to the current level
        for k in range(1, self.max_k + 1):
            reach = [p * a[k - 1] for p, a in zip(reach, rates)]
            tokens += sum(reach)  # E(K) = E(K - 1) + a_1 ... a_K
            throughput = tokens / self.costs.step_time(batch, k)
            if throughput > best:
                best_k, best = k, throughput
        return best_k, best

    # -- per step -------------------------------------------------------------------------------------------

    def losing(self, request_id: str, batch: int) -> bool:
        """Whether a request's recent drafting steps gave fewer tokens per second than plain steps take (then it
        stops drafting until that evidence has faded, and tries again)."""
        seconds, tokens = self.realised.get(request_id, (0.0, 0.0))
        if tokens < self.min_evidence:
            return False
        plain = self.plain_wall.get(batch) or self.costs.step_time(batch, 0)
        return tokens * plain < seconds

    def choose(self, seqs) -> int:
        """Draft levels for this step (0 = plain); sequences with speculation off, or whose drafts lately did not
        pay, are counted as plain rows."""
        if self.fixed_k is not None:
            return self.fixed_k
        prior = self.global_rates()
        speculating = [s for s in seqs if s.params.use_speculation]
        if not speculating:
            return 0
        rates = [self.rates(s.request_id, prior) for s in speculating if not self.losing(s.request_id, len(seqs))]
        k = self.best_k(len(seqs), rates)[0] if rates else 0
        if k == 0 and self.steps_since_draft >= self.probe_interval:
            # Acceptance is only learned while drafting: now and then re-measure it with one cheap level, but only
            # where a good acceptance rate would make speculation pay at this batch size.
            if self.best_k(len(seqs), [[0.9] * self.max_k] * len(speculating))[0] > 0:
                k = 1
                self.probing = True
        return k

    def observe(self, seqs, k: int, report, wall_time: float) -> None:
        """Learn from a finished step that drafted up to k levels: `report` is the StepRunner's StepReport,
        wall_time the whole step."""
        npl = self.nodes_per_level
        verified_k = min(bisect.bisect_left(self.widths, report.width), self.max_k)  # the pass's cost class
        self.costs.observe(len(seqs), verified_k, k, report.draft_time, report.verify_time, wall_time)
        drafting = any(report.draft_lens)
        self.steps_since_draft = 0 if drafting else self.steps_since_draft + 1
        if drafting:
            b = len(seqs)
            plain = self.plain_wall.get(b) or self.costs.step_time(b, 0)
            if (b + sum(report.accepted_lens)) * plain >= b * wall_time:  # tokens per second at least plain's
                self.probe_interval = self.probe_every
            elif self.probing:
                self.probe_interval = min(2 * self.probe_interval, MAX_PROBE_INTERVAL)
        self.probing = False
        if report.width == 1:  # a plain step: what drafting has to beat
            b, plain = len(seqs), self.plain_wall.get(len(seqs))
            self.plain_wall[b] = wall_time if plain is None else plain + SCALE_RATE * (wall_time - plain)
        for seq, accepted in zip(seqs, report.accepted_lens):
            realised = self.realised.setdefault(seq.request_id, [0.0, 0.0])
            if report.width > 1:  # every row paid for the wider pass
                realised[0] = realised[0] * self.decay + wall_time
                realised[1] = realised[1] * self.decay + 1 + accepted
            else:  # slower, so that a throttled request waits a while before it tries again
                realised[0] *= REALISED_FADE
                realised[1] *= REALISED_FADE
        if drafting:
            self.global_hits = [h * 0.99 for h in self.global_hits]
            self.global_trials = [t * 0.99 for t in self.global_trials]
        decay = self.decay
        # Levels drafted per row: the trees' depths (a tree's node count need not be a multiple of its levels).
        depths = report.draft_depths or [d // npl for d in report.draft_lens]
        for seq, drafted, depth, accepted in zip(seqs, report.draft_lens, depths, report.accepted_lens):
            counts = self.counts.get(seq.request_id)
            if counts is None:
                if not drafted:
                    continue
                counts = self.counts[seq.request_id] = ([0.0] * self.max_k, [0.0] * self.max_k)
            hits, trials = counts
            # Evidence fades with every step, drafted or not: the text moves on, and a request that stopped
            # drafting after a bad patch drifts back to the engine-wide rates and tries again.
            for j in range(self.max_k):
                hits[j] *= decay
                trials[j] *= decay
            if drafted:
                levels = min(accepted + 1, depth, self.max_k)
                for j in range(levels):
                    success = j < accepted
                    hits[j] += success
                    trials[j] += 1.0
                    self.global_hits[j] += success
                    self.global_trials[j] += 1.0

    def forget(self, request_id: str) -> None:
        self.counts.pop(request_id, None)
        self.realised.pop(request_id, None)


@torch.no_grad()
def _timed_pass(model, cache, batch: int, width: int, context: int) -> float:
    """Seconds of one cached forward over [batch, width] new tokens after `context` tokens (nothing committed)."""
    device = model.device
    cache.lengths[:batch] = context
    ids = torch.zeros(batch, width, dtype=torch.long, device=device)
    kwargs = {}
    if width > 1:  # a chain, as the step runner verifies it
        kwargs["positions"] = (context + torch.arange(width, device=device)).expand(batch, width)
        mask = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        kwargs["tree_mask"] = mask.expand(batch, width, width)
    start = time.perf_counter()
    out = model(ids, cache=cache, slots=torch.arange(batch), **kwargs)
    out.logits.argmax(-1).tolist()  # waits for the device, as the verifier does
    return time.perf_counter() - start


CALIBRATION_SECONDS = 10.0
"""Start-up timing stops measuring new shapes after this long; the rest are estimated from what was measured."""
MAX_CALIBRATED_TOKENS = 2048
"""Largest pass timed at start-up (rows x width); larger ones are extrapolated (their cost is about linear)."""


def _best_times(model, cache, shapes: list[tuple[int, int]], context: int, repeats: int,
                deadline: float = float("inf")) -> dict:
    """Best-of-`repeats` seconds per (batch, width), for the shapes measured before `deadline` (perf_counter).
    Rounds go over every shape in turn, so that a burst of load from elsewhere on the machine spoils one sample
    of many shapes rather than every sample of one. Shapes come in the order given (cheapest first): when time
    runs out, the costly ones are left to _estimate."""
    warmed = []
    for shape in shapes:  # a warm-up pass each, cheapest first, while there is time (the first always)
        if warmed and time.perf_counter() > deadline:
            break
        _timed_pass(model, cache, *shape, context)
        warmed.append(shape)
    best: dict[tuple[int, int], float] = {}
    for round_ in range(repeats):
        if round_ and time.perf_counter() > deadline:
            break  # every warmed shape has one sample
        for shape in warmed:
            best[shape] = min(best.get(shape, float("inf")), _timed_pass(model, cache, *shape, context))
    return best


def _estimate(times: dict[tuple[int, int], float], batch: int, width: int) -> float:
    """Seconds of a [batch, width] pass: measured, else interpolated between measured widths at this batch size,
    else scaled in proportion to tokens from the largest measured pass that is no larger in either dimension."""
    if (batch, width) in times:
        return times[batch, width]
    row = sorted(w for b, w in times if b == batch)
    lower = [w for w in row if w < width]
    upper = [w for w in row if w > width]
    if lower and upper:
        w0, w1 = lower[-1], upper[0]
        return times[batch, w0] + (times[batch, w1] - times[batch, w0]) * (width - w0) / (w1 - w0)
    below = [(b, w) for b, w in times if b <= batch and w <= width]
    b, w = max(below, key=lambda shape: (shape[0] * shape[1], shape))
    return times[b, w] * (batch * width) / (b * w)


def _calibrated_levels(max_k: int) -> list[int]:
    """Draft lengths timed at start-up: 0-4 and powers of two up to max_k, and max_k (the rest interpolated)."""
    return sorted({k for k in range(min(max_k, 4) + 1)} | {2 ** i for i in range(max_k.bit_length())
                                                            if 2 ** i <= max_k} | {max_k})


def _smooth(target: dict[int, dict[int, float]]) -> dict[int, dict[int, float]]:
    """Take the noise out of calibrated target[k][batch] times: at each batch size, a pass verifying k >= 1 levels
    costs about a + b * k (k = 0 has no tree mask and its own, faster path), so fit that line by least squares;
    then no cost may fall as k or the batch grows."""
    ks = [k for k in target if k >= 1]
    batches = sorted(target[0])
    out = {k: dict(points) for k, points in target.items()}
    if len(ks) >= 2:
        k_mean = sum(ks) / len(ks)
        k_var = sum((k - k_mean) ** 2 for k in ks)
        for b in batches:
            t_mean = sum(target[k][b] for k in ks) / len(ks)
            slope = max(0.0, sum((k - k_mean) * (target[k][b] - t_mean) for k in ks) / k_var)
            for k in ks:
                out[k][b] = t_mean + slope * (k - k_mean)
    for k in sorted(out):
        for i, b in enumerate(batches):
            if i:
                out[k][b] = max(out[k][b], out[k][batches[i - 1]])
            if k:
                out[k][b] = max(out[k][b], out[k - 1][b])
    return out


def measure_costs(target, draft, max_batch: int, max_k: int, nodes_per_level: int = 1, context: int = 128,
                  repeats: int = 3, widths: list[int] | None = None,
                  budget_seconds: float = CALIBRATION_SECONDS) -> CostModel:
    """Time target passes over the batch sizes and draft lengths the engine can use, and draft forwards (if the
    proposer has a draft model), on this machine, at start-up. widths: pass width per row for each draft length
    0..max_k (default 1 + nodes_per_level * k). Bounded in time whatever the sizes: a subset of draft lengths is
    timed (the others interpolated), no pass of more than MAX_CALIBRATED_TOKENS, and nothing new is started after
    budget_seconds."""
    deadline = time.perf_counter() + budget_seconds
    batches = sorted({1, max_batch} | {2 ** i for i in range(max_batch.bit_length()) if 2 ** i < max_batch})
    widths = list(widths) if widths else [1 + nodes_per_level * k for k in range(max_k + 1)]
    shapes = sorted({(b, widths[k]) for b in batches for k in _calibrated_levels(len(widths) - 1)},
                    key=lambda shape: (shape[0] * shape[1], shape))
    shapes = [shape for shape in shapes if shape[0] * shape[1] <= MAX_CALIBRATED_TOKENS or shape == shapes[0]]
    cache = target.make_cache(max(b for b, _ in shapes), context + max(w for _, w in shapes) + 1)
    times = _best_times(target, cache, shapes, context, repeats, deadline)
    del cache
    target_points = _smooth({k: {b: _estimate(times, b, w) for b in batches} for k, w in enumerate(widths)})
    draft_points = None
    if draft is not None:
        draft_batches = [b for b in batches if b <= MAX_CALIBRATED_TOKENS]
        times = _best_times(draft, draft.make_cache(draft_batches[-1], context + 2), [(b, 1) for b in draft_batches],
                            context, repeats, max(deadline, time.perf_counter() + 0.25 * budget_seconds))
        draft_points = {b: _estimate(times, b, 1) for b in batches}
    return CostModel(target_points, draft_points, max_batch)
