"""`auto`: one tree per step from several sources (prompt lookup, suffix decoding across requests, and a draft model
or REST retrieval when "model" names a draft checkpoint or a datastore), verified in one target pass.

Each source drafts its own tree; the trees are merged into one trie (a token path proposed by two sources is one
node). Every node is valued by its estimated probability of acceptance given its parent's: for each source that
proposed it, that source's rate at that depth and for the confidence its tree came with (prompt lookup and suffix
decoding: how long a match they continue; a draft model: how likely it found each token), learned online from what the verifier accepted (engine-wide, so a new
request starts from what earlier ones taught, and per request on top of it), combined as the chance that at least
one source is right. A node's path value is the product along its path: the expected number of tokens it
adds. The nodes with the highest path values are kept (a parent's is never below its child's, so they form a
tree), as many as the step's budget allows and no more than pay for themselves: with the measured cost of a target
pass per width (the controller's cost model, when one runs), the trees stop growing where one more node per row
would lower the expected tokens per second of the whole batch's pass (its rows are padded to the widest: a row that
guesses nothing pays for another's nodes too, so all rows are cut to one width).

Drafts are one-hot guesses, whatever their source: greedy output equals plain decoding and sampling stays lossless
with either sampler (a deterministic guess is verified exactly however it was chosen). A draft model keeps its own
cache in step by token, whichever source's path the target accepted (DraftModelProposer.observe), and stops drafting
deeper where, at the measured costs, one more level of its nodes could not pay for itself.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from pathlib import Path

import torch

from specdecode.errors import ConfigError
from specdecode.speculation import methods
from specdecode.speculation.methods import FORCED_RUN, Method
from specdecode.speculation.proposers.base import NO_FEATURES
from specdecode.speculation.tree import DraftTree

DEFAULT_SOURCES = ("ngram", "suffix")
"""What `auto` combines without auto_sources (and "draft_model" or "rest" too when "model" names a draft checkpoint
or a datastore)."""
PRIOR_RATE = 0.8
"""A source's acceptance rate at every depth and confidence before anything is measured: optimistic on purpose, as
the controller's prior, since a rate is only learned from nodes that are verified."""
PRIOR_TRIALS = 4.0
"""How many imagined trials that prior is worth, engine-wide."""
REQUEST_WEIGHT = 8.0
"""How many trials the engine-wide rate counts for against a request's own (as the controller's prior)."""
DECAY = 0.995
"""Per step, the share of the engine-wide evidence kept (the text moves on)."""
REQUEST_DECAY = 0.95
"""Per step, the share of a request's own evidence kept."""
DRAFT_WINDOW = 256
"""A draft model joins a request with only its last this many tokens prefilled: a long prompt (an edit, a long
conversation) is mostly served by prompt lookup, and the draft's whole prefill cost more than its drafts saved (a
640-token prompt: 1.9 s of the 0.5B at one thread of a Zen 4 core, beside a 5 s answer)."""
PRIOR_DRAFT_YIELD = 2.0
"""Accepted draft-model nodes per drafted row assumed before any are measured."""
YIELD_RATE = 0.1
"""Weight of each drafted row in the engine-wide running mean of the drafter's yield."""
REQUEST_YIELD_RATE = 0.3
"""Weight of each drafted row in a request's own running mean of it."""
MIN_VALUE = 0.02
"""Nodes whose path value (expected tokens added) is below this are not verified."""
COVERED: float | None = None
"""When set: a free source's path whose every node is worth at least this (the chance it is accepted, its path above
it included) is what the free sources already cover, and where they serve a row well enough that the draft would not
be asked (draft_yield), the draft model drafts below that path's end. Off until measured: drafting below a path
whenever one was worth 0.5, instead of from the root, held auto to 0.88x the best single method on `bench assistant`
(docs/bench/auto_below_2026-12-05); this additive form (0.7, only where the draft would otherwise sit out) is untimed."""


@dataclasses.dataclass
class Candidate:
    """One node of the merged trie."""

    token: int
    parent: int
    depth: int
    sources: list[int]
    """Rates keys (source, its tree's confidence class, depth) of the sources that proposed it."""
    value: float = 0.0
    """Path value: the estimated probability that this node is accepted."""


CLASSES = 9
"""Confidence classes a source's tree may give (DraftTree.confidence 0..8, higher ones counted as 8)."""


class Rates:
    """Acceptance per (source, confidence class, depth): P(node accepted | its parent was), as faded (hits,
    trials) in one flat list."""

    def __init__(self, sources: int, depth: int, hits: float, trials: float):
        self.depth = depth
        self.hits = [hits] * (sources * CLASSES * depth)
        self.trials = [trials] * (sources * CLASSES * depth)

    def at(self, source: int, confidence: int, depth: int) -> int:
        return (source * CLASSES + min(confidence, CLASSES - 1)) * self.depth + depth

    def fade(self, factor: float) -> None:
        self.hits = [x * factor for x in self.hits]
        self.trials = [x * factor for x in self.trials]

    def add(self, key: int, success: bool) -> None:
        self.hits[key] += success
        self.trials[key] += 1.0


class AutoProposer:
    trees_rewritable = True
    feature_request = NO_FEATURES

    def __init__(self, sources: dict, max_depth: int, pass_nodes, widths: list[int]):
        """sources: name -> proposer (each with rewritable one-hot trees); pass_nodes(k): the most nodes for a
        k-level step; widths: the controller's pass width classes (SpeculativeConfig.pass_widths)."""
        self.names = list(sources)
        self.widths = widths
        self.sources = list(sources.values())
        self.max_depth = max_depth
        self.pass_nodes = pass_nodes
        self.rates = Rates(len(self.sources), max_depth, PRIOR_RATE * PRIOR_TRIALS, PRIOR_TRIALS)
        self.request_rates: dict[str, Rates] = {}
        self.last: dict[str, list[Candidate]] = {}
        """request -> the candidates its last tree was made of, in tree order."""
        self.counts = {name: [0, 0] for name in self.names}
        """source -> [nodes proposed in verified trees, nodes accepted] (a node two sources proposed counts for
        both)."""
        self.costs = None
        """The controller's CostModel when one runs (bind_costs): trims trees that would not pay."""
        draft_after = [s for s in self.sources if getattr(s, "draft_after", None) is not None]
        if draft_after:  # a structured request's tree goes on after a forced run through prompt lookup
            self.draft_after = draft_after[0].draft_after
        networks = [s for s in self.sources if s.draft_network is not None]
        self.drafter = networks[0] if networks else None
        if self.drafter is not None:
            self.drafter.window = DRAFT_WINDOW
            self.drafter.scores_nodes = True
        """The source that runs a network per level (a draft model), if any: asked only for rows where the free
        sources' tree is expected to add fewer tokens than its drafts lately did (draft_yield)."""
        self.draft_yield = PRIOR_DRAFT_YIELD
        """Running mean, over rows it drafted for, of the drafter's accepted nodes that no free source proposed too
        (what it adds beyond them), engine-wide; request_yield keeps one per request, starting from this."""
        self.request_yield: dict[str, float] = {}
        self.drafted: set[str] = set()
        """Requests the draft model has joined (prefilled)."""

    @property
    def draft_network(self):
        return self.drafter.draft_network if self.drafter is not None else None

    def ensure_cache(self, slots: int, max_len: int, pool_positions: int | None = None) -> None:
        for source in self.sources:
            source.ensure_cache(slots, max_len, pool_positions)

    def cache_shortfall(self, seqs, budgets) -> int:
        return max(source.cache_shortfall(seqs, budgets) for source in self.sources)

    def bind_costs(self, costs) -> None:
        self.costs = costs

    # -- sequences ------------------------------------------------------------------------------------------

    def add(self, seqs) -> None:
        for source in self.sources:
            if source is not self.drafter:  # (the draft model joins a request when first asked: _join_drafter)
                source.add(seqs)
        for seq in seqs:
            self.request_rates[seq.request_id] = Rates(len(self.sources), self.max_depth, 0.0, 0.0)

    def forget_finished(self) -> None:
        """What the sources remember of finished requests is dropped (the learned rates stay)."""
        for source in self.sources:
            if hasattr(source, "forget_finished"):
                source.forget_finished()

    def remove(self, seq) -> None:
        for source in self.sources:
            if source is not self.drafter or seq.request_id in self.drafted:
                source.remove(seq)
        self.drafted.discard(seq.request_id)
        self.request_rates.pop(seq.request_id, None)
        self.request_yield.pop(seq.request_id, None)
        self.last.pop(seq.request_id, None)

    # -- drafting -------------------------------------------------------------------------------------------

    def rate(self, request_id: str, key: int) -> float:
        """The acceptance estimate of Rates key `key` for a request: its own evidence backed by the engine's."""
        own = self.request_rates.get(request_id)
        g_hits, g_trials = self.rates.hits[key], self.rates.trials[key]
        prior = g_hits / g_trials if g_trials > 0 else PRIOR_RATE
        if own is None:
            return prior
        return (own.hits[key] + REQUEST_WEIGHT * prior) / (own.trials[key] + REQUEST_WEIGHT)

    def propose(self, seqs, budgets: list[int]) -> list[DraftTree]:
        budgets = [min(b, self.max_depth) for b in budgets]
        per_source = [None if source is self.drafter else source.propose(seqs, budgets) for source in self.sources]
        if self.drafter is not None:  # after the free sources: a row they serve as well as the draft would is not drafted
            at = self.sources.index(self.drafter)
            free = [[DraftTree.empty() if trees_of is None else trees_of[row] for trees_of in per_source]
                    for row in range(len(seqs))]
            wanted, prefixes = [], []
            for row, (seq, b) in enumerate(zip(seqs, budgets)):
                merged = self._merge(seq.request_id, free[row], b) if b > 0 else []
                prefix = []
                if b > 0 and self._expected(merged, b) < self.request_yield.get(seq.request_id, self.draft_yield):
                    wanted.append(b)  # the free sources guess too little: the draft drafts from the root
                else:  # they serve the row: the draft only continues their sure path, where they stop being sure
                    prefix = (self._covered(merged, b, COVERED) if COVERED is not None and b > 0
                              and seq.params.greedy else [])
                    wanted.append(b - len(prefix) if prefix else 0)
                prefixes.append(prefix)
            self._join_drafter([seq for seq, b in zip(seqs, wanted) if b > 0])
            self.drafter.deeper = self._deeper if self.costs is not None else None
            per_source[at] = self.drafter.propose(seqs, wanted, prefixes)
        rows = []  # per row: its merged candidates and the best of them, best first
        for row, (seq, budget) in enumerate(zip(seqs, budgets)):
            k = budget
            if k <= 0:
                rows.append(([], []))
                continue
            merged = self._merge(seq.request_id, [trees_of[row] for trees_of in per_source], k)
            rows.append((merged, self._best(merged, self.pass_nodes(k))))
        if self.costs is not None:  # one pass width for the batch: every row is padded to the widest
            width = self._paying(len(seqs), [[merged[i].value for i in best] for merged, best in rows])
            rows = [(merged, best[:width]) for merged, best in rows]
        trees = []
        for seq, (merged, best) in zip(seqs, rows):
            kept = self.last[seq.request_id] = self._tree(merged, best)
            trees.append(DraftTree(torch.tensor([c.token for c in kept], dtype=torch.long),
                                   tuple(c.parent for c in kept)) if kept else DraftTree.empty())
        return trees

    def _merge(self, request_id: str, trees: list[DraftTree], k: int) -> list[Candidate]:
        """The sources' trees as one trie (parents before children), each node with its path value."""
        nodes: list[Candidate] = []
        index: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
        for source, tree in enumerate(trees):
            mapped: list[int] = []
            tokens = tree.tokens.tolist()
            for i, parent in enumerate(tree.parents):
                up = mapped[parent] if parent >= 0 else -1
                depth = nodes[up].depth + 1 if up >= 0 else 0
                if up == -2 or depth >= k:  # below a node that was too deep
                    mapped.append(-2)
                    continue
                node = index.get((up, tokens[i]))
                if node is None:
                    node = index[(up, tokens[i])] = len(nodes)
                    nodes.append(Candidate(tokens[i], up, depth, []))
                confidence = tree.node_confidence[i] if tree.node_confidence is not None else tree.confidence
                nodes[node].sources.append(self.rates.at(source, confidence, depth))
                mapped.append(node)
        for node in nodes:  # parents come first, so theirs are known
            miss = math.prod(1.0 - self.rate(request_id, key) for key in node.sources)
            node.value = (1.0 - miss) * (nodes[node.parent].value if node.parent >= 0 else 1.0)
        return nodes

    @staticmethod
    def _covered(nodes: list[Candidate], k: int, least: float) -> list[int]:
        """Tokens of the free sources' most valuable path from the root, as long as each node is worth `least` or
        more (at most k - 1 of them: the draft gets at least a level below)."""
        path, at = [], -1
        while len(path) < k - 1:
            children = [i for i, c in enumerate(nodes) if c.parent == at]
            if not children:
                break
            best = max(children, key=lambda i: nodes[i].value)
            if nodes[best].value < least:
                break
            path.append(nodes[best].token)
            at = best
        return path

    def _join_drafter(self, seqs) -> None:
        """The draft model prefills a request's tokens the first time it is asked to draft for it, not when the
        request joins: a request the free sources serve alone (an edit that copies its prompt) never pays the draft's
        prefill (see DRAFT_WINDOW)."""
        fresh = [seq for seq in seqs if seq.request_id not in self.drafted]
        if fresh:
            self.drafter.add(fresh)
            self.drafted.update(seq.request_id for seq in fresh)

    def _expected(self, nodes: list[Candidate], k: int) -> float:
        """Tokens a k-level tree of these candidates is expected to add (its best nodes' values summed)."""
        return sum(nodes[i].value for i in self._best(nodes, self.pass_nodes(k)))

    @staticmethod
    def _best(nodes: list[Candidate], most: int) -> list[int]:
        """Indices of the most valuable nodes, best first: at most `most`, each worth MIN_VALUE or more. (A node's
        value is its path's, so no node comes before its parent.)"""
        order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].value, nodes[i].depth, i))
        return [i for i in order[:most] if nodes[i].value >= MIN_VALUE]

    @staticmethod
    def _tree(nodes: list[Candidate], kept: list[int]) -> list[Candidate]:
        """The kept nodes re-indexed in tree order (parents before children)."""
        chosen = sorted(kept)
        position = {old: new for new, old in enumerate(chosen)}
        return [dataclasses.replace(nodes[i], parent=position[nodes[i].parent] if nodes[i].parent >= 0 else -1)
                for i in chosen]

    def _paying(self, batch: int, values: list[list[float]]) -> int:
        """How many nodes per row (each row's best first) maximise expected tokens per second of one pass over
        `batch` rows: each row gains 1 + its kept values, and every row pays for the widest row's positions (the
        pass is padded), at the measured pass cost of that width."""
        best_n, best = 0, batch / self._pass_time(batch, 1)
        tokens = float(batch)
        for n in range(1, max(map(len, values), default=0) + 1):
            tokens += sum(row[n - 1] for row in values if len(row) >= n)
            rate = tokens / self._pass_time(batch, 1 + n)
            if rate > best:
                best_n, best = n, rate
        return best_n

    def _deeper(self, batch: int, levels: int, expected: float, gain: float) -> bool:
        """Whether a draft model's next level pays: `levels` drafted so far are expected to give `expected` tokens
        (the batch's committed ones included) and one more would add `gain`; it pays when the tokens per second of
        the step rise, each level costing one draft forward and one more position per row in the target pass.
        (The draft forward is priced at its start-up calibration times the target's current speed ratio: the
        controller's own draft-time ratio is learned for full-depth drafts.)"""
        costs = self.costs
        level = costs.draft(batch) * costs.target_scale if costs.draft is not None else 0.0
        now = self._pass_time(batch, 1 + levels) + levels * level
        more = self._pass_time(batch, 2 + levels) + (levels + 1) * level
        return (expected + gain) * now > expected * more

    def _pass_time(self, batch: int, width: int) -> float:
        """Seconds of a step whose target pass has `width` positions per row: the calibrated pass times of the
        controller's width classes, interpolated (extrapolated proportionally past the widest), plus the measured
        rest of a step."""
        costs, widths = self.costs, self.widths
        k = bisect.bisect_left(widths, width)
        if k == 0:
            seconds = costs.target_time(batch, 0)
        elif k == len(widths):
            seconds = costs.target_time(batch, k - 1) * width / widths[-1]
        else:
            lo, hi = costs.target_time(batch, k - 1), costs.target_time(batch, k)
            seconds = lo + (hi - lo) * (width - widths[k - 1]) / (widths[k] - widths[k - 1])
        return seconds + costs.overhead_time(batch, width > 1)

    # -- learning -------------------------------------------------------------------------------------------

    def observe(self, seqs, trees, results) -> None:
        for source in self.sources:
            source.observe(seqs, trees, results)
        self.rates.fade(DECAY)
        for seq, tree, result in zip(seqs, trees, results):
            kept = self.last.pop(seq.request_id, None)
            own = self.request_rates.get(seq.request_id)
            if own is not None:
                own.fade(REQUEST_DECAY)
            if not kept or [c.token for c in kept] != tree.tokens.tolist():
                continue  # nothing drafted, or the step verified another tree (a structured request's)
            accepted = set(result.accepted)
            if self.drafter is not None:
                drafter = self.sources.index(self.drafter)
                mine = [i for i, node in enumerate(kept)
                        if any(key // (CLASSES * self.max_depth) == drafter for key in node.sources)]
                if mine:  # what it added: its accepted nodes that no free source proposed
                    added = len(accepted.intersection(i for i in mine if len(kept[i].sources) == 1))
                    self.draft_yield += YIELD_RATE * (added - self.draft_yield)
                    own_yield = self.request_yield.get(seq.request_id, self.draft_yield)
                    self.request_yield[seq.request_id] = own_yield + REQUEST_YIELD_RATE * (added - own_yield)
            for i, node in enumerate(kept):
                if node.parent >= 0 and node.parent not in accepted:
                    continue  # its parent was rejected: it was never tried
                success = i in accepted
                for key in node.sources:
                    self.rates.add(key, success)
                    if own is not None:
                        own.add(key, success)
            for node_index, node in enumerate(kept):
                for key in node.sources:
                    name = self.names[key // (CLASSES * self.max_depth)]
                    self.counts[name][0] += 1
                    self.counts[name][1] += node_index in accepted


def _source_config(config, name: str):
    """The config a source is built from: auto's own, its method replaced ("model" only for the source it names:
    the draft model or rest's datastore; one chain for a draft)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    fields.update(method=name, auto_sources=None, num_drafts=1,
                  model=config.model if methods.get(name).model in ("draft", "datastore") else None)
    return type(config)(**fields)


def names_datastore(model: str | None) -> bool:
    """Whether auto's "model" names a REST datastore (a directory with datastore.json), not a draft checkpoint."""
    return model is not None and (Path(model) / "datastore.json").is_file()


def _sources(config) -> list[str]:
    if config.auto_sources:
        return list(config.auto_sources)
    if not config.model:
        return [*DEFAULT_SOURCES]
    return [*DEFAULT_SOURCES, "rest"] if names_datastore(config.model) else ["draft_model", *DEFAULT_SOURCES]


def _build(config, context) -> AutoProposer:
    names = _sources(config)
    if len(set(names)) != len(names) or "auto" in names:
        raise ConfigError(f"auto_sources must name distinct methods other than auto, got {names}")
    for name in names:
        if name not in methods.names():
            raise ConfigError(f"auto_sources: {name!r} is not a method; use some of draft_model, ngram, suffix, rest")
    wanted = {methods.get(name).model for name in names} & {"draft", "datastore"}
    if len(wanted) > 1:
        raise ConfigError('auto: "model" names one thing, a draft checkpoint or a datastore; combine draft_model '
                          "or rest, not both")
    given = "datastore" if names_datastore(config.model) else "draft" if config.model else None
    if wanted and not config.model:
        raise ConfigError(f'auto_sources {names}: {"rest" if "datastore" in wanted else "draft_model"} needs "model" '
                          f'(--speculative-model): {"a datastore directory" if "datastore" in wanted else "a draft checkpoint"}')
    if config.model and given not in wanted:
        raise ConfigError(f'auto: "model" names a {"datastore" if given == "datastore" else "draft checkpoint"}; '
                          f'add {"rest" if given == "datastore" else "draft_model"} to auto_sources or drop "model"')
    sources = {}
    for name in names:
        refusal = ConfigError(f"auto_sources: {name} cannot be combined yet (auto merges one-hot guesses from "
                              "proposers that read no target features: draft_model, ngram, suffix, rest)")
        if methods.get(name).model == "speculator":  # (their heads read the target's features)
            raise refusal
        proposer = methods.get(name).build(_source_config(config, name), context)
        follows = getattr(proposer, "trees_rewritable", False) or getattr(proposer, "observes_tokens", False)
        if not follows or proposer.feature_request.wanted:
            raise refusal
        sources[name] = proposer
    return AutoProposer(sources, config.num_speculative_tokens, config.pass_nodes, config.pass_widths)


def _draft_memory(config) -> str | None:
    """What the capacity plan counts: the draft checkpoint when "model" names one."""
    return "decoder" if config.model and not names_datastore(config.model) else None


def _cache_margin(config) -> int:
    """A draft model's cache holds its chain in flight beyond the target's rows."""
    return 2 + config.num_speculative_tokens if _draft_memory(config) else 0


def _tree_nodes(config) -> int:
    """The most nodes at full depth: num_tree_nodes, default one per level (wide passes cost much on a CPU: the
    controller then prices a k-level step as a k-token pass, and the tree spends those k nodes where they are
    worth most, deep or wide)."""
    return config.num_tree_nodes or config.num_speculative_tokens


def _pass_nodes(config, k: int) -> int:
    return math.ceil(_tree_nodes(config) * k / config.num_speculative_tokens)


METHOD = Method("auto", _build, model="draft or datastore", options=("auto_sources", "num_tree_nodes"),
                draft_memory=_draft_memory, cache_margin=_cache_margin,
                nodes_per_level=lambda config: math.ceil(_tree_nodes(config) / config.num_speculative_tokens),
                pass_nodes=_pass_nodes, forced_run=FORCED_RUN)
