"""The interface every speculative method implements: a proposer of draft trees."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from specdecode.spec.tree import DraftTree
from specdecode.spec.verify import VerifyResult

if TYPE_CHECKING:
    from specdecode.engine.sequence import Sequence


class Proposer(Protocol):
    """Proposes a draft tree per sequence; keeps its own state (caches, indices) and never touches the target's."""

    def add(self, seqs: list["Sequence"]) -> None:
        """Sequences join (their prompts and first tokens are known)."""

    def remove(self, seq: "Sequence") -> None:
        """A sequence leaves; free what the proposer holds for it."""

    def propose(self, seqs: list["Sequence"], budgets: list[int]) -> list[DraftTree]:
        """One tree per sequence with at most budgets[i] levels (0 = no draft: return an empty tree)."""

    def observe(self, seqs: list["Sequence"], trees: list[DraftTree], results: list[VerifyResult]) -> None:
        """The verifier's decisions, after the accepted tokens were appended to each sequence."""
