"""Fill-in-the-middle prompts (model/fim.py) and LLM.generate(suffix=): the token ids against the model card's format
and llama.cpp's /infill layout, the end tokens, and drafting from the suffix and the other files."""
import dataclasses
import json

import pytest
import torch

from specdecode.engine.llm import LLM
from specdecode.engine.sequence import Sequence
from specdecode.errors import ConfigError
from specdecode.model import fim as fim_module
from specdecode.model.fim import fim_ids, fim_tokens, infill_ids
from specdecode.model.tokenizer import Tokenizer
from specdecode.sampling import SamplingParams
from specdecode.speculation.proposers.ngram import NgramConfig, NgramProposer
from specdecode.speculation.proposers.suffix import SuffixConfig, SuffixProposer
from tests.engine.fim_fixtures import fim_models, qwen_coder  # noqa: F401 (fixtures)

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nfor i in range(10):\n    print(add(i, i))\n"


def test_fim_tokens_are_found_by_name_or_absent(fim_models, tiny_models):
    tok = Tokenizer(fim_models["target"])
    fim = fim_tokens(tok)
    vocab = tok.get_vocab()
    assert (fim.prefix, fim.suffix, fim.middle) == (vocab["<|fim_prefix|>"], vocab["<|fim_suffix|>"],
                                                    vocab["<|fim_middle|>"])
    assert (fim.repo_name, fim.file_sep) == (vocab["<|repo_name|>"], vocab["<|file_sep|>"])
    assert set(fim.stop_ids) == {vocab[n] for n in ("<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")}
    assert fim_tokens(Tokenizer(tiny_models["target"])) is None


def test_fim_ids_are_the_model_cards_format(fim_models):
    tok = Tokenizer(fim_models["target"])
    ids = fim_ids(tok, fim_tokens(tok), PREFIX, SUFFIX)
    assert ids == tok.encode(f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>")
    assert tok.decode(ids, skip_special_tokens=False) == f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"


def test_infill_ids_are_llama_cpps_repo_level_layout(fim_models):
    tok = Tokenizer(fim_models["target"])
    ids = infill_ids(tok, fim_tokens(tok), PREFIX, SUFFIX, typed="return", files=[("util.py", "import os\n"),
                                                                                   ("b.py", "x = 1\n")])
    expected = ("<|repo_name|>myproject\n<|file_sep|>util.py\nimport os\n<|file_sep|>b.py\nx = 1\n"
                f"<|file_sep|>filename\n<|fim_prefix|>{PREFIX}return<|fim_suffix|>{SUFFIX}<|fim_middle|>")
    assert tok.decode(ids, skip_special_tokens=False) == expected
    # Pieces are tokenized apart (as llama.cpp does): the typed text does not merge with the end of the prefix.
    assert ids[ids.index(fim_tokens(tok).prefix) + 1:ids.index(fim_tokens(tok).suffix)] == \
        tok.encode(PREFIX, add_special_tokens=False) + tok.encode("return", add_special_tokens=False)


def test_infill_ids_cut_the_prefix_suffix_and_files_as_llama_cpp(fim_models, monkeypatch):
    tok = Tokenizer(fim_models["target"])
    fim = fim_tokens(tok)
    monkeypatch.setattr(fim_module, "PREFIX_TAKE", 6)
    monkeypatch.setattr(fim_module, "SUFFIX_TAKE", 8)
    prefix_ids, suffix_ids = tok.encode(PREFIX * 3, False), tok.encode(SUFFIX, False)
    ids = infill_ids(tok, fim, PREFIX * 3, SUFFIX, typed="x", files=[("a.py", "import os\n" * 20)], max_tokens=40)
    body = ids[ids.index(fim.prefix):]
    assert body == [fim.prefix, *prefix_ids[-6:], *tok.encode("x", False), fim.suffix, *suffix_ids[:8 - 2 - 1],
                    fim.middle]
    closing = [fim.file_sep, *tok.encode("filename\n", False)]  # <|file_sep|>filename\n closes the files
    assert len(ids) == 40 and ids[len(ids) - len(body) - len(closing):len(ids) - len(body)] == closing
    assert fim.repo_name not in ids  # the files' start went, their end stayed


FILES = [("util.py", "import os\n"), ("b.py", "x = 1\n")]


def test_infill_ids_fit_max_tokens_sacrificing_the_files_then_the_prefix_then_the_suffix(fim_models):
    """At the edges of max_tokens: a prompt that fits exactly is whole; one token over loses the files' first token;
    many small files or one huge one lose their start (the files nearest the edited one stay, whole); a prefix
    longer than the room loses every file and its own start; a suffix longer than the room is all that stays of
    the text, with its start; the special tokens and the typed text stay whatever the limit."""
    tok = Tokenizer(fim_models["target"])
    fim = fim_tokens(tok)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    def infill(prefix=PREFIX, suffix=SUFFIX, files=FILES, max_tokens=None) -> list[int]:
        return infill_ids(tok, fim, prefix, suffix, "return", files, max_tokens=max_tokens)

    whole = infill()
    body = whole[whole.index(fim.prefix):]  # <|fim_prefix|>...<|fim_middle|>: no files
    assert infill(max_tokens=len(whole)) == whole and infill(max_tokens=len(whole) + 100) == whole
    assert infill(max_tokens=len(whole) - 1) == whole[1:] and whole[0] == fim.repo_name
    assert infill(max_tokens=len(body)) == body

    small = [(f"f{i}.py", f"x{i} = {i}\n") for i in range(200)]
    huge = [("huge.py", "value = compute(value)\n" * 3000)]
    for files in (small, huge):
        full = infill(files=files)
        fitted = infill(files=files, max_tokens=len(body) + 60)
        assert len(fitted) == len(body) + 60 and len(full) > 10 * len(fitted)
        assert fitted == full[len(full) - len(fitted):]
    last_file = [fim.file_sep, *encode("f199.py\n"), *encode("x199 = 199\n"), fim.file_sep, *encode("filename\n")]
    assert infill(files=small, max_tokens=len(body) + 60)[-len(body) - len(last_file):-len(body)] == last_file

    typed, prefix_ids, suffix_ids = encode("return"), encode(PREFIX * 200), encode(SUFFIX)
    assert len(prefix_ids) > fim_module.PREFIX_TAKE > 512
    fitted = infill(prefix=PREFIX * 200, max_tokens=500)  # longer than a tiny model's whole context
    kept = 500 - 3 - len(typed) - len(suffix_ids)
    assert fitted == [fim.prefix, *prefix_ids[-kept:], *typed, fim.suffix, *suffix_ids, fim.middle]

    long_suffix = encode(SUFFIX * 100)
    fitted = infill(prefix=PREFIX * 200, suffix=SUFFIX * 100, max_tokens=300)
    assert fitted == [fim.prefix, *typed, fim.suffix, *long_suffix[:300 - 3 - len(typed)], fim.middle]
    assert infill(max_tokens=2) == [fim.prefix, *typed, fim.suffix, fim.middle]  # nothing left to cut


def test_infill_ids_count_a_bos_in_the_limit(fim_models, tmp_path):
    """A tokenizer that adds a BOS (it goes right before <|fim_prefix|>, as in llama.cpp): the limit holds it too."""
    (tmp_path / "tokenizer.json").write_bytes((fim_models["target"] / "tokenizer.json").read_bytes())
    config = json.loads((fim_models["target"] / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    tok = Tokenizer(tmp_path)
    fim = fim_tokens(tok)
    whole = infill_ids(tok, fim, PREFIX, SUFFIX, "return", FILES)
    assert whole[whole.index(tok.bos_token_id) + 1] == fim.prefix
    for limit in (len(whole) - 1, len(whole) - 5):
        assert infill_ids(tok, fim, PREFIX, SUFFIX, "return", FILES, max_tokens=limit) == whole[-limit:]
    fitted = infill_ids(tok, fim, PREFIX * 200, SUFFIX, "return", FILES, max_tokens=300)
    assert len(fitted) == 300 and fitted[:2] == [tok.bos_token_id, fim.prefix]


def test_generate_with_a_suffix_decodes_the_fim_prompt_and_stops_at_its_end_tokens(fim_models):
    llm = LLM(fim_models["target"], dtype="float32")
    fim = fim_tokens(llm.tokenizer)
    params = SamplingParams(temperature=0, max_tokens=24)
    out = llm.generate(PREFIX, params, suffix=SUFFIX)[0]
    ref = llm.generate([fim_ids(llm.tokenizer, fim, PREFIX, SUFFIX)],
                       dataclasses.replace(params, stop_token_ids=list(fim.stop_ids)))[0]
    assert out.prompt == PREFIX and out.prompt_token_ids == fim_ids(llm.tokenizer, fim, PREFIX, SUFFIX)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids and out.outputs[0].text == ref.outputs[0].text
    both = llm.generate([PREFIX, "x = "], params, suffix=[SUFFIX, "\n"])
    assert both[0].outputs[0].token_ids == out.outputs[0].token_ids
    # The middle ends where the model writes one of the format's end tokens, as at its EOS.
    plain = llm.generate([fim_ids(llm.tokenizer, fim, PREFIX, SUFFIX)], params)[0].outputs[0].token_ids
    stop = plain[3]
    cut = llm.generate([fim_ids(llm.tokenizer, fim, PREFIX, SUFFIX)],
                       dataclasses.replace(params, stop_token_ids=[stop]))[0].outputs[0]
    assert cut.token_ids == plain[:plain.index(stop) + 1] and cut.finish_reason == "stop"


def test_generate_refuses_a_suffix_without_fim_tokens(tiny_models, fim_models):
    with pytest.raises(ConfigError, match="fill-in-the-middle.*<\\|fim_prefix\\|>"):
        LLM(tiny_models["target"], dtype="float32").generate("def f():", suffix="\n")
    llm = LLM(fim_models["target"], dtype="float32")
    with pytest.raises(ConfigError, match="one string per prompt"):
        llm.generate(["a", "b"], suffix=["x"])
    with pytest.raises(ConfigError, match="must be text"):
        llm.generate([[5, 6]], suffix="x")
    with pytest.raises(ConfigError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1])


def _sequence(tok, ids):
    return Sequence("r", None, ids, SamplingParams(temperature=0), tok, [1])


def test_prompt_lookup_and_suffix_decoding_draft_from_the_suffix_and_the_other_files(fim_models):
    """The text after the cursor and the other files are prompt tokens: both index them, so a middle that starts
    writing what the suffix (or another file) holds is drafted from there."""
    tok = Tokenizer(fim_models["target"])
    fim = fim_tokens(tok)
    later = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n"
    for ids in (fim_ids(tok, fim, "import os\n", "\n\n" + later),
                infill_ids(tok, fim, "import os\n", "\n", files=[("point.py", later)])):
        typed = tok.encode("class Point:\n    def", add_special_tokens=False)
        seq = _sequence(tok, ids + typed)
        start = [i for i in range(len(ids)) if ids[i:i + len(typed)] == typed][0]
        follows = ids[start + len(typed):start + len(typed) + 4]
        ngram = NgramProposer(NgramConfig(num_speculative_tokens=4))
        ngram.add([seq])
        assert ngram.propose([seq], [4])[0].tokens.tolist() == follows
        suffix = SuffixProposer(SuffixConfig(num_speculative_tokens=4))
        suffix.add([seq])
        tree = suffix.propose([seq], [4])[0]
        assert tree.tokens.tolist()[:len(follows)] == follows and list(tree.parents)[:2] == [-1, 0]


@pytest.mark.slow
def test_qwen_coder_fim_token_ids_are_the_model_cards(qwen_coder):
    """Qwen2.5-Coder's tokenizer: <|fim_prefix|> 151659, <|fim_suffix|> 151661, <|fim_middle|> 151660, <|repo_name|>
    151663, <|file_sep|> 151664 (its tokenizer_config), and the prompts are the model card's strings."""
    tok = Tokenizer(qwen_coder)
    fim = fim_tokens(tok)
    assert (fim.prefix, fim.suffix, fim.middle, fim.repo_name, fim.file_sep) == (151659, 151661, 151660, 151663,
                                                                                 151664)
    assert {151643, 151662, 151663, 151664} <= set(fim.stop_ids)  # <|endoftext|>, <|fim_pad|>, <|repo_name|>, ...
    ids = fim_ids(tok, fim, PREFIX, SUFFIX)
    assert ids == [151659, *tok.encode(PREFIX), 151661, *tok.encode(SUFFIX), 151660]
    assert ids == tok.encode(f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>")
    repo = infill_ids(tok, fim, PREFIX, SUFFIX, files=[("utils.py", "import os\n")])
    assert repo == tok.encode("<|repo_name|>myproject\n<|file_sep|>utils.py\nimport os\n<|file_sep|>filename\n"
                              f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>")


@pytest.mark.slow
def test_qwen_coder_fills_the_middle_and_speculation_keeps_it(qwen_coder):
    prefix = "def fibonacci(n):\n    "
    suffix = "\n\nprint(fibonacci(10))\n"
    params = SamplingParams(temperature=0, max_tokens=48)
    torch.set_num_threads(1)
    plain = LLM(qwen_coder, max_num_seqs=1, max_model_len=1024).generate(prefix, params, suffix=suffix)[0].outputs[0]
    assert plain.finish_reason == "stop" and "fibonacci(n - 1)" in plain.text.replace("n-1", "n - 1")
    assert "print(fibonacci(10))" not in plain.text  # it wrote the middle, not the suffix again
    lookup = LLM(qwen_coder, max_num_seqs=1, max_model_len=1024,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert lookup.generate(prefix, params, suffix=suffix)[0].outputs[0].token_ids == plain.token_ids
