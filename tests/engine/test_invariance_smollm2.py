"""On the real model in its default configuration (quantization and dtype "auto": Q4_1/Q8_0 weights through the
fused kernels where they build), every method gives plain decoding's answer: greedy and seeded sampled (the race),
alone and sharing a batch with other requests. docs/bench/invariance/invariance.py measured the same on 100
held-out prompts x 128 tokens at batch 1, 8 and 32 with adaptive speculation (docs/bench/invariance); here K is
fixed at 3, so that every step drafts. REST drafts from a datastore built here from the plain answers' text, so the
suite fetches no ShareGPT (the README says what it fetches: SmolLM2 only)."""
import pytest

from specdecode.engine.llm import LLM
from specdecode.sampling import SamplingParams
from specdecode.speculation.datastore import build_datastore

QUESTIONS = ["What is the capital of France?", "Write a Python function that reverses a string.",
             "Summarise: the cat sat on the mat because the mat was warm and the sun was out."]
METHODS = ["ngram", "eagle", "medusa", "draft_model", "lookahead", "rest"]
TOKENS = 24


def requests() -> list[SamplingParams]:
    """One greedy request, one at T=1 and one at T=0.7/top-p 0.9, each seeded."""
    return [SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=7, max_tokens=TOKENS, ignore_eos=True),
            SamplingParams(temperature=0.7, top_p=0.9, seed=8, max_tokens=TOKENS, ignore_eos=True)]


def answers(llm: LLM, together: bool) -> list[list[int]]:
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    if together:
        outs = llm.generate(prompts, requests())
    else:
        outs = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, requests())]
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(smollm2):
    llm = LLM("smollm2-135m-instruct", max_num_seqs=4, max_model_len=256, speculative_config=None)
    return llm, answers(llm, together=False)


@pytest.fixture(scope="module")
def small_datastore(plain, tmp_path_factory):
    """A REST datastore of the plain answers' text: greedy drafts are all accepted, sampled ones partly."""
    llm, alone = plain
    folder = tmp_path_factory.mktemp("rest") / "answers"
    build_datastore([llm.tokenizer.decode(ids) for ids in alone], llm.tokenizer, folder, "plain answers",
                    progress=False)
    return folder


def test_plain_answers_do_not_depend_on_the_batch(plain):
    llm, alone = plain
    assert answers(llm, together=True) == alone


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_every_method_gives_plain_answers_alone_and_in_a_batch(smollm2, plain, method, request):
    reference_llm, reference = plain
    config = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "rest":  # not the ShareGPT datastore built on first use: the suite downloads SmolLM2 only
        config["model"] = str(request.getfixturevalue("small_datastore"))
    llm = LLM("smollm2-135m-instruct", max_num_seqs=4, max_model_len=256,  # by name: its shipped speculators
              speculative_config=config)
    assert llm.quantization == reference_llm.quantization and llm.target.dtype == reference_llm.target.dtype
    assert answers(llm, together=False) == reference
    assert answers(llm, together=True) == reference
    stats = llm.total_stats
    assert stats.draft_tokens > 0, "the method must have drafted, or this compares plain with plain"
