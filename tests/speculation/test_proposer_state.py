"""What proposers hold and read, checked against brute force at every step of real generation: Medusa's tree nodes
are the right heads' top-ranked guesses, a multi-chain draft model's cache holds the accepted chain's entries, and
EAGLE's first level comes from the head's output at the last committed entry. Greedy exactness cannot catch any of
these (a wrong draft is merely rejected), so each is compared with a from-scratch computation."""
import pytest
import torch

from specdecode.engine.llm import LLM
from specdecode.model.loading import load_model
from specdecode.sampling import SamplingParams
from specdecode.speculation.heads import EagleHead, MedusaHeads

from .heads_fixtures import copy_head, load_target, save_speculator

PROMPTS = ["def add(a, b):", "class Point:\n    def __init__(self, x, y):", "for i", "import os\nimport sys\n"]
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True)


def spy(monkeypatch, obj, name, check):
    """Run check(args, result) after every call of obj.name; returns the list of calls seen."""
    real, calls = getattr(obj, name), []

    def wrapper(*args):
        result = real(*args)
        check(*args, result)
        calls.append(args)
        return result

    monkeypatch.setattr(obj, name, wrapper)
    return calls


# -- Medusa ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def medusa_llm(tiny_models, tmp_path_factory):
    """Three random heads that disagree with each other (Medusa's identity init would make them all alike)."""
    target = load_target(tiny_models["target"])
    torch.manual_seed(0)
    heads = MedusaHeads(target, torch.arange(3, target.config.vocab_size), 3)
    with torch.no_grad():
        for block in heads.blocks:
            block.linear.weight.normal_(0, 0.5)
    folder = save_speculator(heads, target, tmp_path_factory.mktemp("medusa") / "heads")
    config = {"method": "medusa", "model": str(folder), "num_speculative_tokens": 3, "num_tree_nodes": 10,
              "adaptive": False}
    return LLM(str(tiny_models["target"]), dtype="float32", speculative_config=config, max_num_seqs=4), target


def test_medusa_nodes_are_their_heads_guesses(medusa_llm, monkeypatch):
    """A node at depth d on path (r_0, ..., r_d) is head d's rank-r_d token for the hidden state at the last
    committed position."""
    llm, target = medusa_llm
    proposer = llm.proposer
    heads = proposer.heads

    def check(seqs, budgets, trees):
        for seq, budget, tree in zip(seqs, budgets, trees):
            if not budget:
                continue
            with torch.no_grad():
                hidden = target(torch.tensor([seq.token_ids[:-1]])).hidden[0, -1]  # [D], normed
                ranked = heads.draft_to_target[heads(hidden[None])[:, 0].argsort(-1, descending=True)]  # [H, Vd]
            paths = proposer.paths_for(budget)  # the best tree of at most nodes_per_level * budget nodes
            assert len(paths) <= proposer.nodes_per_level * budget and max(map(len, paths)) <= budget
            assert tree.tokens.tolist() == [int(ranked[len(p) - 1, p[-1]]) for p in paths]

    calls = spy(monkeypatch, proposer, "propose", check)
    llm.generate(PROMPTS, GREEDY)
    assert len(calls) > 10 and max(len(p) for p in proposer.paths) == 3


# -- draft model with several chains -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_tree_llm(tiny_models):
    config = {"method": "draft_model", "model": str(tiny_models["draft"]), "num_speculative_tokens": 3,
              "num_drafts": 3, "adaptive": False}
    llm = LLM(str(tiny_models["target"]), dtype="float32", speculative_config=config, max_num_seqs=4)
    return llm, load_model(tiny_models["draft"], dtype="float32", device="cpu")


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_draft_cache_holds_the_accepted_chain(draft_tree_llm, params, monkeypatch):
    """After every step, the draft's cache entries of a sequence are those a fresh prefill of its committed tokens
    gives, whichever chain was accepted."""
    llm, draft = draft_tree_llm
    proposer = llm.proposer
    chains = []  # accepted chain of each step that accepted something

    def check(seqs, trees, results, _):
        for seq, tree, result in zip(seqs, trees, results):
            n = proposer.draft_len.get(seq.request_id)
            if n is None:
                continue
            if result.accepted:  # chain c holds nodes c * depth .. (c + 1) * depth - 1
                chains.append(result.accepted[0] // (len(tree) // proposer.config.num_drafts))
            assert n < len(seq.token_ids)
            fresh = draft.make_cache(1, n + 1)
            with torch.no_grad():
                draft(torch.tensor([seq.token_ids[:n]]), cache=fresh, slots=torch.tensor([0]), compute_logits=False)
            for layer, (k, v) in enumerate(zip(fresh.k, fresh.v)):
                held_k, held_v = proposer.cache.row(layer, seq.slot, n)
                torch.testing.assert_close(held_k, k[0, :, :, :n], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(held_v, v[0, :, :n], atol=1e-4, rtol=1e-4)

    spy(monkeypatch, proposer, "observe", check)
    llm.generate(PROMPTS, params)
    assert any(c > 0 for c in chains), "a chain other than the first must be accepted, or this tests nothing"


# -- EAGLE ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eagle_llm(tiny_models, tmp_path_factory):
    """A one-layer target and a head that copies it, so drafts are accepted and several entries arrive per step."""
    from tests.conftest import make_checkpoint

    root = tmp_path_factory.mktemp("eagle_root")
    make_checkpoint(root / "target", tiny_models["tok"], seed=3, layers=1)
    target = load_target(root / "target")
    folder = save_speculator(copy_head(target, torch.arange(3, target.config.vocab_size)), target, root / "copy")
    config = {"method": "eagle", "model": str(folder), "num_speculative_tokens": 3, "eagle_topk": 3,
              "adaptive": False}
    return LLM(str(root / "target"), dtype="float32", speculative_config=config, max_num_seqs=4), target


def test_eagle_first_level_reads_the_last_entry(eagle_llm, monkeypatch):
    """The tree's depth-1 nodes are the best guesses of the head run from scratch over every committed entry
    (token x_{j+1}, target feature f_j): its output at the last one, j = len - 2, whose token is the pending one."""
    llm, target = eagle_llm
    proposer = llm.proposer
    head: EagleHead = proposer.head
    layer = target.config.num_hidden_layers - 1
    checked = []

    def check(seqs, budgets, trees):
        for seq, budget, tree in zip(seqs, budgets, trees):
            if not budget:
                continue
            ids = seq.token_ids
            with torch.no_grad():
                feats = target(torch.tensor([ids[:-1]]), hidden_layers=(layer,)).layer_hidden[layer]  # [1, L-1, D]
                cache = head.decoder.make_cache(1, len(ids))
                _, logits = head(torch.tensor([ids[1:]]), feats, cache=cache, slots=torch.tensor([0]))
            first = tree.depths == 0
            ranked = head.draft_to_target[logits[0, -1].argsort(descending=True)].tolist()
            assert tree.tokens[first].tolist() == ranked[:int(first.sum())]
            checked.append(seq.request_id)

    spy(monkeypatch, proposer, "propose", check)
    llm.generate(PROMPTS, GREEDY)
    assert llm.total_stats.accepted_per_pos[1] > 0, "whole paths must be accepted: entries arrive several at a time"
    assert len(checked) > 10
