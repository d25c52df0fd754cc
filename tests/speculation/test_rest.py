"""REST: the datastore's suffix-array lookups against brute force, the frequency-pruned trie, `specdecode datastore
build`, greedy output identical to plain decoding, and lossless sampling (chi-square, with a negative control)."""
import json
import random
from collections import Counter

import pytest
import torch

import specdecode.speculation.verify as verify_module
from specdecode.cli import main
from specdecode.engine.llm import LLM
from specdecode.errors import ConfigError
from specdecode.model.tokenizer import Tokenizer
from specdecode.sampling import SamplingParams
from specdecode.speculation.datastore import Datastore, write_datastore
from specdecode.speculation.proposers.rest import frequency_tree

from .heads_fixtures import chains_by, chi_square_p, correction_from_p, node_paths, per_tree
from .test_lossless_sampling import BOTH, PARAMS, rejection, PROMPT, make_tiny_vocab_model


class FourTokens:
    """A tokenizer stand-in for datastores of raw token ids over four tokens (3 ends a document)."""

    eos_token_ids = [3]
    vocab_size = 4

    def get_vocab(self):
        return {"a": 0, "b": 1, "c": 2, "</s>": 3}


def occurrences(corpus: list[int], pattern: list[int]) -> list[int]:
    return [i for i in range(len(corpus) - len(pattern) + 1) if corpus[i:i + len(pattern)] == pattern]


def test_lookups_match_brute_force(tmp_path):
    rng = random.Random(0)
    documents = [[rng.randrange(3) for _ in range(rng.randrange(1, 40))] for _ in range(12)]
    write_datastore(documents, FourTokens(), tmp_path / "ds", "random", progress=False)
    store = Datastore(tmp_path / "ds")
    corpus = [t for doc in documents for t in doc + [3]]
    assert store.tokens.tolist() == corpus
    for _ in range(200):
        pattern = [rng.randrange(4) for _ in range(rng.randrange(1, 7))]
        lo, hi = store.find(pattern)
        assert sorted(store.suffix_array[lo:hi].tolist()) == occurrences(corpus, pattern)
        context = [rng.randrange(3) for _ in range(rng.randrange(2, 20))]
        lo, hi, length = store.longest_match(context, longest=8, shortest=2)
        found = [n for n in range(2, min(8, len(context)) + 1) if occurrences(corpus, context[-n:])]
        assert length == max(found, default=0)
        if length:
            want = Counter(tuple(corpus[i + length:i + length + 3]) for i in occurrences(corpus, context[-length:]))
            got = Counter(store.continuations(context, 3, limit=1000, longest=8))
            cut = Counter()  # continuations end after a document's end
            for cont, n in want.items():
                cut[cont[:cont.index(3) + 1] if 3 in cont else cont] += n
            assert got == +Counter({k: v for k, v in cut.items() if k})


def test_continuations_are_spread_over_many_matches(tmp_path):
    documents = [[0, 1, i % 3] for i in range(300)]
    write_datastore(documents, FourTokens(), tmp_path / "ds", "many", progress=False)
    got = Counter(Datastore(tmp_path / "ds").continuations([0, 1], 1, limit=30))
    assert sum(got.values()) == 30 and all(8 <= got[(t,)] <= 12 for t in range(3))


def test_frequency_tree_keeps_the_most_frequent_nodes():
    continuations = [(1, 2, 3)] * 5 + [(1, 2, 4)] * 3 + [(1, 5)] * 2 + [(6, 7)] * 4
    tokens, parents = frequency_tree(continuations, 5)
    assert all(p < i for i, p in enumerate(parents))
    assert node_paths(tokens, parents) == {(1,), (1, 2), (1, 2, 3), (6,), (6, 7)}  # 10, 8, 5, 4, 4 beat (1, 2, 4): 3
    assert tokens[:2] == [1, 2] and frequency_tree([], 4) == ([], [])


@pytest.fixture(scope="module")
def tiny_datastore(tiny_models, tmp_path_factory):
    """A datastore of the tiny target's own greedy answers to a few prompts, built by the command line."""
    root = tmp_path_factory.mktemp("rest")
    llm = LLM(str(tiny_models["target"]), dtype="float32")
    prompts = ["def add(a, b):", "class Point:", "for i in range(10):", "import os"]
    answers = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40))]
    data = root / "answers.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p},
                                                      {"role": "assistant", "content": p + a}]}) + "\n"
                            for p, a in zip(prompts, answers)))
    assert main(["datastore", "build", "--model", str(tiny_models["target"]), "--data", str(data),
                 "--out", str(root / "ds")]) == 0
    return root / "ds"


def test_built_datastore_holds_the_answers(tiny_datastore, tiny_models):
    info = json.loads((tiny_datastore / "datastore.json").read_text())
    assert info["documents"] == 4 and info["source"].startswith("answers of answers.jsonl")
    store = Datastore(tiny_datastore)
    tokenizer = Tokenizer(tiny_models["target"])
    store.check(tokenizer)
    assert tokenizer.decode(store.tokens[:20].tolist()).startswith("def add(a, b):")
    with pytest.raises(ConfigError, match="another tokenizer"):
        store.check(FourTokens())
    assert main(["datastore", "build", "--model", str(tiny_models["target"]), "--out", str(tiny_datastore)]) == 2


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_is_exact_and_drafts_are_accepted(tiny_models, tiny_datastore, batch):
    prompts = ["def add(a, b):", "class Point:", "for i in range(10):", "print("]
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = LLM(str(tiny_models["target"]), dtype="float32").generate(prompts, greedy)
    config = {"method": "rest", "model": str(tiny_datastore), "num_speculative_tokens": 4, "num_tree_nodes": 8,
              "adaptive": False}
    llm = LLM(str(tiny_models["target"]), dtype="float32", speculative_config=config, max_num_seqs=batch)
    for prompt, want, got in zip(prompts, plain, llm.generate(prompts, greedy)):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, prompt
    stats = llm.total_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert len(stats.accepted_per_pos) >= 3


def test_generate_with_a_damaged_datastore_exits_2_with_one_line(tiny_models, tiny_datastore, tmp_path, capsys):
    """Ids past the vocabulary where the prompt's greedy continuation is drafted from: refused at load (this
    drafted them into the embedding, an IndexError traceback)."""
    import shutil

    import numpy as np

    folder = shutil.copytree(tiny_datastore, tmp_path / "ds")
    tokenizer = Tokenizer(tiny_models["target"])
    prompt = tokenizer.encode("def add(a, b):")
    tokens = np.load(folder / "tokens.npy")
    end = int(np.flatnonzero(tokens == tokenizer.eos_token_ids[0])[0])  # the first answer's end
    tokens[len(prompt) + 2:end] = tokenizer.vocab_size
    np.save(folder / "tokens.npy", tokens)
    code = main(["generate", "def add(a, b):", "--model", str(tiny_models["target"]), "--speculative-model",
                 str(folder), "--max-tokens", "16", "--dtype", "float32", "--no-adaptive"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"error: {folder / 'tokens.npy'} holds token id {tokenizer.vocab_size}, outside") and \
        err.count("\n") == 1 and "specdecode datastore build" in err, err


def test_rest_without_a_datastore_says_what_to_pass(tiny_models):
    with pytest.raises(ConfigError, match="specdecode datastore build"):
        LLM(str(tiny_models["target"]), dtype="float32", speculative_config={"method": "rest"})


@pytest.fixture(scope="module")
def vocab8_rest(tmp_path_factory):
    """An 8-token target and a datastore of its own samples after the test prompt."""
    root = tmp_path_factory.mktemp("vocab8_rest")
    target = make_tiny_vocab_model(root / "target", seed=10)
    gen = torch.Generator().manual_seed(0)
    documents = []
    with torch.no_grad():
        for _ in range(40):
            ids = torch.tensor([PROMPT])
            for _ in range(4):
                probs = target(ids).logits[0, -1].softmax(-1)
                ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)[None]], dim=1)
            documents.append(ids[0].tolist())
    tokenizer = Tokenizer(root / "target", [7])
    write_datastore(documents, tokenizer, root / "ds", "samples", progress=False)
    return root


def rest_config(root):
    return {"method": "rest", "model": str(root / "ds"), "num_speculative_tokens": 2, "num_tree_nodes": 4}


@pytest.mark.slow
@pytest.mark.parametrize("params_name", list(BOTH))
def test_sampling_from_rest_trees_matches_the_target(vocab8_rest, params_name, monkeypatch):
    p_value, stats = chi_square_p(vocab8_rest, rest_config(vocab8_rest), BOTH[params_name], monkeypatch)
    assert len(stats.accepted_per_pos) >= 2
    assert p_value > 1e-3


@pytest.mark.slow
def test_negative_control_fails(vocab8_rest, monkeypatch):
    monkeypatch.setattr(verify_module, "verify_trees", per_tree(correction_from_p))
    monkeypatch.setattr(verify_module, "verify_chains", chains_by(correction_from_p))
    p_value, _ = chi_square_p(vocab8_rest, rest_config(vocab8_rest), rejection(PARAMS["t0.7_top_p0.9"]), monkeypatch)
    assert p_value < 1e-6


def test_command_line_flags(tiny_datastore):
    """A datastore directory given alone implies rest; --no-adaptive fixes K (adaptive is the default)."""
    import argparse

    from specdecode.cli.model_flags import add_model_args, speculative_config

    parser = argparse.ArgumentParser()
    add_model_args(parser)
    assert speculative_config(parser.parse_args(["--speculative-model", str(tiny_datastore)])) == {
        "method": "rest", "model": str(tiny_datastore)}
    assert speculative_config(parser.parse_args(["--speculative-method", "lookahead", "--no-adaptive"])) == {
        "method": "lookahead", "adaptive": False}
    assert speculative_config(parser.parse_args(["--no-adaptive"]), {"method": "ngram"}) == {
        "method": "ngram", "adaptive": False}
