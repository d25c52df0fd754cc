"""Can this draft speculate for this target? Same token-to-id map, same special tokens, same vocabulary size."""
from __future__ import annotations

from specdecode.errors import IncompatibleDraftError
from specdecode.model.config import ModelConfig
from specdecode.model.tokenizer import Tokenizer


def check_compatible(target_tok: Tokenizer, draft_tok: Tokenizer, target_cfg: ModelConfig,
                     draft_cfg: ModelConfig) -> None:
    """Raise IncompatibleDraftError naming the first difference."""
    hint = "; use a draft trained with the target's tokenizer (see `specdecode train distill`)"
    if target_cfg.vocab_size != draft_cfg.vocab_size:
        raise IncompatibleDraftError(f"the draft's vocab_size is {draft_cfg.vocab_size}, the target's is "
                                     f"{target_cfg.vocab_size}{hint}")
    for name, value in target_tok.special_tokens().items():
        if draft_tok.special_tokens()[name] != value:
            raise IncompatibleDraftError(f"special token {name} differs: target {value!r}, draft "
                                         f"{draft_tok.special_tokens()[name]!r}{hint}")
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if target_vocab != draft_vocab:
        for token, index in sorted(target_vocab.items(), key=lambda kv: kv[1]):
            if draft_vocab.get(token) != index:
                raise IncompatibleDraftError(
                    f"token {token!r} has id {index} in the target's vocabulary but "
                    f"{draft_vocab.get(token)} in the draft's{hint}")
        extra = sorted(draft_vocab.keys() - target_vocab.keys())
        raise IncompatibleDraftError(f"the draft's vocabulary has token {extra[0]!r} that the target lacks{hint}")
