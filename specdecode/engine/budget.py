"""How many draft tokens each running sequence verifies in the next step."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdecode.engine.sequence import Sequence
    from specdecode.speculation.config import SpeculativeConfig
    from specdecode.speculation.control import SpecController


class DraftBudget:
    """The speculation controller's choice of K (the fixed K without one), capped per sequence by what it has left,
    and nothing at all once disable_by_batch_size sequences run."""

    def __init__(self, config: "SpeculativeConfig | None", max_model_len: int,
                 controller: "SpecController | None" = None):
        """config: None = plain decoding (every budget is 0)."""
        self.config = config
        self.max_model_len = max_model_len
        self.controller = controller

    def for_sequence(self, seq: "Sequence", k: int | None = None) -> int:
        """Draft tokens to verify for seq this step (k, default the fixed K), leaving room for the bonus token."""
        if self.config is None or not seq.params.use_speculation:
            return 0
        k = self.config.num_speculative_tokens if k is None else k
        left = min(seq.params.max_tokens - seq.num_generated, self.max_model_len - len(seq.token_ids))
        return max(0, min(k, left - 1))

    def for_step(self, seqs: list["Sequence"]) -> list[int]:
        """Draft tokens per sequence for one step."""
        config = self.config
        if config is None or (config.disable_by_batch_size is not None and len(seqs) >= config.disable_by_batch_size):
            return [0] * len(seqs)
        if self.controller is None:
            return [self.for_sequence(s, config.num_speculative_tokens) for s in seqs]
        k = self.controller.choose(seqs)
        return [self.for_sequence(s, min(k, cap)) for s, cap in zip(seqs, self.controller.caps(seqs))]
