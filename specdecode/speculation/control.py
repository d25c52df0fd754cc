"""How many tokens to draft each step: costs measured on this machine (speculation/cost.py, calibrated by
speculation/calibrate.py) plus each request's acceptance rate.

With a per-level acceptance rate a, drafting K levels yields E = (1 - a^(K+1)) / (1 - a) tokens per step. A step
over B sequences costs target(B, K) + K * draft(B) + overhead(B); the controller picks the K in {0..K_max} with
the most expected tokens per second, K = 0 being plain decoding. At a large batch the target pass is compute
bound, verifying K more tokens per row costs about K times more, and the best K becomes 0 by itself.
"""
from __future__ import annotations

import bisect

from specdecode.speculation.cost import SCALE_RATE, CostModel

MAX_PROBE_INTERVAL = 512
"""Most plain steps between two probes of a speculator whose drafts keep failing."""
GATE_EVIDENCE = 8.0
"""Tokens of a request's drafting steps (since its last verdict) the cost gate needs before it judges them."""
GATE_DECAY = 0.5
"""Per plain step, the share of a request's plain-step timing kept (its context, and so its step, keeps growing);
a new time counts for at most twice the kept one (a step stalled by other work on the machine is not its rate)."""
PLAIN_REFRESH = 32
"""A request that has drafted this many steps since its last plain step takes a plain one, and its first decode step
is plain: the rate drafting must beat is measured on the request itself, as it is now. (Without it the gate fell back
on the cost model's plain step, whose overhead, learned on drafting steps alone, held a proposer's own work: Lookahead
and Medusa drafted at 0.77-0.80x plain and looked as if they paid.) Costs at most 1/33 of what drafting gains."""


class CostGate:
    """The per-request stopwatch verdict that keeps every request at least as fast as its own plain decoding.

    Each request may draft at most `cap` levels a step. Its drafting steps' wall time and the tokens they gave are
    summed; once they hold GATE_EVIDENCE tokens (or after two steps that took over twice plain's time) they are
    compared with what plain steps would have taken for as many tokens (the request's own plain steps when it has had
    some, else the engine's at its batch size): slower cuts the cap by half or by that ratio, whichever cuts more
    (down to 0, no drafting); at least as fast doubles it back towards max_k; and the sums start again, so each verdict
    judges the cap it set. At cap 0 the request decodes plainly and is probed at cap 1 after `interval`
    plain steps; a probe that loses doubles the interval (up to MAX_PROBE_INTERVAL), one that pays resets it. A
    request's first decode step, and one in every PLAIN_REFRESH, is plain, to time its plain rate. A new
    request starts at the cap and probe interval the engine's latest verdict left, so when a method loses on every
    request (a weak head on this text) the next one does not pay again to find out, and probes grow rarer across
    requests (a 128-token request held at 0 and probed after 16 steps lost ~3% to its one probe window).
    The model-based choice (SpecController.best_k) proposes; this gate only ever lowers what a request drafts.
    """

    def __init__(self, max_k: int, probe_every: int):
        self.max_k = max_k
        self.probe_every = probe_every
        self.start_cap = max_k
        self.start_interval = probe_every
        self.requests: dict[str, dict] = {}

    def _state(self, request_id: str) -> dict:
        state = self.requests.get(request_id)
        if state is None:
            state = self.requests[request_id] = {
                "cap": self.start_cap, "seconds": 0.0, "tokens": 0.0, "steps": 0,  # drafting steps since the verdict
                "deepest": 0,  # the most levels one of them drafted
                "plain": None, "since_plain": 0,  # faded seconds of its own plain steps; drafting steps since one
                "interval": self.start_interval, "wait": self.start_interval}  # plain steps before a probe at cap 0
        return state

    def cap(self, request_id: str) -> int:
        """Most levels this request may draft in the next step (a probe's 1 when its wait is over)."""
        state = self._state(request_id)
        if state["cap"] == 0 and state["wait"] <= 0:
            return 1
        return state["cap"]

    def timing(self, request_id: str) -> bool:
        """Whether this request's next step must be plain, to time its plain rate (its first, then one in every
        PLAIN_REFRESH drafting steps)."""
        state = self._state(request_id)
        return state["plain"] is None or state["since_plain"] >= PLAIN_REFRESH

    def observe(self, request_id: str, depth: int, tokens: int, wall: float, engine_plain: float | None) -> None:
        """One step of this request: the levels it drafted (0: a plain step), the tokens it committed, the step's
        wall time, and the engine's plain step time at the step's batch size (None if unknown)."""
        state = self._state(request_id)
        if not depth:
            kept = state["plain"]
            state["plain"] = wall if kept is None else GATE_DECAY * kept + (1 - GATE_DECAY) * min(wall, 2 * kept)
            state["since_plain"] = 0
            if state["cap"] == 0:
                state["wait"] -= 1
            return
        state["since_plain"] += 1
        state["deepest"] = max(state["deepest"], depth)
        state["seconds"] += wall
        state["tokens"] += tokens
        state["steps"] += 1
        plain = state["plain"] if state["plain"] is not None else engine_plain
        if plain is None:
            return
        ratio = state["tokens"] * plain / state["seconds"]  # drafting's tokens per second over plain's
        # Judged once GATE_EVIDENCE tokens are in, or at once (two steps) when drafting takes twice plain's time.
        if state["tokens"] < GATE_EVIDENCE and not (state["steps"] >= 2 and ratio < 0.5):
            return
        probing = state["cap"] == 0 and state["wait"] <= 0
        state["steps"] = 0
        if ratio < 1.0:  # slower than plain steps would have been: at least halved, more the more it lost, and
            # below the deepest draft it judged (a cap above what the controller chose changes nothing: Lookahead
            # drafting one level under a cap of 4 lost through three verdicts before it stopped)
            if probing:
                state["interval"] = min(2 * state["interval"], MAX_PROBE_INTERVAL)
            state["cap"] = max(0, min(state["cap"] // 2, int(state["cap"] * ratio), state["deepest"] - 1))
            state["wait"] = state["interval"]
        else:
            state["cap"] = min(self.max_k, max(1, 2 * state["cap"]))
            state["interval"] = self.probe_every
        state["seconds"] = state["tokens"] = 0.0
        state["deepest"] = 0
        self.start_cap, self.start_interval = state["cap"], state["interval"]

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)


def best_tree_width(pass_time: dict[int, float], level_time: dict[int, float], accuracy: list[list[float]],
                    max_k: int, candidates: list[int]) -> tuple[int, float]:
    """(nodes per level n, expected speedup over plain decoding) of the tree shape with the most expected tokens per
    second at batch 1: n nodes a level, up to max_k levels (the controller still picks the depth per step).
    pass_time[w]: seconds of a one-row target pass of width w (pass_time[1] = a plain step); level_time[n]: seconds of
    one drafting level of n nodes; accuracy[d][r]: P(the speculator's rank-r guess at depth d + 1 is the target's
    token), its held-out figure (the last row stands in for deeper levels). A level of n nodes is taken to hold the
    right token as often as the top n guesses do. Where verifying wide passes is about as cheap as one token (GPUs)
    the widest candidate wins; on a CPU whose cost grows with the width, a chain may be the only tree that pays."""
    plain = pass_time[1]
    best = (max(candidates), 0.0)
    for n in sorted(candidates, reverse=True):  # ties go to the wider tree
        reach, tokens = 1.0, 1.0
        for k in range(1, max_k + 1):
            reach *= min(1.0, sum(accuracy[min(k, len(accuracy)) - 1][:n]))
            tokens += reach
            speedup = tokens * plain / (pass_time[1 + n * k] + k * level_time[n])
            if speedup > best[1]:
                best = (n, speedup)
    return best


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
        self.delegated = False
        """Set when the proposer values its own nodes and trims its trees by these same costs (auto): then every
        step offers it the whole budget. Its estimates are per source and match length, which separate a sure guess
        from an unsure one; this controller's per-level rates, one per request, cannot (at batch 1 they held auto
        to one node a step, 0.86x the best fixed budget)."""
        self.reset_acceptance()

    def reset_acceptance(self) -> None:
        # Engine-wide successes and trials per level, starting from 10 imagined trials at the prior rate.
        self.global_hits = [10.0 * self.prior_acceptance] * self.max_k
        self.global_trials = [10.0] * self.max_k
        self.counts: dict[str, tuple[list[float], list[float]]] = {}  # request -> (hits, trials) per level
        # What drafting really gave each request, against its plain steps' wall time. The model above can be wrong
        # (a longer context than calibrated, a proposer slower than it looked, acceptance that fell, a machine
        # shared with other work); the stopwatch is not.
        self.gate = CostGate(self.max_k, self.probe_every)
        self.plain_wall: dict[int, float] = {}  # engine-wide running wall time of a plain step per batch size
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

    def caps(self, seqs) -> list[int]:
        """Most levels each sequence may draft this step (the cost gate's verdicts on its own drafting steps)."""
        if self.fixed_k is not None:  # (a benchmark of a fixed K: no gate)
            return [self.fixed_k] * len(seqs)
        gate, whole = self.gate, self.delegated
        # A delegated proposer trims its own trees: the gate only turns a row's drafting off and on (binary).
        return [0 if gate.timing(s.request_id) else (self.max_k if whole and gate.cap(s.request_id) else
                                                     gate.cap(s.request_id)) for s in seqs]

    def choose(self, seqs) -> int:
        """Draft levels for this step (0 = plain); sequences with speculation off, or that the cost gate holds to
        plain decoding, are counted as plain rows, and no row drafts more than its gate allows (DraftBudget also
        caps each row by caps())."""
        if self.fixed_k is not None:
            return self.fixed_k
        speculating = [s for s in seqs if s.params.use_speculation]
        if not speculating:
            return 0
        caps = [self.gate.cap(s.request_id) for s in speculating]
        most = max(caps)
        if most == 0:
            return 0
        if self.delegated:
            # Asking costs the proposer's work for every row; once nothing it drafted paid for probe_every steps
            # (at a large batch no tree pays), it is asked once every probe_every steps until it drafts again.
            idle = self.steps_since_draft
            return self.max_k if idle < self.probe_every or idle % self.probe_every == 0 else 0
        prior = self.global_rates()
        rates = [self.rates(s.request_id, prior) for s, cap in zip(speculating, caps) if cap > 0]
        k = min(self.best_k(len(seqs), rates)[0], most)
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
        engine_plain = self.plain_wall.get(len(seqs)) or self.costs.step_time(len(seqs), 0)
        # Levels drafted per row: the trees' depths (a tree's node count need not be a multiple of its levels).
        depths = report.draft_depths or [d // npl for d in report.draft_lens]
        for seq, drafted, depth, accepted in zip(seqs, report.draft_lens, depths, report.accepted_lens):
            if drafted or report.width == 1:  # (a row that drafted nothing beside rows that did: no evidence)
                # A delegated proposer's cap is binary (caps()): its halvings are the patience before it stops, and
                # its trees' depth is its own choice, so the cut below the deepest draft does not apply to it.
                judged = self.max_k if self.delegated else max(depth, 1)
                self.gate.observe(seq.request_id, judged if drafted else 0, 1 + accepted, wall_time, engine_plain)
        if drafting:
            self.global_hits = [h * 0.99 for h in self.global_hits]
            self.global_trials = [t * 0.99 for t in self.global_trials]
        decay = self.decay
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
        self.gate.forget(request_id)
