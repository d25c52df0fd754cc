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
