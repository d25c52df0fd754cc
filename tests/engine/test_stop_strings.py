"""Stop strings and the other stop conditions of a sequence: text shown while streaming is never taken back (the
last len(longest stop) - 1 characters wait until they cannot start a stop string), token_ids end at the token that
completes the stop, and plain decoding, every speculative method, `generate` and `stream` agree, multi-byte
characters included. Expected outputs come from a brute-force oracle over the unstopped token ids."""
import json
import shutil

import pytest

from specdecode.engine.llm import LLM
from specdecode.engine.sequence import Sequence
from specdecode.model.tokenizer import Tokenizer
from specdecode.sampling import SamplingParams

EOS = 1  # the tiny checkpoints' <|eos|>
BIG = 10**6  # a context limit that never binds


def cut_at_stop(tokenizer, ids: list[int], stops: list[str]) -> tuple[list[int], str, str]:
    """The oracle: the shortest prefix of ids whose text contains a stop, the text before the earliest stop in it,
    and the finish reason ("length" when no stop occurs)."""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return ids[:k], text[:min(hits)], "stop"
    return ids, tokenizer.decode(ids), "length"


def feed(seq: Sequence, ids: list[int], runs: tuple[int, ...], max_len: int = BIG) -> list[str]:
    """Append ids in runs of the given lengths (cycled), as accepted runs of speculative steps, until the sequence
    finishes or the ids run out; returns the deltas."""
    deltas, i, r = [], 0, 0
    while i < len(ids) and not seq.finished:
        n = runs[r % len(runs)]
        deltas.append(seq.append(ids[i:i + n], max_len))
        i, r = i + n, r + 1
    return deltas


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return Tokenizer(tiny_models["target"])


def sequence(tokenizer, **params) -> Sequence:
    prompt_ids = tokenizer.encode("x = 1\n")
    return Sequence("r", None, prompt_ids, SamplingParams(**params), tokenizer, [EOS])


# -- one sequence, fed by hand ----------------------------------------------------------------------------------

TEXT = "Hello wörld, 🙃😃😃 and 日本語 cafe\u0301 au lait; done."
STOPS = [["lo w"], ["ö"], ["rld, 🙃"], ["😃😃"], ["日本"], ["本語 c"], ["e\u0301"], ["t; d"], ["zzz", "d, 🙃", "ö"],
         ["never there"]]


@pytest.mark.parametrize("stops", STOPS, ids=lambda s: "|".join(s))
@pytest.mark.parametrize("runs", [(1,), (2,), (3, 1), (5,), (1000,)], ids=lambda r: "runs" + "-".join(map(str, r)))
def test_shown_text_is_never_taken_back(tokenizer, stops, runs):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT) // 2 and any(len(tokenizer.decode([t])) == 0 or "\ufffd" in tokenizer.decode([t])
                                             for t in ids), "multi-byte characters must span tokens here"
    want_ids, want_text, want_reason = cut_at_stop(tokenizer, ids, stops)
    seq = sequence(tokenizer, max_tokens=len(ids), stop=stops)
    shown = ""
    for delta in feed(seq, ids, runs):
        shown += delta
        assert want_text.startswith(shown), f"{shown!r} was shown but the answer is {want_text!r}"
        assert not any(s in shown for s in stops)
    assert shown == seq.text == want_text
    assert seq.output_ids == want_ids  # cut at the token that completed the stop (it stays, as in vLLM)
    assert seq.finish_reason == want_reason


def test_text_waits_only_while_it_could_start_a_stop(tokenizer):
    ids = tokenizer.encode("abcdefgh", add_special_tokens=False)
    free = sequence(tokenizer, max_tokens=len(ids))
    assert "".join(feed(free, ids[:-1], (1,))) == tokenizer.decode(ids[:-1]), "no stop strings: nothing waits"
    held = sequence(tokenizer, max_tokens=len(ids), stop=["xyz"])
    deltas = feed(held, ids, (1,))
    assert "".join(deltas[:-1]) == tokenizer.decode(ids[:-1])[:-2]  # len("xyz") - 1 characters wait
    assert "".join(deltas) == "abcdefgh" and held.finish_reason == "length"  # and come out at the end


def test_eos_inside_a_run_ends_it(tokenizer):
    ids = tokenizer.encode("abc", add_special_tokens=False)
    after = tokenizer.encode("def", add_special_tokens=False)
    seq = sequence(tokenizer, max_tokens=50)
    delta = seq.append(ids + [EOS] + after, BIG)
    assert seq.output_ids == ids + [EOS] and seq.finish_reason == "stop"
    assert delta == seq.text == "abc"


@pytest.mark.parametrize("ending", ["max_tokens", "eos"])
def test_a_stop_completed_by_the_last_token_still_cuts(tokenizer, ending):
    """The token that completes the stop string also ends the request another way (it is the max_tokens-th, or an
    EOS follows in the same run): the stop string is still cut off, and the reason is "stop"."""
    ids = tokenizer.encode("abc def", add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in ids]
    stop = pieces[-2][-1] + pieces[-1]  # spans the last two tokens
    seq = sequence(tokenizer, max_tokens=len(ids) if ending == "max_tokens" else 50, stop=stop)
    deltas = feed(seq, ids + ([EOS] if ending == "eos" else []), (len(ids) - 1, 5))
    assert seq.finish_reason == "stop"
    assert "".join(deltas) == seq.text == "abc def"[:"abc def".find(stop)]
    assert seq.output_ids == ids


def test_max_tokens_and_the_context_cap_a_run(tokenizer):
    ids = tokenizer.encode("abcdefghij", add_special_tokens=False)
    seq = sequence(tokenizer, max_tokens=4, ignore_eos=True)
    feed(seq, ids, (3,))
    assert seq.output_ids == ids[:4] and seq.finish_reason == "length"
    seq = sequence(tokenizer, max_tokens=50)
    max_len = seq.num_prompt + 3
    seq.append(ids, max_len)
    assert len(seq.token_ids) == max_len and seq.output_ids == ids[:3] and seq.finish_reason == "length"


# -- the engine: generate, stream, plain and speculative ----------------------------------------------------------

PROMPTS = ["def add(a, b):", "class Point:\n    def __init__(self, x, y):", "for i", "import os\nimport sys\n"]
LONG = 40


def methods(tiny_models) -> dict:
    return {
        "plain": None,
        "draft_chain": {"method": "draft_model", "model": str(tiny_models["draft"]), "num_speculative_tokens": 4,
                        "adaptive": False},
        "draft_tree": {"method": "draft_model", "model": str(tiny_models["draft"]), "num_speculative_tokens": 3,
                       "num_drafts": 2, "adaptive": False},
        "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "adaptive": False},
    }


@pytest.fixture(scope="module")
def llms(tiny_models):
    return {name: LLM(str(tiny_models["target"]), dtype="float32", speculative_config=config, max_num_seqs=4)
            for name, config in methods(tiny_models).items()}


def spanning_stops(tokenizer, ids: list[int]) -> list[str]:
    """Stop strings from an output's own text whose first occurrence starts in one token's text and ends in a later
    one's: two, three and four characters around token boundaries, the multi-byte characters among them."""
    text = tokenizer.decode(ids)
    bounds = {len(tokenizer.decode(ids[:k])) for k in range(1, len(ids))
              if text.startswith(tokenizer.decode(ids[:k]))}
    stops = []
    for b in sorted(bounds):
        for before, after in ((1, 1), (2, 1), (1, 3)):
            stop = text[b - before:b + after]
            first = text.find(stop)
            if (len(stop) == before + after and "\ufffd" not in stop and stop not in stops
                    and any(first < c < first + len(stop) for c in bounds)):
                stops.append(stop)
    multibyte = [s for s in stops if any(ord(c) > 127 for c in s)]
    return list(dict.fromkeys(stops[::max(1, len(stops) // 6)][:6] + multibyte[:2]))


@pytest.fixture(scope="module")
def cases(llms):
    """(prompt, stop) pairs with the oracle's answer, from the plain greedy outputs."""
    llm = llms["plain"]
    out = []
    for prompt in PROMPTS:
        ids = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True))[0].outputs[0]
        for stop in spanning_stops(llm.tokenizer, ids.token_ids):
            out.append((prompt, stop, cut_at_stop(llm.tokenizer, ids.token_ids, [stop])))
    assert len(out) >= 12 and any(any(ord(c) > 127 for c in stop) for _, stop, _ in out)
    return out


def count_dropped(llm, monkeypatch) -> list[int]:
    """Per appended step: how many of its tokens the sequence dropped (those after the one that ended it)."""
    dropped, real = [], llm.runner._append

    def append(seq, tokens, logprobs=None):
        before = seq.num_generated
        delta = real(seq, tokens, logprobs)
        dropped.append(len(tokens) - (seq.num_generated - before))
        return delta

    monkeypatch.setattr(llm.runner, "_append", append)
    return dropped


@pytest.mark.slow
@pytest.mark.parametrize("method", ["plain", "draft_chain", "draft_tree", "ngram"])
def test_generate_and_stream_agree_with_the_oracle(llms, cases, method, monkeypatch):
    llm = llms[method]
    dropped = count_dropped(llm, monkeypatch)
    for prompt, stop, (want_ids, want_text, want_reason) in cases:
        params = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True, stop=stop)
        out = llm.generate(prompt, params)[0].outputs[0]
        assert (out.text, out.token_ids, out.finish_reason) == (want_text, want_ids, want_reason), stop
        shown = ""
        for delta in llm.stream(prompt, params):
            shown += delta
            assert want_text.startswith(shown), f"stop {stop!r}: {shown!r} was shown, the answer is {want_text!r}"
        assert shown == want_text
        assert llm.last_stats.emitted_tokens == len(want_ids)
    if method.startswith("draft"):
        assert any(dropped), "some stop must land inside an accepted run, with tokens after it"


def test_eos_inside_an_accepted_run_ends_the_output(tiny_models, tmp_path, monkeypatch):
    """A checkpoint whose EOS ids include a token greedy decoding emits mid-output, with a draft close enough to
    the target that the EOS is accepted with drafted tokens after it: the output ends at the EOS."""
    spec = LLM(str(tiny_models["target"]), dtype="float32", speculative_config=methods(tiny_models)["draft_chain"])
    full = spec.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True))[0].outputs[0]
    eos = full.token_ids[9]
    ckpt = shutil.copytree(tiny_models["target"], tmp_path / "ckpt")
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, eos]}))
    llm = LLM(str(ckpt), dtype="float32", speculative_config=methods(tiny_models)["draft_chain"])
    dropped = count_dropped(llm, monkeypatch)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=LONG))[0].outputs[0]
    end = full.token_ids.index(eos) + 1
    assert out.token_ids == full.token_ids[:end] and out.finish_reason == "stop"
    assert out.text == llm.tokenizer.decode(out.token_ids)
    assert any(dropped), "the EOS must come inside an accepted run"


def test_a_stop_mid_run_leaves_the_rest_of_the_batch_exact(llms, cases, monkeypatch):
    """Requests that stop inside an accepted run leave while the others go on (the target and draft caches hold
    the dropped tokens' entries until the slot is reset): the others' outputs, and those of the requests that take
    the freed slots, are what each gets alone."""
    llm = llms["draft_chain"]
    stopped = [(p, s, want) for p, s, want in cases if len(want[0]) < LONG // 2][:3]
    greedy = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True)
    alone = {p: llm.generate(p, greedy)[0].outputs[0].token_ids for p in PROMPTS}
    dropped = count_dropped(llm, monkeypatch)
    prompts = [p for p, _, _ in stopped] + PROMPTS
    params = [SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True, stop=s) for _, s, _ in stopped]
    outputs = llm.generate(prompts, params + [greedy] * len(PROMPTS))  # more requests than slots: slots are reused
    for (_, _, (want_ids, want_text, _)), out in zip(stopped, outputs):
        assert (out.outputs[0].token_ids, out.outputs[0].text) == (want_ids, want_text)
    for prompt, out in zip(PROMPTS, outputs[len(stopped):]):
        assert out.outputs[0].token_ids == alone[prompt]
    assert any(dropped), "a stop must land inside an accepted run"


REAL_CASES = [("1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2,", "5,"),
              ("🙃😃😃🙃😃😃🙃😃😃🙃", "😃😃😃"), ("日本語、日本語、日本語、日本", "、日本"), ("café, café, café, caf", "fe,")]


@pytest.mark.parametrize("method", [None, {"method": "ngram", "num_speculative_tokens": 5, "adaptive": False}],
                         ids=["plain", "ngram"])
@pytest.mark.slow
def test_the_real_model_stops_alike_in_every_mode(smollm2, method):
    """SmolLM2 splits emoji and CJK characters over several tokens, and prompt lookup accepts long runs on these
    repetitive prompts (so a stop string often lies inside one run). The numbers prompt once streamed ' 3, 4, 5'
    and kept 11 tokens with speculation against 9 without."""
    llm = LLM(smollm2, dtype="float32", speculative_config=method, max_num_seqs=1)
    for prompt, stop in REAL_CASES:
        ids = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20))[0].outputs[0].token_ids
        want_ids, want_text, _ = cut_at_stop(llm.tokenizer, ids, [stop])
        params = SamplingParams(temperature=0, max_tokens=20, stop=[stop])
        out = llm.generate(prompt, params)[0].outputs[0]
        assert (out.text, out.token_ids, out.finish_reason) == (want_text, want_ids, "stop"), prompt
        assert "".join(llm.stream(prompt, params)) == want_text
        if stop == "5,":
            assert (want_text, len(want_ids)) == (" 3, 4, ", 9)
    if method is not None:
        assert llm.total_stats.accepted_tokens > 0


# -- budgets: a step never drafts more than the request can keep ---------------------------------------------------


def test_budget_leaves_room_for_the_bonus_token(llms):
    llm = llms["ngram"]
    k = llm.spec_config.num_speculative_tokens
    seq = llm.make_sequence("def add(a, b):", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    seq.append([40], BIG)  # the prefill's token: 4 left
    assert llm.budget(seq, k) == 3  # 3 drafts + the bonus token = the 4 left
    assert llm.budget(seq, 2) == 2
    seq.append([41, 42, 43], BIG)
    assert llm.budget(seq, k) == 0  # one left: the step's own token
    near_end = llm.make_sequence(list(range(3, 3 + llm.max_model_len - 3)),
                                 SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    near_end.append([40], BIG)  # 2 tokens of context left
    assert llm.budget(near_end, k) == 1


def test_steps_draft_exactly_what_fits(llms, monkeypatch):
    llm = llms["draft_chain"]
    seen = []
    real = llm.proposer.propose

    def propose(seqs, budgets):
        seen.extend((s.params.max_tokens - s.num_generated, b) for s, b in zip(seqs, budgets))
        return real(seqs, budgets)

    monkeypatch.setattr(llm.proposer, "propose", propose)
    outputs = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                                     for m in (3, 6, 9, 13)])
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 6, 9, 13]
    assert seen and all(b == min(4, left - 1) for left, b in seen)
