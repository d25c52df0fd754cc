"""specdecode's decoder against transformers' reference implementation, on random tiny checkpoints."""
import pytest
import torch

from specdecode.model.loading import load_model
from specdecode.speculation.tree import DraftTree

transformers = pytest.importorskip("transformers")

TOL = 1e-4

ARCHS = {
    "llama": dict(model_type="llama"),
    "llama3_rope_gqa_tied": dict(model_type="llama", tie_word_embeddings=True, num_key_value_heads=2,
                                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                                 rope_theta=500000.0),
    "mistral": dict(model_type="mistral", num_key_value_heads=2, sliding_window=None),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2),
    "qwen3": dict(model_type="qwen3", num_key_value_heads=2, head_dim=16),
}


def make_hf_model(arch: str, tmp_path):
    extra = dict(ARCHS[arch])
    model_type = extra.pop("model_type")
    cfg_cls = transformers.AutoConfig.for_model(model_type).__class__
    cfg = cfg_cls(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256, **{"num_key_value_heads": 4, **extra})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
    with torch.no_grad():  # random norms and biases so that every parameter matters
        for name, p in hf.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path / arch)
    return hf, load_model(tmp_path / arch, dtype="float32", device="cpu")


@pytest.fixture(params=list(ARCHS))
def pair(request, tmp_path):
    return make_hf_model(request.param, tmp_path)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_full_sequence_forward(pair):
    hf, ours = pair
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        out = ours(ids).logits
    assert (out - ref).abs().max() <= TOL


def test_incremental_cached_decoding(pair):
    hf, ours = pair
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(2))
    ref = hf_logits(hf, ids[0].tolist())
    cache = ours.make_cache(1, 64)
    with torch.no_grad():
        first = ours(ids[:, :5], cache=cache).logits
        cache.advance(torch.tensor([0]), 5)
        steps = [first[0]]
        for t in range(5, 16):
            steps.append(ours(ids[:, t:t + 1], cache=cache).logits[0])
            cache.advance(torch.tensor([0]), 1)
    assert (torch.cat(steps) - ref).abs().max() <= TOL


def test_ragged_batch_and_slots(pair):
    hf, ours = pair
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 9, 6)]
    T = max(map(len, prompts))
    cache = ours.make_cache(5, 64)
    slots = torch.tensor([4, 0, 2])  # rows live in arbitrary cache slots
    padded = torch.tensor([p + [0] * (T - len(p)) for p in prompts])
    with torch.no_grad():
        prefill = ours(padded, cache=cache, slots=slots).logits
        cache.advance(slots, torch.tensor([len(p) for p in prompts]))
        nxt = torch.randint(0, 97, (3, 1), generator=g)
        step = ours(nxt, cache=cache, slots=slots).logits
    for row, p in enumerate(prompts):
        ref = hf_logits(hf, p + [int(nxt[row])])
        assert (prefill[row, :len(p)] - ref[:len(p)]).abs().max() <= TOL
        assert (step[row, 0] - ref[-1]).abs().max() <= TOL


def test_tree_masked_forward_matches_paths(pair):
    hf, ours = pair
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, 97, (7,), generator=g).tolist()
    tree = DraftTree(tokens=torch.randint(0, 97, (6,), generator=g), parents=torch.tensor([-1, -1, 0, 0, 2, 1]))
    cache = ours.make_cache(1, 64)
    with torch.no_grad():
        ours(torch.tensor([prefix]), cache=cache)
        cache.advance(torch.tensor([0]), len(prefix))
        out = ours(tree.tokens[None], positions=(len(prefix) + tree.depths)[None], cache=cache,
                   tree_mask=tree.attention_mask[None]).logits[0]
    for node in range(6):
        path = tree.path_to(node)
        ref = hf_logits(hf, prefix + tree.tokens[path].tolist())
        assert (out[node] - ref[-1]).abs().max() <= TOL


def test_commit_then_continue(pair):
    """Commit the accepted path of a tree in each row of a batch, keep decoding, then roll back."""
    hf, ours = pair
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 97, (2, 5), generator=g)
    tree = DraftTree(tokens=torch.zeros(5, dtype=torch.long), parents=(-1, -1, 0, 1, 3))
    fresh = torch.randint(0, 97, (2, 5), generator=g)
    accepted = [[1, 3, 4], [0, 2]]  # one root-to-node path per row
    cache = ours.make_cache(2, 64)
    slots = torch.tensor([0, 1])
    with torch.no_grad():
        ours(prefix, cache=cache)
        cache.advance(slots, 5)
        ours(fresh, positions=(5 + tree.depths).expand(2, 5), cache=cache,
             tree_mask=tree.attention_mask.expand(2, 5, 5))
        cache.commit(slots, torch.tensor([[1, 3, 4], [0, 2, 0]]), torch.tensor([3, 2]))
        assert cache.lengths.tolist() == [8, 7]
        nxt = torch.randint(0, 97, (2, 1), generator=g)
        step = ours(nxt, cache=cache).logits[:, 0]
        cache.rollback(slots, torch.tensor([5, 5]))
        again = ours(nxt, cache=cache).logits[:, 0]
    for row in range(2):
        kept = fresh[row, accepted[row]].tolist()
        ref = hf_logits(hf, prefix[row].tolist() + kept + [int(nxt[row])])
        assert (step[row] - ref[-1]).abs().max() <= TOL
        ref_after_rollback = hf_logits(hf, prefix[row].tolist() + [int(nxt[row])])
        assert (again[row] - ref_after_rollback[-1]).abs().max() <= TOL
