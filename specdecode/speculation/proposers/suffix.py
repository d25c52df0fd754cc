"""Suffix decoding (Oliaro et al., 2024, SuffixDecoding; shipped in Arctic Inference): one suffix tree, shared by
the whole engine, over the prompts and outputs of recent requests, those in flight included, grown as each token is
emitted. Each step finds the longest suffix of a sequence's tokens that occurred before (in any request, or earlier
in its own) and drafts a tree of what followed it there: branches valued by how often each continuation followed,
the most probable kept, within the step's node budget. Drafts are deterministic guesses (one-hot): greedy output
equals plain decoding and sampling stays lossless.

Why a suffix tree and not a suffix automaton: the tree counts, at every node, how many indexed strings pass through
it, so the children of a matched node are its continuations with their frequencies, ready to draft from; and a
finished request is forgotten by walking its own strings and decrementing those counts, whereas an automaton cannot
forget a string without being rebuilt from everything it holds. The tree indexes each position's next `max_depth`
tokens (the "windows"), path-compressed, so that it holds at most about two nodes per indexed token.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import math

import torch

from specdecode.errors import ConfigError
from specdecode.speculation.methods import FORCED_RUN, Method
from specdecode.speculation.proposers.base import NO_FEATURES, WithoutDraftCache
from specdecode.speculation.tree import DraftTree


MATCH_CLASSES = 8
"""A draft tree's confidence is the length of the match it continues, up to this many tokens."""


@dataclasses.dataclass
class SuffixConfig:
    """Suffix decoding options."""

    num_speculative_tokens: int = 16
    """Deepest tree level drafted."""
    num_tree_nodes: int = 16
    """Tree nodes at full depth; a shallower step gets a proportional share."""
    max_tokens: int = 100_000
    """suffix_max_tokens: tokens of finished requests the tree keeps besides those in flight (the oldest finished
    requests are evicted first)."""
    max_depth: int = 64
    """suffix_max_depth: longest string indexed from each position (the matched suffix plus its drafted
    continuation)."""
    min_prob: float = 0.5
    """suffix_min_prob: least estimated probability of a drafted node (the continuation frequencies along its path,
    multiplied)."""
    spec_factor: float = 1.0
    """suffix_spec_factor: draft at most this many levels per matched token (a short match drafts little)."""

    def __post_init__(self):
        checks = [("num_speculative_tokens", self.num_speculative_tokens, 1), ("num_tree_nodes", self.num_tree_nodes, 1),
                  ("suffix_max_tokens", self.max_tokens, 0), ("suffix_max_depth", self.max_depth, 2)]
        for name, value, least in checks:
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"suffix: {name} must be an integer >= {least}, got {value!r}")
        if not isinstance(self.min_prob, (int, float)) or not 0.0 < self.min_prob <= 1.0:
            raise ConfigError(f"suffix: suffix_min_prob must be a number in (0, 1], got {self.min_prob!r}")
        if not isinstance(self.spec_factor, (int, float)) or not self.spec_factor > 0:
            raise ConfigError(f"suffix: suffix_spec_factor must be a number > 0, got {self.spec_factor!r}")

    def nodes(self, depth: int) -> int:
        """The node budget of a step drafting `depth` levels."""
        return math.ceil(self.num_tree_nodes / self.num_speculative_tokens) * depth


class _Node:
    """A node of the suffix tree. Its edge (from its parent) is src[start:start + length]: src is the token list of
    the request whose window cut it (shared, and growing with a request in flight), or a private copy once that
    request is evicted. count = the windows that end in its subtree (on its edge or below); ends[offset] = the
    windows that end on its edge after `offset` of its tokens."""

    __slots__ = ("children", "count", "ends", "src", "start", "length")

    def __init__(self, src: list[int], start: int, length: int):
        self.children: dict[int, _Node] = {}
        self.count = 0
        self.ends: dict[int, int] = {}
        self.src = src
        self.start = start
        self.length = length


Location = tuple[_Node, int]
"""Where a string ends in the tree: a node and how many tokens of its edge the string takes (1..length; 0 only at
the root)."""


@dataclasses.dataclass
class _Request:
    """One request's tokens in the tree, and, while it is in flight, where its windows that still grow end."""

    tokens: list[int]
    windows: list[tuple[_Node, int, int]]
    """(node, offset, depth) of its windows shorter than max_depth, the longest first."""


class SuffixTree:
    """The windows (the next max_depth tokens, or fewer at the end) from every position of every request it holds,
    path-compressed, each node counting the windows through it. A request in flight is extended token by token:
    the token moves each of its growing windows one step (O(max_depth) per token). A finished request stays until
    evicted, the oldest first, once the finished requests hold more than max_tokens tokens."""

    def __init__(self, max_depth: int, max_tokens: int):
        self.max_depth = max_depth
        self.max_tokens = max_tokens
        self.root = _Node([], 0, 0)
        self.live: dict[str, _Request] = {}
        self.finished: collections.OrderedDict[int, _Request] = collections.OrderedDict()  # oldest first
        self.finished_tokens = 0
        self._ids = itertools.count()

    # -- growing -------------------------------------------------------------------------------------------

    def add(self, key: str, tokens: list[int]) -> None:
        """A request joins with its tokens so far."""
        self.finish(key)  # (a live request of the same key would otherwise never be taken out)
        self.live[key] = _Request([], [])
        self.extend(key, tokens)

    def extend(self, key: str, tokens: list[int]) -> None:
        """A request in flight catches up with its tokens (`tokens` = all of them; those not yet held are added)."""
        request = self.live[key]
        for token in tokens[len(request.tokens):]:
            self._append(request, token)

    def _append(self, request: _Request, token: int) -> None:
        tokens = request.tokens
        end = len(tokens)  # the new token's position
        tokens.append(token)
        grown = []
        for node, offset, depth in request.windows + [(self.root, 0, 0)]:
            node, offset = self._settle(node, offset, tokens, end)
            node, offset = self._step(node, offset, tokens, end)
            if depth + 1 < self.max_depth:
                grown.append((node, offset, depth + 1))
        request.windows = grown

    @staticmethod
    def _settle(node: _Node, offset: int, tokens: list[int], end: int) -> Location:
        """The stored location of a string that ends at tokens[end - 1], made current: when the edge it pointed into
        was split since, the string ends below the upper part (which kept the node), in the child its tokens lead
        to."""
        while offset > node.length:
            offset -= node.length  # the string's last `offset` tokens lie past this node
            node = node.children[tokens[end - offset]]
        return node, offset

    def _step(self, node: _Node, offset: int, tokens: list[int], end: int) -> Location:
        """Move the window that ends at node/offset on by tokens[end]; returns where it ends now."""
        token = tokens[end]
        if offset < node.length:  # inside an edge
            if node.src[node.start + offset] == token:
                return self._move(node, offset, node, offset + 1)
            self._split(node, offset)
            return self._enter(node, offset, self._leaf(node, tokens, end))
        if not node.children and node.src is tokens and node.start + node.length == end and node is not self.root:
            node.length += 1  # the window's own leaf: the edge grows with it
            return self._move(node, offset, node, offset + 1)
        child = node.children.get(token) or self._leaf(node, tokens, end)
        return self._enter(node, offset, child)

    def _move(self, node: _Node, offset: int, to: _Node, to_offset: int) -> Location:
        """A window's end moves from node/offset to to/to_offset."""
        if node is not self.root:
            left = node.ends[offset] - 1
            if left:
                node.ends[offset] = left
            else:
                del node.ends[offset]
        to.ends[to_offset] = to.ends.get(to_offset, 0) + 1
        return to, to_offset

    def _enter(self, node: _Node, offset: int, child: _Node) -> Location:
        child.count += 1
        return self._move(node, offset, child, 1)

    @staticmethod
    def _leaf(parent: _Node, tokens: list[int], end: int) -> _Node:
        leaf = parent.children[tokens[end]] = _Node(tokens, end, 1)
        return leaf

    @staticmethod
    def _split(node: _Node, offset: int) -> None:
        """Cut node's edge after `offset` tokens. `node` keeps the upper part, so that stored locations in it stay
        right (and _settle mends those below); the lower part, a new child, takes the old children and the windows
        that end past the cut."""
        lower = _Node(node.src, node.start + offset, node.length - offset)
        lower.children, node.children = node.children, {node.src[node.start + offset]: lower}
        lower.ends = {at - offset: n for at, n in node.ends.items() if at > offset}
        node.ends = {at: n for at, n in node.ends.items() if at <= offset}
        lower.count = node.count - sum(node.ends.values())
        node.length = offset

    # -- forgetting ----------------------------------------------------------------------------------------

    def finish(self, key: str) -> None:
        """A request leaves: its tokens stay (for later requests to match) until evicted."""
        request = self.live.pop(key, None)
        if request is None:
            return
        request.windows = []
        self.finished[next(self._ids)] = request
        self.finished_tokens += len(request.tokens)
        self.evict()

    def evict(self, keep: int | None = None) -> None:
        """Forget the oldest finished requests until those left hold at most `keep` (default max_tokens) tokens."""
        keep = self.max_tokens if keep is None else keep
        while self.finished_tokens > keep and self.finished:
            _, request = self.finished.popitem(last=False)
            self.finished_tokens -= len(request.tokens)
            self._remove(request.tokens)

    def _remove(self, tokens: list[int]) -> None:
        """Take every window of a finished request out: counts go down along it, nodes no window ends under any more
        are dropped, a leaf is cut back to the deepest window left on it, and the edges that other windows still use
        get a copy of their tokens (so that the request's list can be freed)."""
        n = len(tokens)
        for start in range(n):
            node, position, left = self.root, start, min(self.max_depth, n - start)
            while left > 0:
                child = node.children[tokens[position]]
                child.count -= 1
                if child.count == 0:
                    del node.children[tokens[position]]
                    if not node.children and node is not self.root:
                        node.length = max(node.ends)  # a leaf now
                    break
                taken = min(child.length, left)
                position += taken
                left -= taken
                if left == 0:  # the window ends here
                    remaining = child.ends[taken] - 1
                    if remaining:
                        child.ends[taken] = remaining
                    else:
                        del child.ends[taken]
                    if not child.children:
                        child.length = max(child.ends)  # (the window was its deepest)
                if child.src is tokens:
                    child.src = tokens[child.start:child.start + child.length]
                    child.start = 0
                node = child

    @property
    def tokens_held(self) -> int:
        return self.finished_tokens + sum(len(r.tokens) for r in self.live.values())

    # -- reading -------------------------------------------------------------------------------------------

    def locate(self, context: list[int]) -> Location | None:
        """Where `context` ends in the tree (None: no window holds it)."""
        node, offset = self.root, 0
        for token in context:
            if offset < node.length:
                if node.src[node.start + offset] != token:
                    return None
                offset += 1
            else:
                child = node.children.get(token)
                if child is None:
                    return None
                node, offset = child, 1
        return node, offset

    @staticmethod
    def continuations(node: _Node, offset: int) -> list[tuple[int, int, Location]]:
        """(token, windows, where the string goes on) for each token that follows the string ending at node/offset
        in some window: inside an edge the edge's next token, at a node each child."""
        if offset < node.length:
            through = node.count - sum(n for at, n in node.ends.items() if at <= offset)
            return [(node.src[node.start + offset], through, (node, offset + 1))]
        return [(token, child.count, (child, 1)) for token, child in node.children.items()]

    def match(self, key: str, room: int) -> tuple[Location, int] | None:
        """(location, length) of the longest suffix of a request in flight, at most `room` tokens long, that some
        window continues (in another request, or earlier in its own tokens); None when there is none."""
        request = self.live[key]
        tokens = request.tokens
        for node, offset, depth in request.windows:  # the longest first
            if depth > room:
                continue
            node, offset = self._settle(node, offset, tokens, len(tokens))
            if offset < node.length or node.children:
                return (node, offset), depth
        return None


def shares(tree: SuffixTree, location: Location) -> list[tuple[int, float, Location]]:
    """(token, share, where the string goes on) of each continuation of the string ending at `location`: the share
    of the windows through it that go on with that token."""
    options = tree.continuations(*location)
    total = sum(n for _, n, _ in options)
    return [(token, n / total, to) for token, n, to in options if n]


def draft_tree(tree: SuffixTree, location: Location, depth: int, nodes: int,
               min_prob: float) -> tuple[list[int], list[int]]:
    """The most probable continuations of the string ending at `location`, best first (a node's probability is the
    product of the shares along its path, SuffixDecoding's estimate of its acceptance): at most `nodes` nodes and
    `depth` levels, each with probability >= min_prob. Returns (tokens, parents), parents before children."""
    tokens: list[int] = []
    parents: list[int] = []
    order = itertools.count()  # ties: the first pushed (a parent before its children)
    frontier = [(-share, next(order), token, -1, 1, to) for token, share, to in shares(tree, location)
                if share >= min_prob]
    heapq.heapify(frontier)
    while frontier and len(tokens) < nodes:
        neg_prob, _, token, parent, level, where = heapq.heappop(frontier)
        index = len(tokens)
        tokens.append(token)
        parents.append(parent)
        if level < depth:
            for child_token, share, to in shares(tree, where):
                prob = -neg_prob * share
                if prob >= min_prob:
                    heapq.heappush(frontier, (-prob, next(order), child_token, index, level + 1, to))
    return tokens, parents


class SuffixProposer(WithoutDraftCache):
    trees_rewritable = True
    feature_request = NO_FEATURES

    def __init__(self, config: SuffixConfig):
        self.config = config
        self.tree = SuffixTree(config.max_depth, config.max_tokens)

    def add(self, seqs) -> None:
        for seq in seqs:
            self.tree.add(seq.request_id, seq.token_ids)

    def forget_finished(self) -> None:
        """Drop what finished requests wrote (benchmarks that repeat the same prompts call it between runs, so
        that a run is not served the answers of the one before)."""
        self.tree.evict(keep=0)

    def remove(self, seq) -> None:
        self.tree.finish(seq.request_id)

    def observe(self, seqs, trees, results) -> None:
        for seq in seqs:  # the accepted tokens enter the tree as they are emitted
            if seq.request_id in self.tree.live:
                self.tree.extend(seq.request_id, seq.token_ids)

    def propose(self, seqs, budgets: list[int]) -> list[DraftTree]:
        config = self.config
        trees = []
        for seq, budget in zip(seqs, budgets):
            depth = min(budget, config.num_speculative_tokens)
            if depth <= 0 or seq.request_id not in self.tree.live:
                trees.append(DraftTree.empty())
                continue
            self.tree.extend(seq.request_id, seq.token_ids)
            found = self.tree.match(seq.request_id, config.max_depth - depth)
            if found is None:
                trees.append(DraftTree.empty())
                continue
            location, length = found
            depth = min(depth, math.ceil(config.spec_factor * length))
            tokens, parents = draft_tree(self.tree, location, depth, config.nodes(depth), config.min_prob)
            trees.append(DraftTree(torch.tensor(tokens, dtype=torch.long), tuple(parents),
                                   confidence=min(length, MATCH_CLASSES)))
        return trees


def suffix_config(config) -> SuffixConfig:
    """The suffix options of a speculative_config."""
    return SuffixConfig(config.num_speculative_tokens, _tree_nodes(config), config.suffix_max_tokens,
                        config.suffix_max_depth, config.suffix_min_prob, config.suffix_spec_factor)


def _tree_nodes(config) -> int:
    # One node per level by default (not the four of eagle and rest): a repeated text is mostly one chain, a branch
    # is kept only where a second continuation is about as frequent (suffix_min_prob), and on a CPU every verified
    # node costs (docs/bench/suffix/suffix_agentic.py: 1 node per level and min_prob 0.5 beat 2 and 0.1).
    return config.num_tree_nodes or config.num_speculative_tokens


def _build(config, _context) -> SuffixProposer:
    return SuffixProposer(suffix_config(config))


METHOD = Method("suffix", _build, options=("num_tree_nodes", "suffix_max_tokens", "suffix_max_depth",
                                            "suffix_min_prob", "suffix_spec_factor"),
                nodes_per_level=lambda config: math.ceil(_tree_nodes(config) / config.num_speculative_tokens),
                forced_run=FORCED_RUN)
