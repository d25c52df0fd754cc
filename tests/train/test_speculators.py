"""Speculator training: ShareGPT parsing and split, the feature cache, and the EAGLE training forward against
the inference path it must imitate."""
import json

import pytest
import torch

from specdecode.errors import ConfigError
from specdecode.model.loading import load_model
from specdecode.model.tokenizer import Tokenizer
from specdecode.speculation.heads import EagleHead, HeadConfig, MedusaHeads, load_head, save_head
from specdecode.catalog import sharegpt
from specdecode.model.digest import weights_digest
from specdecode.train import features, speculators
from specdecode.train.heads import HeadLossConfig, eagle_loss, eagle_unroll, medusa_loss

RECORDS = [
    {"id": "a_0", "conversations": [{"from": "human", "value": "def add(a, b):"},
                                    {"from": "gpt", "value": "return a + b"}]},
    {"id": "a_1", "conversations": [{"from": "gpt", "value": "continued"}, {"from": "human", "value": "for i"},
                                    {"from": "gpt", "value": "in range(10):\n    print(i * i)"}]},
    {"id": "b_0", "conversations": [{"from": "human", "value": "only a question"}]},
    {"id": "c_0", "conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "y"}]},
]


def write_truncated(path, records):
    text = json.dumps(records, indent=1)
    path.write_text(text[:-40])  # cut inside the last record, as the wheel's file is
    return path


def test_truncated_sharegpt_keeps_complete_records(tmp_path):
    path = write_truncated(tmp_path / "sg.json", RECORDS + [{"id": "z_0", "conversations": [
        {"from": "human", "value": "lost " * 20}, {"from": "gpt", "value": "lost"}]}])
    convs = sharegpt.load_conversations(path)
    # b_0 has no answer, c_0 an unknown speaker, z_0 is cut off; a_1's leading answer is dropped.
    assert [c.id for c in convs] == ["a_0", "a_1"]
    assert convs[1].messages[0] == {"role": "user", "content": "for i"}
    assert {c.base_id for c in convs} == {"a"}


def test_jsonl_and_errors(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "m", "messages": [{"role": "user", "content": "hi"},
                                                        {"role": "assistant", "content": "hello"}]}) + "\n")
    assert sharegpt.load_conversations(path)[0].messages[1]["content"] == "hello"
    path.write_text("{not json\n")
    with pytest.raises(ConfigError, match="c.jsonl:1"):
        sharegpt.load_conversations(path)
    with pytest.raises(ConfigError, match="does not exist"):
        sharegpt.load_conversations(tmp_path / "missing.json")


def test_split_is_by_conversation_and_stable():
    convs = [sharegpt.Conversation(f"id{i}_{part}", []) for i in range(400) for part in range(2)]
    train, held = sharegpt.split(convs, fraction=0.1)
    assert {c.base_id for c in train}.isdisjoint({c.base_id for c in held})
    assert 10 < len({c.base_id for c in held}) < 80
    assert sharegpt.split(list(reversed(convs)), fraction=0.1)[1][::-1] == held


def test_rendered_tokens_mark_answers(tiny_models):
    tok = Tokenizer(tiny_models["target"])
    conv = sharegpt.Conversation("a_0", [{"role": "user", "content": "def add(a, b):"},
                                         {"role": "assistant", "content": "return a + b"}])
    ids, is_answer = sharegpt.render_tokens(conv, tok, 512)
    whole = tok.apply_chat_template(conv.messages, add_generation_prompt=False)
    assert ids == tok.encode(whole)  # what the engine feeds the target for the same conversation
    answer = tok.decode([i for i, a in zip(ids, is_answer) if a], skip_special_tokens=False)
    assert "return a + b" in answer and "def add" not in answer
    assert sharegpt.render_tokens(conv, tok, 5)[0] == ids[:5]


@pytest.fixture(scope="module")
def cache(tiny_models, tmp_path_factory):
    target = load_model(tiny_models["target"], dtype="float32", device="cpu")
    tok = Tokenizer(tiny_models["target"])
    torch.manual_seed(0)
    examples = [features.Example(ids := tok.encode(text) * 3, [i % 3 != 0 for i in range(len(ids))])
                for text in ("def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
                             "import os\nimport sys\n")]
    folder = tmp_path_factory.mktemp("features")
    features.extract(target, examples, folder, shard_tokens=40, max_batch_tokens=64)
    return target, examples, folder


def test_feature_cache_matches_the_target(cache):
    target, examples, folder = cache
    shards = features.open_cache(folder)
    assert len(shards) >= 2  # shard_tokens=40 splits the three examples
    seqs = [shard.sequence(s) for shard in shards for s in range(len(shard))]
    assert sorted(s["tokens"].tolist() for s in seqs) == sorted(ex.ids for ex in examples)
    seq = seqs[0]
    out = target(seq["tokens"][None], hidden_layers=(target.config.num_hidden_layers - 1,))
    feature = out.layer_hidden[target.config.num_hidden_layers - 1][0]
    torch.testing.assert_close(seq["features"].float(), feature, atol=0.05, rtol=0.02)  # stored in bf16
    probs = torch.softmax(out.logits[0], -1)
    assert torch.equal(seq["topk_ids"][:, 0], probs.argmax(-1))
    torch.testing.assert_close(seq["topk_probs"][:, 0], probs.max(-1).values, atol=2e-3, rtol=2e-3)
    # An interrupted run resumes: shards on disk are kept, a missing one is recomputed.
    before = (folder / "shard-00000" / "features.bin").stat().st_mtime_ns
    import shutil
    shutil.rmtree(folder / "shard-00001")
    features.extract(target, examples, folder, shard_tokens=40, max_batch_tokens=64)
    assert (folder / "shard-00001" / "meta.json").is_file()
    assert (folder / "shard-00000" / "features.bin").stat().st_mtime_ns == before


def test_eagle_unroll_equals_cached_drafting(cache):
    """Unroll step s at index t must compute what the head computes when drafting depth s with its KV cache:
    entries (token_{j+1}, feature_j) for j <= t, then the drafted entries, each attending to those."""
    target, examples, folder = cache
    shards = features.open_cache(folder)
    batch = features.sample_batch(shards, 1, seed=0, step=0)
    d2t = torch.arange(target.config.vocab_size)
    torch.manual_seed(1)
    head = EagleHead(target, d2t).requires_grad_(False)
    for p in head.decoder.model.layers.parameters():
        p.normal_(0, 0.1)
    t2d = speculators.target_to_draft_map(d2t, target.config.vocab_size)
    batch.is_answer[:] = True
    row, t = 0, 5
    assert batch.tokens.shape[0] == 1
    steps = list(eagle_unroll(head, batch, t2d, HeadLossConfig(unroll=3)))
    n_valid = int(batch.valid[row].sum())
    tokens, feats = batch.tokens[row], batch.features[row].float()

    cache_ = head.decoder.make_cache(1, 64)
    h, logits = head(tokens[1:t + 2][None], feats[:t + 1][None], cache=cache_)
    cache_.advance(torch.tensor([0]), t + 1)
    drafted = [logits[0, -1]]
    feature = h[:, -1:]
    for depth in (2, 3):
        h, logits = head(tokens[t + depth:t + depth + 1][None], feature, cache=cache_)
        cache_.advance(torch.tensor([0]), 1)
        drafted.append(logits[0, -1])
        feature = h
    assert t < n_valid - 3
    for depth, out in enumerate(steps, start=1):
        # One row, every position selected: index t of each step is the t-th selected position.
        torch.testing.assert_close(out.logits[t], drafted[depth - 1], atol=1e-4, rtol=1e-4)


def test_extra_layers_are_cached_and_feed_a_multi_layer_head(cache, tmp_path):
    """EAGLE-3-style features: the cache keeps the extra layers' hidden states; the unrolled training forward of a
    head reading layers (0, last) computes what drafting computes from the target's features; the head round-trips
    through its directory, and a cache without the layers is refused."""
    target, examples, _ = cache
    last = target.config.num_hidden_layers - 1
    folder = tmp_path / "features"
    features.extract(target, examples, folder, shard_tokens=40, max_batch_tokens=64, extra_layers=(0,))
    shards = features.open_cache(folder)
    seq = shards[0].sequence(0)
    with torch.no_grad():
        want = target(seq["tokens"][None], hidden_layers=(0,)).layer_hidden[0][0]
    torch.testing.assert_close(seq["extra"][:, 0].float(), want, atol=0.05, rtol=0.02)  # stored in bf16
    with pytest.raises(ConfigError, match="extra feature layers"):
        features.extract(target, examples, tmp_path / "bad", extra_layers=(last,))

    d2t = torch.arange(target.config.vocab_size)
    torch.manual_seed(1)
    head = EagleHead(target, d2t, (0, last)).requires_grad_(False)
    for p in [*head.decoder.model.layers.parameters(), *head.reduce.parameters()]:
        p.normal_(0, 0.1)
    batch = features.sample_batch(shards, 1, seed=0, step=0)
    batch.is_answer[:] = True
    t = 4
    steps = list(eagle_unroll(head, batch, speculators.target_to_draft_map(d2t, len(d2t)), HeadLossConfig(unroll=2)))
    hidden = batch.layer_features((0, last), last)
    root = head.target_features([h[0, :t + 1] for h in hidden])  # what the proposer makes of the target's pass
    kv = head.decoder.make_cache(1, 64)
    h, logits = head(batch.tokens[0, 1:t + 2][None], root[None], cache=kv)
    kv.advance(torch.tensor([0]), t + 1)
    _, logits2 = head(batch.tokens[0, t + 2:t + 3][None], h[:, -1:], cache=kv)
    torch.testing.assert_close(steps[0].logits[t], logits[0, -1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(steps[1].logits[t], logits2[0, -1], atol=1e-4, rtol=1e-4)

    digest = weights_digest(target)
    save_head(head, HeadConfig("eagle", digest, len(d2t), feature_layers=[0, last]), tmp_path / "head", "card")
    loaded = load_head(tmp_path / "head", target, digest)
    assert loaded.feature_layers == (0, last) and "reduce.weight" in loaded.trainable_state()
    single = features.sample_batch(features.open_cache(cache[2]), 1, seed=0, step=0)
    with pytest.raises(ConfigError, match="lacks layers"):
        single.layer_features((0, last), last)


def test_head_losses_train_and_round_trip(cache, tmp_path):
    target, examples, folder = cache
    shards = features.open_cache(folder)
    d2t = features.draft_vocabulary(shards, 40, always=[1])
    assert 1 in d2t.tolist() and len(d2t) == 40
    t2d = speculators.target_to_draft_map(d2t, target.config.vocab_size)
    target.requires_grad_(False)
    for kind in ("eagle", "medusa"):
        torch.manual_seed(0)
        head = EagleHead(target, d2t) if kind == "eagle" else MedusaHeads(target, d2t, 2)
        params = [p for p in head.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=3e-3)
        losses = []
        for step in range(30):
            batch = features.sample_batch(shards, 64, seed=0, step=step)
            if kind == "eagle":
                loss, _ = eagle_loss(head, batch, t2d, HeadLossConfig(unroll=2), torch.Generator().manual_seed(step))
            else:
                loss, _ = medusa_loss(head, batch, t2d, target.model.norm)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), (kind, losses)
        digest = weights_digest(target)
        save_head(head, HeadConfig(kind, digest, len(d2t), num_heads=2 if kind == "medusa" else 1),
                  tmp_path / kind, "card")
        loaded = load_head(tmp_path / kind, target, digest)
        trained = {k: v.to(torch.bfloat16) for k, v in head.trainable_state().items()}
        for name, value in loaded.trainable_state().items():
            torch.testing.assert_close(value, trained[name].float(), atol=0, rtol=0)
        with pytest.raises(Exception, match="other target weights"):
            load_head(tmp_path / kind, target, "0" * 64)


def distill_steps(draft, shards, steps: int) -> list[float]:
    """`steps` AdamW steps of the draft's distillation loss on the cached features (its trainable weights only)."""
    from specdecode.train.heads import draft_loss

    t2d = torch.arange(draft.config.vocab_size)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(steps):
        loss, _ = draft_loss(draft, features.sample_batch(shards, 64, seed=0, step=step), t2d)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_draft_distillation_learns_and_saves_a_loadable_checkpoint(cache, tiny_models, tmp_path):
    from specdecode.train.head_training import save_draft
    from specdecode.train.heads import draft_from_target

    target, examples, folder = cache
    shards = features.open_cache(folder)
    target.requires_grad_(False)
    torch.manual_seed(0)
    draft = draft_from_target(target, hidden=32, layers=1, intermediate=64)
    assert draft.config.vocab_size == target.config.vocab_size and draft.config.num_hidden_layers == 1
    losses = distill_steps(draft, shards, 40)
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5]), losses
    tok = Tokenizer(tiny_models["target"])
    save_draft(draft, tok, tmp_path / "draft", "card")
    loaded = load_model(tmp_path / "draft", dtype="float32", device="cpu")
    ids = torch.tensor([examples[0].ids])
    torch.testing.assert_close(loaded(ids).logits, draft(ids).logits, atol=0.1, rtol=0.05)  # saved in bf16
    from specdecode.speculation.compat import check_compatible

    check_compatible(tok, Tokenizer(tmp_path / "draft"), target.config, loaded.config)


def test_a_draft_started_from_a_smaller_model_keeps_its_first_layers_and_its_last(cache, tiny_models):
    """--draft-init: the kept layers are the initial model's own (first ones, then its last), renumbered for a cache
    of the new depth; embedding and tied head frozen; distillation on the target's distributions lowers the loss."""
    from specdecode.train.heads import draft_from_model, shallow_layers

    assert shallow_layers(24, 12) == list(range(11)) + [23]
    assert shallow_layers(3, 1) == [2]
    with pytest.raises(ValueError, match="keep 1 to 3"):
        shallow_layers(3, 4)
    _, _, folder = cache
    shards = features.open_cache(folder)
    start = load_model(tiny_models["draft"], dtype="float32", device="cpu")
    original = {i: {k: v.clone() for k, v in layer.state_dict().items()} for i, layer in enumerate(start.model.layers)}
    draft = draft_from_model(load_model(tiny_models["draft"], dtype="float32", device="cpu"), 2)
    assert draft.config.num_hidden_layers == 2 and len(draft.model.layers) == 2
    for new, old in enumerate([0, 2]):
        assert draft.model.layers[new].self_attn.layer_idx == new
        for k, v in draft.model.layers[new].state_dict().items():
            assert torch.equal(v, original[old][k]), (new, k)
    assert not draft.model.embed_tokens.weight.requires_grad and draft.model.layers[0].mlp.down_proj.weight.requires_grad
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    whole = draft(ids).logits
    kv = draft.make_cache(1, 8)  # a cached forward of the new depth gives the training forward's logits
    torch.testing.assert_close(draft(ids, cache=kv).logits, whole, atol=1e-4, rtol=1e-4)
    losses = distill_steps(draft, shards, 30)
    assert sum(losses[-5:]) < 0.9 * sum(losses[:5]), losses


def test_draft_init_is_checked_before_any_slow_work(tiny_models, monkeypatch):
    """A --draft-init with another vocabulary, or fewer layers than asked, is a one-line error naming the flag."""
    import argparse
    import dataclasses

    from specdecode.model import loading
    from specdecode.train.head_training import _draft_init

    args = argparse.Namespace(draft_init=str(tiny_models["draft"]), draft_layers=4, model=tiny_models["target"])
    with pytest.raises(ConfigError, match="--draft-layers 4.*3 decoder layers"):
        _draft_init(args)
    args.draft_layers = 2
    assert _draft_init(args) == tiny_models["draft"]
    read = loading.read_config
    monkeypatch.setattr(loading, "read_config", lambda path: dataclasses.replace(read(path), vocab_size=7)
                        if path == tiny_models["draft"] else read(path))
    with pytest.raises(ConfigError, match="--draft-init .* scores 7 tokens"):
        _draft_init(args)


def test_a_shard_keeps_token_ids_past_65536(tmp_path):
    """Qwen's vocabulary has 151,936 ids: a shard's tokens (and the draft vocabulary counted from its answers) keep
    ids past uint16's range; a shard of small ids stays uint16 (and caches written before read as they were)."""
    import json

    big = [151643, 151644, 3, 70000, 65535]
    small = [1, 2, 3]
    for name, ids in (("big", big), ("small", small), ("edge", [7, 65536])):  # 65,536: the first id past uint16
        n = len(ids)
        top = torch.tensor(ids)[:, None].expand(n, 2)
        outputs = [(torch.zeros(n, 4), top, torch.full((n, 2), 0.5), None)]
        features._write_shard(tmp_path / name, [features.Example(ids, [True] * n)], outputs, hidden=4, top_k=2)
        shard = features.Shard.open(tmp_path / name)
        assert shard.sequence(0)["tokens"].tolist() == ids
        assert json.loads((tmp_path / name / "meta.json").read_text())["token_dtype"] == (
            "uint16" if name == "small" else "int32")
    vocab = features.draft_vocabulary([features.Shard.open(tmp_path / "big")], 3, [151645])
    assert 151645 in vocab.tolist() and vocab.max() == 151645 and len(vocab) == 3
