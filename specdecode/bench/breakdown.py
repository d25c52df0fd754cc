"""Where a speculative step's time goes (`bench --speed`'s breakdown; issue 56): an engine's steps timed part by part
while it generates - the target's layers split by the kernels themselves into their products, attention (with the
cache write) and the rest, the target's LM head, the target pass's Python around them, proposing (the draft model's
own layers included, and its prefill of sequences that join drafting), verification with sampling and the
bookkeeping that commits a step, and the scheduler around each step. Prefill iterations are left out.

The parts are measured on the engine's own calls (wrapped for the measurement, put back after) and the layers'
parts by kernels/layer.cpp's clock (kernel_timing), so they add up to the steps' wall time."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

from specdecode.model.quant import kernels as quant_kernels

PARTS = ("linear products", "attention", "other layer work", "LM head", "target pass outside the kernels",
         "proposing", "verification, sampling, commit", "scheduler")
"""In order: the target pass's parts (its layers' products, attention, norms/rotary/residuals; its LM head; the rest
of its forward), then the step's other parts, then what the scheduler adds around the step."""


class StepBreakdown:
    """Sums, over an engine's speculative steps while it is entered, the seconds of each of PARTS."""

    def __init__(self, llm):
        self.llm = llm
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.steps = 0

    def __enter__(self) -> "StepBreakdown":
        llm, runner, target = self.llm, self.llm.runner, self.llm.target
        kernels = quant_kernels()
        clock = time.perf_counter
        in_step = [False]
        layer_times = kernels.kernel_times if kernels is not None else (lambda: [0.0, 0.0, 0.0])
        if kernels is not None:
            kernels.kernel_timing(True)
        real_forward, real_head, real_step = target.forward, target.lm_head.forward, runner.step
        real_make_scheduler = llm.make_scheduler

        def forward(*args, **kwargs):
            if not in_step[0]:
                return real_forward(*args, **kwargs)
            before, start = layer_times(), clock()
            out = real_forward(*args, **kwargs)
            wall, after = clock() - start, layer_times()
            spent = [b - a for a, b in zip(before, after)]
            for part, seconds in zip(PARTS[:3], spent):
                self.seconds[part] += seconds
            self.seconds[PARTS[4]] += wall - sum(spent)  # (the LM head's share moves out of it below)
            self._forward += wall
            return out

        def head(*args, **kwargs):
            start = clock()
            out = real_head(*args, **kwargs)
            if in_step[0]:
                seconds = clock() - start
                self.seconds["LM head"] += seconds
                self.seconds[PARTS[4]] -= seconds
            return out

        def step(seqs, budgets, chunk=None):
            self._forward = 0.0
            in_step[0] = True
            start = clock()
            try:
                return real_step(seqs, budgets, chunk)
            finally:
                in_step[0] = False
                wall = clock() - start
                report = runner.last_report
                proposing = (report.draft_time + report.join_time) if report is not None else 0.0
                self.seconds["proposing"] += proposing
                self.seconds["verification, sampling, commit"] += wall - self._forward - proposing
                self._step_wall = wall
                self.steps += 1

        def make_scheduler(*args, **kwargs):
            scheduler = real_make_scheduler(*args, **kwargs)
            real_iteration = scheduler.step

            def iteration():
                self._step_wall = None
                start = clock()
                out = real_iteration()
                if self._step_wall is not None and not out.prefilled:  # a step, no prefill beside it
                    self.seconds["scheduler"] += clock() - start - self._step_wall
                return out

            scheduler.step = iteration
            return scheduler

        self._step_wall = None
        self._forward = 0.0
        self._restore = contextlib.ExitStack()
        for owner, name, wrapper in ((target, "forward", forward), (target.lm_head, "forward", head),
                                     (runner, "step", step), (llm, "make_scheduler", make_scheduler)):
            setattr(owner, name, wrapper)
            self._restore.callback(lambda owner=owner, name=name: owner.__dict__.pop(name, None))
        if kernels is not None:
            self._restore.callback(kernels.kernel_timing, False)
        return self

    def __exit__(self, *exc) -> None:
        self._restore.close()

    def shares(self) -> dict[str, dict[str, float]]:
        """Each part's milliseconds a step and its share of the whole (the steps and, for the iterations that
        were only a step, the scheduler's time around them)."""
        whole = sum(self.seconds.values()) or 1.0
        steps = max(self.steps, 1)
        return {part: {"ms_per_step": 1000 * s / steps, "share": s / whole} for part, s in self.seconds.items()}


def breakdown_lines(name: str, breakdown: dict[str, dict[str, float]]) -> list[str]:
    """A line per part: `name: part  12.3 ms a step  45.6%`."""
    return [f"{name}: {part:<32s} {row['ms_per_step']:7.1f} ms a step {100 * row['share']:5.1f}%"
            for part, row in breakdown.items()]


def step_breakdowns(config, prompt: str, log=print) -> dict[str, dict[str, dict[str, float]]]:
    """`bench --speed`'s breakdowns on the quantized kernels: prompt lookup at a fixed K = 4 and 8 on `prompt` (one
    that invites copying) alone, and the model's shipped speculation (a catalog model) over config.batch copies of
    it at once."""
    from specdecode.bench.speed import build
    from specdecode.catalog.registry import default_speculative_config
    from specdecode.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=config.tokens, ignore_eos=True)
    runs = [(f"ngram K={k}, batch 1", {"method": "ngram", "num_speculative_tokens": k, "adaptive": False}, 1)
            for k in (4, 8)]
    shipped = default_speculative_config(Path(config.model).parent.name)  # a catalog model's file in the cache
    if config.batch > 1 and shipped is not None:
        runs.append((f"default speculation ({shipped['method']}), batch {config.batch}", shipped, config.batch))
    out = {}
    for name, spec, batch in runs:
        llm = build(config, "float32", "gguf", spec)
        messages = [[{"role": "user", "content": prompt}]] * batch
        llm.chat(messages[:1], SamplingParams(temperature=0, max_tokens=4))  # warm
        log(f"step breakdown: {name}")
        with StepBreakdown(llm) as measured:
            llm.chat(messages, params)
        out[name] = measured.shares()
        del llm
    return out
