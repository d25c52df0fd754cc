import json

import numpy as np
import pytest
import torch

from specdecode.model.tokenizer import Tokenizer
from specdecode.train import data, loop
from specdecode.train.distill import kl_to_target, make_distill_loss
from specdecode.train.lm import cross_entropy_loss, init_model, model_config

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
TINIER = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)


@pytest.fixture(scope="module")
def tokens(tiny_corpus, tiny_tokenizer):
    return data.tokenize_documents(data.read_documents(tiny_corpus), Tokenizer(tiny_tokenizer))


def config(tokenizer_dir, shape=TINY):
    return model_config(shape, tokenizer_dir, 64)


def test_pretraining_lowers_the_loss(tokens, tiny_tokenizer, tmp_path):
    cfg = loop.TrainConfig(steps=30, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=3, log_every=5,
                           checkpoint_every=10)
    model = init_model(config(tiny_tokenizer), seed=0)
    summary = loop.train(model, cross_entropy_loss, tokens, cfg, tmp_path)
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [5, 10, 15, 20, 25, 30]
    assert log[-1]["loss"] < log[0]["loss"] - 0.5
    assert summary["step"] == 30 and summary["tokens_seen"] == 30 * 4 * 32
    assert (tmp_path / "checkpoint.pt").is_file()


def test_resume_after_interruption_matches_an_uninterrupted_run(tokens, tiny_tokenizer, tmp_path):
    def cfg(steps):
        # Same schedule; a run "interrupted" after 4 steps has only reached its 4th checkpoint.
        return loop.TrainConfig(steps=steps, batch_size=2, seq_len=16, lr=1e-2, warmup_steps=2, checkpoint_every=2,
                                log_every=2)

    full = init_model(config(tiny_tokenizer), seed=0)
    loop.train(full, cross_entropy_loss, tokens, cfg(8), tmp_path / "full")

    class Interrupt(Exception):
        pass

    calls = 0

    def interrupted_loss(model, batch):
        nonlocal calls
        calls += 1
        if calls == 6:  # dies in step 6, after the checkpoint of step 4
            raise Interrupt
        return cross_entropy_loss(model, batch)

    part = init_model(config(tiny_tokenizer), seed=0)
    with pytest.raises(Interrupt):
        loop.train(part, interrupted_loss, tokens, cfg(8), tmp_path / "part")
    resumed = init_model(config(tiny_tokenizer), seed=123)  # whatever the fresh init, the checkpoint wins
    summary = loop.train(resumed, cross_entropy_loss, tokens, cfg(8), tmp_path / "part", resume=True)
    assert summary["step"] == 8
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    logged = [json.loads(line)["loss"] for line in (tmp_path / "full" / "log.jsonl").read_text().splitlines()]
    logged_resumed = [json.loads(line)["loss"] for line in (tmp_path / "part" / "log.jsonl").read_text().splitlines()]
    assert logged == logged_resumed


def test_resume_refuses_different_settings(tokens, tiny_tokenizer, tmp_path):
    cfg = loop.TrainConfig(steps=2, batch_size=2, seq_len=16, warmup_steps=1, checkpoint_every=1)
    model = init_model(config(tiny_tokenizer), seed=0)
    loop.train(model, cross_entropy_loss, tokens, cfg, tmp_path)
    with pytest.raises(Exception, match="different settings"):
        loop.train(model, cross_entropy_loss, tokens, loop.TrainConfig(steps=3, batch_size=2, seq_len=16,
                                                                       warmup_steps=1), tmp_path, resume=True)


def test_kl_is_zero_for_equal_distributions_and_positive_otherwise():
    logits = torch.randn(5, 11)
    assert kl_to_target(logits, logits).abs() < 1e-6
    assert kl_to_target(logits, torch.randn(5, 11)) > 0.01


def test_distillation_brings_the_draft_closer_to_the_target(tokens, tiny_tokenizer, tmp_path):
    target = init_model(config(tiny_tokenizer), seed=0)
    loop.train(target, cross_entropy_loss, tokens,
               loop.TrainConfig(steps=20, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=2), tmp_path / "t")
    target.zero_grad(set_to_none=True)
    draft = init_model(config(tiny_tokenizer, TINIER), seed=1)
    batch = torch.from_numpy(data.sample_windows(tokens, 8, 32, seed=99, step=0))[:, :-1]

    def kl_now():
        with torch.no_grad():
            p, q = target(batch).logits, draft(batch).logits
        return float(kl_to_target(p.flatten(0, 1), q.flatten(0, 1)))

    before = kl_now()
    loop.train(draft, make_distill_loss(target), tokens,
               loop.TrainConfig(steps=30, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=2, seed=1), tmp_path / "d")
    assert kl_now() < 0.7 * before
    assert all(p.grad is None for p in target.parameters())  # the teacher is frozen
