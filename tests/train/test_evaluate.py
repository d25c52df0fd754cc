import numpy as np
import torch

from specdecode.train import recipe
from specdecode.train.evaluate import acceptance, greedy_continue, heldout_windows
from specdecode.train.lm import init_model


def test_acceptance_is_one_minus_total_variation():
    p_logits, q_logits = torch.randn(3, 7), torch.randn(3, 7)
    p, q = p_logits.softmax(-1), q_logits.softmax(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    assert torch.allclose(acceptance(p_logits, q_logits), 1 - tv, atol=1e-6)
    assert torch.allclose(acceptance(p_logits, p_logits), torch.ones(3))
    disjoint = torch.tensor([[0.0, -1e9], [-1e9, 0.0]])
    assert acceptance(disjoint[:1], disjoint[1:]).item() < 1e-6


def test_cached_greedy_continuation_matches_full_recomputation(tiny_tokenizer):
    torch.manual_seed(0)
    model = init_model(recipe.model_config(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                num_attention_heads=4), tiny_tokenizer, 64), seed=0)
    with torch.no_grad():  # a less uniform model, so that argmax ties cannot hide a bug
        for p in model.parameters():
            p.mul_(20) if p.ndim > 1 else None
    prompts = torch.randint(3, 400, (3, 5))
    out = greedy_continue(model, prompts, 6)
    seq = prompts
    for _ in range(6):
        with torch.no_grad():
            nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(out, seq[:, 5:])


def test_heldout_windows_are_spread_and_contiguous():
    tokens = np.arange(1000, dtype=np.uint16)
    w = heldout_windows(tokens, seq_len=10, max_tokens=50)
    assert w.shape == (5, 11) and w[0, 0] == 0 and w[-1, -1] == 990  # the last whole window
    assert torch.equal(w[:, 1:], w[:, :-1] + 1)
