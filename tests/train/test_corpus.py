"""The self-distilled corpus: the same command makes the same tokens at any batch size, and a stopped run resumes
at the first missing shard with the tokens it would have made."""
import json

import numpy as np
import pytest

from specdecode.errors import ConfigError
from specdecode.train import corpus


@pytest.fixture
def conversations(tmp_path):
    path = tmp_path / "conversations.jsonl"
    with open(path, "w") as f:
        for i in range(7):
            f.write(json.dumps({"id": f"c{i}", "messages": [
                {"role": "user", "content": f"def f{i}(x):"}, {"role": "assistant", "content": "return x"},
                {"role": "user", "content": f"class A{i}:"}, {"role": "assistant", "content": "pass"}]}) + "\n")
    return path


def tokens_of(out):
    answers = {}
    for path in sorted(out.glob("shard-*.npz")):
        index, shard = corpus.read_shard(path)
        answers.update({int(i): a.tolist() for i, a in zip(index, shard)})
    return answers


def test_batch_invariant_and_resumable(tiny_models, conversations, tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "SHARD_PROMPTS", 3)
    model = str(tiny_models["target"])
    kwargs = dict(max_tokens=12, max_prompt_tokens=200, model=model, data=str(conversations), progress=lambda m: None)
    one = corpus.build(tmp_path / "one", 10**6, batch=1, **kwargs)
    many = corpus.build(tmp_path / "many", 10**6, batch=8, **kwargs)
    assert one["stats"]["prompts"] == one["planned_prompts"] >= 10  # two user turns of each training conversation
    modes = {p.mode for p in corpus.plan_prompts(*_plan_inputs(model, conversations))[0]}
    assert modes == set(corpus.MODES)
    reference = tokens_of(tmp_path / "one")
    assert reference == tokens_of(tmp_path / "many")
    assert sum(map(len, reference.values())) == one["stats"]["answer_tokens"] > 0
    assert one["stats"]["tokens_per_cpu_second"] > 0  # (CPU time: a paused job's shards are not slower)
    # stop after shard 1 was written: remove it and the later ones, then the same command fills them in
    for path in sorted((tmp_path / "many").glob("shard-*.npz"))[1:]:
        path.unlink()
    corpus.build(tmp_path / "many", 10**6, batch=4, **kwargs)
    assert tokens_of(tmp_path / "many") == reference
    with pytest.raises(ConfigError, match="other settings"):
        corpus.build(tmp_path / "many", 10**6, batch=4, **{**kwargs, "max_tokens": 13})


def _plan_inputs(model, conversations):
    from specdecode.catalog import sharegpt
    from specdecode.model.tokenizer import Tokenizer

    train, _ = sharegpt.split(sharegpt.load_conversations(conversations))
    return train, Tokenizer(model), 200


def test_cli_default_prompt_length_is_the_versions(capsys):
    from specdecode.cli.main import main

    main(["train", "corpus", "--help"])  # (main returns argparse's exit status)
    assert f"default: the corpus version's, {corpus.MAX_PROMPT_TOKENS})" in " ".join(capsys.readouterr().out.split())


def _held_out_ids(count):
    from specdecode.catalog import sharegpt

    ids = (f"h{i}" for i in range(10**6))
    return [i for i in ids if sharegpt.is_heldout(i)][:count]


@pytest.mark.slow
def test_trainers_read_a_corpus_and_its_heldout_split(tiny_models, tmp_path, monkeypatch):
    """A corpus is training data: each example is the prompt's ids then the target's answer, with exactly the
    positions whose next token the target generated marked; `--split heldout` answers only held-out
    conversations; `specdecode train eagle --data <corpus>` trains on it and scores on its heldout/ corpus."""
    from specdecode.catalog import sharegpt
    from specdecode.cli.main import main
    from specdecode.model.digest import weights_digest
    from specdecode.model.tokenizer import Tokenizer
    from specdecode.speculation.heads import load_head

    monkeypatch.setattr(corpus, "SHARD_PROMPTS", 4)
    path = tmp_path / "conversations.jsonl"
    with open(path, "w") as f:
        for cid in [f"t{i}" for i in range(6)] + _held_out_ids(2):
            f.write(json.dumps({"id": cid, "messages": [{"role": "user", "content": f"def {cid}(x):"},
                                                        {"role": "assistant", "content": "return x"}]}) + "\n")
    model = str(tiny_models["target"])
    kwargs = dict(max_tokens=10, max_prompt_tokens=200, model=model, data=str(path), progress=lambda m: None)
    out = tmp_path / "corpus"
    assert corpus.build(out, 10**6, batch=4, **kwargs)["stats"]["prompts"] == 6
    assert corpus.build(out / "heldout", 10**6, batch=4, split="heldout", **kwargs)["stats"]["prompts"] == 2
    with pytest.raises(ConfigError, match="other settings"):
        corpus.build(out, 10**6, batch=4, split="heldout", **kwargs)

    tokenizer = Tokenizer(model)
    train, heldout = sharegpt.split(sharegpt.load_conversations(path))
    for folder, conversations in ((out, train), (out / "heldout", heldout)):
        examples, info = corpus.examples(folder, tokenizer, 10**6, seq_len=1024)
        prompts, prompt_ids = corpus.plan_prompts(conversations, tokenizer, 200)
        answers = tokens_of(folder)
        assert len(examples) == info["examples"] == len(prompts)
        for i, example in zip(sorted(answers), examples):
            assert example.ids == prompt_ids[i] + answers[i]
            marked = [example.ids[p + 1] for p, a in enumerate(example.is_answer) if a]
            assert marked == answers[i] and not example.is_answer[-1]

    head = tmp_path / "head"
    args = ["train", "eagle", "--model", model, "--data", str(out), "--out", str(head), "--features",
            str(tmp_path / "features"), "--run-dir", str(tmp_path / "run"), "--steps", "2", "--batch-tokens", "64",
            "--draft-vocab", "32", "--no-bf16", "--threads", "1"]
    assert main(args) == 0
    training = json.loads((head / "training.json").read_text())
    assert training["data"]["corpus"] == str(out) and training["data"]["examples"] == 6
    assert training["heldout_data"]["examples"] == 2
    target = load_target_for(model)
    load_head(head, target, weights_digest(target))
    assert str(out) in (head / "README.md").read_text()
    # the checkpoint holds what was trained, not the target's frozen embedding and output rows the head shares
    import torch

    weights = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["model"]
    assert "fc.weight" in weights and not any(k.startswith(("embed.", "decoder.lm_head.")) for k in weights)
    assert main(args + ["--export-only"]) == 0
    import shutil

    from specdecode.train import speculators

    shutil.rmtree(out / "heldout")
    with pytest.raises(ConfigError, match="no held-out corpus; make it with `specdecode train corpus --split heldout"):
        speculators.resolve_data(str(out))


def load_target_for(model):
    from specdecode.model.loading import load_model

    return load_model(model, dtype="float32", device="cpu")
