"""The shipped non-ShareGPT workload (bench/workloads/specbench_like.json): Spec-Bench's six task categories, eight
well-formed prompts each, every one short enough for the benchmark's SmolLM2 context."""
from pathlib import Path

import pytest

import specdecode.bench
from specdecode.bench.bench import BenchConfig, load_prompts
from specdecode.bench.categories import load_workload_file

PATH = Path(specdecode.bench.__file__).parent / "workloads" / "specbench_like.json"
CATEGORIES = ("multi_turn", "translation", "summarisation", "qa", "math", "rag")
MAX_PROMPT_TOKENS = 450
MAX_PROMPT_CHARS = 1800
"""Characters of a rendered prompt's messages: ~4 characters per SmolLM2 token on this English text, so within
MAX_PROMPT_TOKENS with the chat template's own tokens."""


@pytest.fixture(scope="module")
def workloads():
    return load_workload_file(PATH)


def test_six_categories_of_eight_distinct_prompts(workloads):
    assert tuple(workloads) == CATEGORIES
    assert all(len(prompts) == 8 for prompts in workloads.values())
    texts = [p.messages[-1]["content"] for prompts in workloads.values() for p in prompts]
    assert len(set(texts)) == len(texts)
    sources = [p.source for prompts in workloads.values() for p in prompts]
    assert len(set(sources)) == len(sources)


def test_prompts_are_well_formed_chats(workloads):
    for category, prompts in workloads.items():
        for p in prompts:
            roles = [m["role"] for m in p.messages]
            assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"], (p.source, roles)
            assert p.text is None and all(m["content"].strip() for m in p.messages), p.source
            assert sum(len(m["content"]) for m in p.messages) < MAX_PROMPT_CHARS, p.source
            turns = len(roles) // 2
            assert (2 <= turns <= 3) if category == "multi_turn" else turns == 0, (p.source, turns)


def test_categories_hold_their_kind_of_request(workloads):
    last = {c: [p.messages[-1]["content"] for p in ps] for c, ps in workloads.items()}
    assert all(t.startswith("Translate into ") for t in last["translation"])
    assert all(t.startswith("Summari") and len(t.split("\n\n", 1)[1].split()) >= 150 for t in last["summarisation"])
    assert all("step" in t for t in last["math"])
    assert all("Document 2:" in t and "\n\nQuestion: " in t for t in last["rag"])


def test_every_prompt_fits_smollm2s_budget(smollm2):
    """Through bench's own loader with SmolLM2's tokenizer and chat template: nothing is dropped as too long."""
    from specdecode.model.tokenizer import Tokenizer

    config = BenchConfig(model=str(smollm2), workload_file=PATH, methods=("ngram",),
                         max_prompt_tokens=MAX_PROMPT_TOKENS, sweep_batch_sizes=())
    prompts = load_prompts(config, Tokenizer(smollm2))
    assert {c: len(ps) for c, ps in prompts.items()} == dict.fromkeys(CATEGORIES, 8)
