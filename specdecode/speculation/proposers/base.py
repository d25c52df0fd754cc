"""The interface every speculative method implements: a proposer of draft trees.

Proposers that read the target's hidden states (EAGLE, Medusa) say which ones in `feature_request`; the step loop
asks the target's verifying pass (and the prefill) for them and hands them over in `observe_target`, so a
speculator never costs a second target pass.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import torch

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
    params: "SamplingParams"
    """Its sampling options (drafts at T > 0 sample from the processed draft distribution)."""

    def draft_uniforms(self, depth: int, count: int) -> list[float]:
        """Uniforms for drawing `count` drafts at tree depth `depth` of the next step, tied to output positions."""


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

    def ensure_cache(self, slots: int, max_len: int) -> None:
        """Room for `slots` sequences of up to max_len positions in the caches it keeps (a no-op without any)."""

    def add(self, seqs: list["Sequence"]) -> None:
        """Sequences join (their prompts and first tokens are known)."""

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

    def ensure_cache(self, slots: int, max_len: int) -> None:
        pass
