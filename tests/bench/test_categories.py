"""The rules that sort ShareGPT conversations into benchmark categories, and workload files."""
import json

import pytest

from specdecode.bench.categories import classify, first_turn_category, is_math, load_workload_file, select
from specdecode.errors import ConfigError
from specdecode.catalog.sharegpt import Conversation


def conv(id_: str, *turns: str) -> Conversation:
    roles = ["user", "assistant"] * len(turns)
    return Conversation(id_, [{"role": r, "content": t} for r, t in zip(roles, turns)])


LONG_TEXT = "We are a small team building tools for farmers. " * 12


@pytest.mark.parametrize("text, category", [
    ("Translate this into French: good morning", "translation"),
    ("def f(x):\n    return x\nimport os\n", "code"),
    ("How do I sort a list in python?", "code"),
    ("What is 17 * 23?", "math"),
    ("Calculate the area of a circle of radius 3", "math"),
    ("Rewrite the following text for a pitch:\n\n" + LONG_TEXT, "summarisation"),
    ("Why is the sky blue?", "qa"),
    ("Explain quantum computing in simple terms", "qa"),
    ("Write me a poem about autumn leaves falling on a quiet street", None),
    ("rate this sentence on a scale of 1-10", None),  # a range, not arithmetic
    ("¿Qué es una tabla hash y cómo funciona en la práctica? " * 2, None),  # not English (and no rule fits)
])
def test_first_turn_rules(text, category):
    assert first_turn_category(text) == category


def test_math_ignores_ranges_dates_and_years():
    assert not is_math("from 2023 - 2028 the community grew")
    assert not is_math("born 20/21 July") and not is_math("expand chapter 10 to 5-7 scenes")
    assert is_math("what is 2+2?") and is_math("solve 3 = x + 1")


def test_classify_multi_turn_keeps_the_first_answer_in_context():
    prompt = classify(conv("abc_0", "Write a haiku about tea", "Steam rises...", "Now one about coffee",
                           "Dark and bold..."))
    assert prompt.category == "multi_turn"
    assert [m["role"] for m in prompt.messages] == ["user", "assistant", "user"]
    assert prompt.messages[1]["content"] == "Steam rises..." and prompt.reference == "Dark and bold..."


def test_classify_skips_later_parts_and_unmatched_single_turns():
    assert classify(conv("abc_3", "Why is the sky blue?", "Rayleigh.")) is None  # starts mid-conversation
    assert classify(conv("abc_0", "Write a poem about autumn leaves on a street", "Leaves...")) is None
    later_math = classify(conv("m_0", "Hi there friend", "Hello!", "Calculate the derivative of x^x", "..."))
    assert later_math.category == "math" and len(later_math.messages) == 3


def test_select_fills_summarisation_with_constructed_requests_and_respects_fits():
    answer = "A held-out answer that is long enough to be summarised. " * 6
    conversations = [conv(f"q{i}_0", f"Why is thing {i} so?", answer) for i in range(5)]
    chosen = select(conversations, per_category=3, fits=lambda messages: len(messages[-1]["content"]) < 1000,
                    categories=("qa", "summarisation", "translation"))
    assert set(chosen) == {"qa", "summarisation"}  # no translation present: left out
    assert [p.source for p in chosen["qa"]] == ["q0_0", "q1_0", "q2_0"]
    assert [p.source for p in chosen["summarisation"]] == ["q3_0:constructed", "q4_0:constructed"]
    assert answer.strip() in chosen["summarisation"][0].messages[0]["content"]
    assert select(conversations, 3, fits=lambda messages: False) == {}


def test_workload_file(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"categories": {"chat": ["hello", {"messages": [{"role": "user", "content": "hi"}],
                                                                   "reference": "hey"}], "empty": []}}))
    workloads = load_workload_file(path)
    assert list(workloads) == ["chat"] and workloads["chat"][1].reference == "hey"
    assert workloads["chat"][0].messages == [{"role": "user", "content": "hello"}]
    assert len(load_workload_file(path, per_category=1)["chat"]) == 1
    path.write_text("[]")
    with pytest.raises(ConfigError, match="categories"):
        load_workload_file(path)
