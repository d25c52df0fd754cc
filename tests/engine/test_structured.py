"""Structured output under speculation: the grammar masks the target at the root and at every tree node, so every
method emits text the grammar accepts, and greedy text is the same with and without speculation."""
import json
import re

import pytest

from specdecode.speculation.tree import DraftTree

from specdecode.engine.llm import LLM
from specdecode.errors import ConfigError
from specdecode.sampling import SamplingParams

PROMPTS = ["def add(a, b):\n    return", "class Point:\n    def __init__(self"]
SPECS = [None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
         {"method": "draft_model", "num_speculative_tokens": 4, "num_drafts": 2}]


def engines(tiny_models):
    for spec in SPECS:
        if spec and spec["method"] == "draft_model":
            spec = {**spec, "model": str(tiny_models["draft"])}
        yield spec, LLM(str(tiny_models["target"]), dtype="float32", max_num_seqs=2,
                        speculative_config=spec and {**spec, "adaptive": False})


@pytest.mark.parametrize("structured,check", [
    ({"regex": r"[a-c]{3}-[0-9]{2,4}"}, lambda t: re.fullmatch(r"[a-c]{3}-[0-9]{2,4}", t)),
    ({"choice": ["alpha", "beta", "gamma delta"]}, lambda t: t in ("alpha", "beta", "gamma delta")),
    ({"json_schema": {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
                      "required": ["n", "ok"], "additionalProperties": False}},
     lambda t: set(json.loads(t)) == {"n", "ok"}),
])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_method_follows_the_grammar(tiny_models, structured, check, temperature):
    params = SamplingParams(temperature=temperature, max_tokens=48, seed=4, structured=structured)
    texts = {}
    for spec, llm in engines(tiny_models):
        outs = llm.generate(PROMPTS, params)
        for out in outs:
            assert out.outputs[0].finish_reason == "stop", out.outputs[0]  # the grammar completed
            assert check(out.outputs[0].text), out.outputs[0].text
        texts[str(spec)] = [o.outputs[0].text for o in outs]
    if temperature == 0:  # greedy: the same text with every method
        assert len(set(map(tuple, texts.values()))) == 1, texts


def test_bad_specs_are_refused(tiny_models):
    for bad in ({"regex": ""}, {"json_schema": 3}, {"choice": []}, {"xml": "a"}, {"regex": "a", "choice": ["b"]}):
        with pytest.raises(ConfigError, match="structured"):
            SamplingParams(structured=bad)
    llm = LLM(str(tiny_models["target"]), dtype="float32", max_num_seqs=1)
    with pytest.raises(ConfigError, match="structured output"):
        llm.generate("x", SamplingParams(structured={"grammar": "start: ???"}))


def test_forced_tokens_are_drafted_and_forbidden_drafts_pruned(tiny_models, monkeypatch):
    """With prompt lookup, a schema's forced keys are drafted for free and accepted; the text stays plain's."""
    schema = {"type": "object", "properties": {"first_long_key": {"type": "integer"},
                                               "second_long_key": {"type": "boolean"}},
              "required": ["first_long_key", "second_long_key"], "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=48, structured={"json_schema": schema})
    plain = LLM(str(tiny_models["target"]), dtype="float32", max_num_seqs=2).generate(PROMPTS, params)
    llm = LLM(str(tiny_models["target"]), dtype="float32", max_num_seqs=2,
              speculative_config={"method": "ngram", "num_speculative_tokens": 6, "adaptive": False})
    spec = llm.generate(PROMPTS, params)
    assert [o.outputs[0].text for o in spec] == [o.outputs[0].text for o in plain]
    stats = llm.total_stats
    assert stats.accepted_tokens >= 6 and stats.emitted_tokens / stats.steps > 1.5, stats
    # a tree of drafts the grammar forbids is pruned to nothing before the target pass (a proposer that cannot
    # guess after a forced run, as REST: its own tree is pruned)
    from specdecode.speculation.proposers.ngram import NgramProposer
    from specdecode.speculation.tree import DraftTree
    import torch

    seq = llm.make_sequence(PROMPTS[0], SamplingParams(temperature=0, structured={"regex": "[0-9]+"}))
    digits = llm.tokenizer.encode("7")
    tree = DraftTree(tokens=torch.tensor([digits[-1], 5, 6]), parents=(-1, -1, 0))
    monkeypatch.setattr(NgramProposer, "draft_after", None)
    pruned = llm.runner._grammar_tree(seq, tree, 6)
    assert pruned.tokens.tolist() == [digits[-1]] and pruned.parents == (-1,)


def test_prompt_lookup_goes_on_after_a_forced_run(tiny_models):
    """After the tokens a grammar forces, prompt lookup guesses what follows them in the prompt (a value copied
    from it), cut where the grammar forbids it; then what the grammar forces after the guess."""
    llm = LLM(str(tiny_models["target"]), dtype="float32", max_num_seqs=1,
              speculative_config={"method": "ngram", "num_speculative_tokens": 16, "adaptive": False})
    params = SamplingParams(temperature=0, max_tokens=32, structured={"regex": r"name: [a-z]+;ok"})
    probe = llm.make_sequence("x", params)
    forced = probe.grammar.forced()
    assert llm.tokenizer.decode(forced) == "name: "
    value = llm.tokenizer.encode("bob", add_special_tokens=False)
    rest = llm.tokenizer.encode(";more text", add_special_tokens=False)
    seq = llm.make_sequence(llm.tokenizer.encode("x y ", add_special_tokens=False) + forced + value + rest, params)
    llm.runner.proposer.add([seq])
    llm.runner.ensure_capacity(1, 256, 16)  # (what generate() does first)
    tree = llm.runner._grammar_tree(seq, DraftTree.empty(), 16)
    text = llm.tokenizer.decode(tree.tokens.tolist())
    assert tree.parents == tuple(range(-1, len(tree) - 1))  # one chain
    # the forced run, the value looked up after it, then ';' (cut where the prompt goes on with 'more'), 'ok' forced
    assert text.startswith("name: bob;") and "more" not in text, text
    assert llm.runner._grammar_tree(seq, DraftTree.empty(), 0).tokens.tolist() == forced  # no budget: forced only
