"""Start-up timing of this machine's target passes and draft forwards, bounded in time whatever the sizes: the shapes
the speculation controller's cost model starts from."""
from __future__ import annotations

import hashlib
import json
import os
import time

import torch

from specdecode.speculation.cost import CostModel


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
                  budget_seconds: float = CALIBRATION_SECONDS, stored_as: str | None = None) -> CostModel:
    """Time target passes over the batch sizes and draft lengths the engine can use, and draft forwards (if the
    proposer has a draft model), on this machine, at start-up. widths: pass width per row for each draft length
    0..max_k (default 1 + nodes_per_level * k). Bounded in time whatever the sizes: a subset of draft lengths is
    timed (the others interpolated), no pass of more than MAX_CALIBRATED_TOKENS, and nothing new is started after
    budget_seconds. stored_as: a name for these models on this machine (calibration_name): the times are kept in
    the cache under it and read back by the next start instead of timed again (the cost model rescales them to the
    machine's speed of the moment as it runs, so what is kept is their shape)."""
    batches = sorted({1, max_batch} | {2 ** i for i in range(max_batch.bit_length()) if 2 ** i < max_batch})
    widths = list(widths) if widths else [1 + nodes_per_level * k for k in range(max_k + 1)]
    shapes = sorted({(b, widths[k]) for b in batches for k in _calibrated_levels(len(widths) - 1)},
                    key=lambda shape: (shape[0] * shape[1], shape))
    shapes = [shape for shape in shapes if shape[0] * shape[1] <= MAX_CALIBRATED_TOKENS or shape == shapes[0]]
    draft_batches = [b for b in batches if b <= MAX_CALIBRATED_TOKENS] if draft is not None else []
    stored = _read_times(stored_as, shapes, draft_batches)
    if stored is not None:
        target_times, draft_times = stored
    else:
        deadline = time.perf_counter() + budget_seconds
        cache = target.make_cache(max(b for b, _ in shapes), context + max(w for _, w in shapes) + 1)
        target_times = _best_times(target, cache, shapes, context, repeats, deadline)
        del cache
        draft_times = {}
        if draft is not None:
            draft_times = _best_times(draft, draft.make_cache(draft_batches[-1], context + 2),
                                      [(b, 1) for b in draft_batches], context, repeats,
                                      max(deadline, time.perf_counter() + 0.25 * budget_seconds))
        _write_times(stored_as, target_times, draft_times)
    target_points = _smooth({k: {b: _estimate(target_times, b, w) for b in batches} for k, w in enumerate(widths)})
    draft_points = {b: _estimate(draft_times, b, 1) for b in batches} if draft is not None else None
    return CostModel(target_points, draft_points, max_batch)


def calibration_name(*parts) -> str:
    """A name for a calibration: a digest of what its times depend on (the models' files as they are now, the
    kernels' build - this CPU's instruction sets among it -, the threads), given as `parts` by the caller."""
    from specdecode.kernels import build_key

    digest = hashlib.sha256(repr((parts, build_key(), torch.get_num_threads())).encode())
    return digest.hexdigest()[:24]


def _times_path(name: str):
    from specdecode.catalog.registry import cache_dir

    return cache_dir() / "calibration" / f"{name}.json"


def _read_times(name: str | None, shapes: list[tuple[int, int]], draft_batches: list[int]):
    """(target times, draft times) kept under `name` when they cover the shapes asked for, else None."""
    if name is None:
        return None
    try:
        kept = json.loads(_times_path(name).read_text())
        target = {(int(b), int(w)): float(t) for b, w, t in kept["target"]}
        draft = {(int(b), 1): float(t) for b, t in kept["draft"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if shapes[0] not in target or any((b, 1) not in draft for b in draft_batches[:1]):
        return None
    return target, draft


def _write_times(name: str | None, target: dict, draft: dict) -> None:
    if name is None:
        return
    path = _times_path(name)
    kept = {"target": [[b, w, t] for (b, w), t in sorted(target.items())],
            "draft": [[b, t] for (b, _), t in sorted(draft.items())]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(kept))
        os.replace(partial, path)
    except OSError:
        pass  # (timed again at the next start)


def pass_times(model, widths: list[int], context: int = 128, repeats: int = 2,
               budget_seconds: float = 3.0) -> dict[int, float]:
    """Best seconds of a one-row cached pass of each width (1 = a plain step; more = a verified chain) after
    `context` tokens; widths not measured within budget_seconds are interpolated from those that were."""
    deadline = time.perf_counter() + budget_seconds
    shapes = [(1, w) for w in sorted(set(widths))]
    times = _best_times(model, model.make_cache(1, context + max(widths) + 1), shapes, context, repeats, deadline)
    return {w: _estimate(times, 1, w) for w in widths}
