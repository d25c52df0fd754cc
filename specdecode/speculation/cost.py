"""Step time as a function of batch size and draft length: curves calibrated at start-up (speculation/calibrate.py),
rescaled online to the machine's current speed."""
from __future__ import annotations

import bisect


SCALE_RATE = 0.1
"""Weight of a new measurement in the running measured/calibrated cost ratios and overheads."""


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
