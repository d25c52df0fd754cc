"""The interface every speculative method implements: a proposer of draft trees.

Proposers that read the target's hidden states (EAGLE, Medusa) say which ones in `feature_request`; the step loop
asks the target's verifying pass (and the prefill) for them and hands them over in `observe_target`, so a
speculator never costs a second target pass.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import torch

from specdecode.sampling import race_gumbel
from specdecode.speculation.tree import DraftTree
from specdecode.speculation.verify import VerifyResult

if TYPE_CHECKING:
    from specdecode.model.llama import ModelOutput
    from specdecode.sampling import SamplingParams


class Sequence(Protocol):
    """What a proposer may read of a request in flight (the engine's Sequence has it; proposers never import the
    engine)."""

    request_id: str
    """Unique among the sequences in flight."""
    token_ids: list[int]
    """Prompt and output so far; the last one is the pending token the next step's tree hangs from."""
    slot: int
    """Its row in the batched caches (the target's and any the proposer keeps per slot)."""
    reused: int
    """Leading tokens whose target keys and values its slot already held from an earlier request (prefix caching):
    the prefill ran only the rest, and a feature reader got features for the rest only."""
    params: "SamplingParams"
    """Its sampling options (drafts at T > 0 sample from the processed draft distribution)."""

    def draft_uniforms(self, depth: int, count: int) -> list[float]:
        """Uniforms for drawing `count` drafts at tree depth `depth` of the next step, tied to output positions."""

    def race_at(self, depth: int) -> tuple[int, int] | None:
        """(key, output position) of the race deciding the token a depth-`depth` draft guesses, or None when the
        request is not raced (sampling.race_gumbel gives that race's noise: drafts that see it guess better)."""


RACE_CANDIDATES = 32
"""A raced row's guesses are ranked among the draft's this many most likely tokens (each plus its race noise)."""


def race_perturbed(scores: torch.Tensor, seqs, depth: int, per_row: int,
                   draft_to_target: torch.Tensor | None = None) -> torch.Tensor:
    """Draft log-probabilities [N, V] (N = len(seqs) * per_row rows, all guessing the token at tree depth `depth`)
    with the race's Gumbel noise added where a request is raced: its top RACE_CANDIDATES tokens get log q + G (G
    the noise the target's own sample at that position will see; token ids mapped through draft_to_target for a
    draft vocabulary) and the rest -inf, renormalised, so the top of a row is the draft's guess at the race's
    winner. Rows of requests that are not raced are returned as they are."""
    races = [s.race_at(depth) for s in seqs]
    rows = [b * per_row + j for b, race in enumerate(races) if race is not None for j in range(per_row)]
    if not rows:
        return scores
    rows_t = torch.tensor(rows, device=scores.device)
    top, ids = scores[rows_t].topk(min(RACE_CANDIDATES, scores.shape[-1]), dim=-1)  # [R, M]
    target_ids = ids if draft_to_target is None else draft_to_target[ids]
    keys = [races[r // per_row][0] for r in rows]
    positions = [races[r // per_row][1] for r in rows]
    noisy = top.double() + race_gumbel(keys, positions, target_ids).to(scores.device)
    noisy = noisy.log_softmax(-1)  # still log-probabilities (<= 0): a tree's path scores only fall with depth
    out = scores.clone()
    out[rows_t] = scores.new_full((len(rows), scores.shape[-1]), float("-inf")).scatter_(1, ids, noisy.to(out.dtype))
    return out


@dataclasses.dataclass(frozen=True)
class FeatureRequest:
    """Which of the target's hidden states a proposer reads."""

    layers: tuple[int, ...] = ()
    """Decoder layers whose outputs (before the final norm) it reads."""
    final: bool = False
    """Whether it reads the normed final hidden state (the output head's input)."""

    @property
    def wanted(self) -> bool:
        return bool(self.layers) or self.final


NO_FEATURES = FeatureRequest()


@dataclasses.dataclass
class TargetFeatures:
    """The target's hidden states at the positions one pass committed to its cache, per sequence: the whole prompt
    after a prefill; the root (the token that was pending) and the accepted path after a step. Row b's position i
    is the hidden state that predicts the token after the i-th committed token, so the last valid one predicted
    the sequence's new pending token."""

    layers: dict[int, torch.Tensor]
    """layer -> [B, A, D] that layer's outputs; row b is valid up to counts[b]."""
    final: torch.Tensor | None
    """[B, A, D] normed final hidden states, or None when not requested."""
    counts: list[int]
    """Valid positions per sequence."""

    @classmethod
    def select(cls, out: "ModelOutput", request: FeatureRequest, counts: list[int],
               rows: torch.Tensor | None = None) -> "TargetFeatures":
        """From a target pass: rows [B, A] picks, per sequence, the positions of the pass that were committed
        (None = the first counts[b] positions, a prefill)."""
        def pick(hidden: torch.Tensor) -> torch.Tensor:  # [B, W, D] -> [B, A, D]
            if rows is None:
                return hidden
            if rows.shape[1] == 1:  # only the root committed (a plain step): position 0 of every row, no gather
                return hidden[:, :1]
            index = rows.to(hidden.device)
            return hidden[torch.arange(hidden.shape[0], device=hidden.device)[:, None], index]

        return cls({i: pick(out.layer_hidden[i]) for i in request.layers},
                   pick(out.hidden) if request.final else None, list(counts))


class Proposer(Protocol):
    """Proposes a draft tree per sequence; keeps its own state (caches, indices) and never touches the target's."""

    feature_request: FeatureRequest
    """The target hidden states it reads (NO_FEATURES for most methods)."""
    draft_network: "torch.nn.Module | None"
    """The network one draft level runs (what the speculation controller times as one draft forward); None for
    methods whose drafting costs no network pass."""
    trees_rewritable: bool
    """Whether the step may prune this proposer's trees or replace them (a structured request's forced tokens)
    before verifying: true where observe() does not read the trees and the drafts are one-hot guesses, so a
    pruned draft the target could never accept changes nothing (ngram, rest)."""

    # Optional, for rewritable proposers that guess chains (ngram):
    #   draft_after(seq, tokens, k) -> list[int]: up to k tokens guessed to follow `tokens` (seq's tokens then a run
    #   it has not emitted, e.g. a grammar's forced tokens), so that a structured request's tree can go on past a
    #   forced run.
    # Optional, for proposers that remember finished requests (suffix):
    #   forget_finished() -> None: drop what finished requests wrote (benchmarks repeating their prompts call it).

    def ensure_cache(self, slots: int, max_len: int, pool_positions: int | None = None) -> None:
        """Room for `slots` sequences of up to max_len positions in the caches it keeps (a no-op without any).
        pool_positions: the target's KV cache is paged with a pool of this many positions (a draft model's cache
        follows: paged, sized alike); None: the slots layout."""

    def cache_shortfall(self, seqs: list["Sequence"], budgets: list[int]) -> int:
        """Blocks its paged cache lacks for a step of these sequences (the scheduler preempts until none); 0 without
        a paged cache."""

    def add(self, seqs: list["Sequence"]) -> None:
        """Sequences join (their prompts and first tokens are known)."""

    def held_prefix(self, slot: int) -> int | None:
        """Only for proposers that read target features: how many leading positions of `slot` its own state still
        holds from the slot's last request (a prefill then reuses at most that many target positions), or None
        when it keeps nothing per position."""

    def remove(self, seq: "Sequence") -> None:
        """A sequence leaves; free what the proposer holds for it (also called for sequences that never joined
        when the proposer reads target features, so it must accept unknown sequences)."""

    def propose(self, seqs: list["Sequence"], budgets: list[int]) -> list[DraftTree]:
        """One tree per sequence with at most budgets[i] levels (0 = no draft: return an empty tree)."""

    def observe(self, seqs: list["Sequence"], trees: list[DraftTree], results: list[VerifyResult]) -> None:
        """The verifier's decisions, after the accepted tokens were appended to each sequence."""

    def observe_target(self, seqs: list["Sequence"], features: TargetFeatures) -> None:
        """Only when feature_request asks for something: the hidden states of every sequence's newly committed
        positions, after each prefill and each step (drafting or not, joined or not), after observe()."""


class WithoutDraftCache:
    """For proposers that run no network to draft and keep no per-slot cache (the two Proposer members they would
    otherwise each spell out)."""

    draft_network = None

    def ensure_cache(self, slots: int, max_len: int, pool_positions: int | None = None) -> None:
        pass

    def cache_shortfall(self, seqs, budgets) -> int:
        return 0
