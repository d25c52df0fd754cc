"""Tensor parallelism over 2 CPU processes (gloo): the sharded target's logits equal the whole model's, greedy
output is identical for plain decoding, a draft model and an EAGLE head, and sizes that do not divide the heads
are refused with the sizes that do."""

import pytest
import torch

from specdecode.parallel.launch import launch_tensor_parallel
from specdecode.parallel.tp import check_divisible, valid_sizes
from specdecode.engine.llm import LLM
from specdecode.errors import ConfigError
from specdecode.model.config import ModelConfig
from specdecode.model.loading import load_model, read_config
from specdecode.sampling import SamplingParams

from tests.speculation.heads_fixtures import copy_head, load_target, save_speculator

PROMPTS = ["def add(a, b):", "class Point:\n    def __init__(self, x, y):", "for i in", "x"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

def assert_logits_match(want: torch.Tensor, got: torch.Tensor) -> None:
    """Within 1e-5 of the logits' scale: the row-parallel sums add the same products in another order."""
    scale = want.abs().max().item()
    assert (want - got).abs().max().item() <= 1e-5 * scale, (want - got).abs().max().item()

@pytest.mark.slow
@torch.inference_mode()
def test_sharded_logits_equal_the_whole_model(tiny_models):
    whole = load_model(tiny_models["target"], dtype="float32", device="cpu")
    sharded = launch_tensor_parallel(tiny_models["target"], 2, dtype="float32", device="cpu")
    try:
        assert sharded.local.model.layers[0].self_attn.num_heads == 2  # 4 query heads over 2 ranks
        ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(0))
        assert_logits_match(whole(ids).logits, sharded(ids).logits)  # no cache
        caches = whole.make_cache(2, 32), sharded.make_cache(2, 32)
        assert caches[1].k[0].shape[1] == 1, "each rank caches its own KV head"
        outs = [model(ids, cache=cache).logits for model, cache in zip((whole, sharded), caches)]
        assert_logits_match(*outs)
        for cache in caches:
            cache.advance(torch.arange(2), 9)
        # A verify step: a 3-node tree after the cached prefix, then a commit that moves entries.
        tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(2, 3, 3)
        positions = torch.tensor([9, 10, 10]).expand(2, 3)
        step = torch.randint(0, 200, (2, 3), generator=torch.Generator().manual_seed(1))
        outs = [m(step, positions=positions, cache=c, tree_mask=tree).logits for m, c in zip((whole, sharded), caches)]
        assert_logits_match(*outs)
        for cache in caches:
            cache.commit(torch.arange(2), torch.tensor([[0, 2], [0, 1]]), torch.tensor([2, 2]))
        outs = [m(step[:, :1], cache=c).logits for m, c in zip((whole, sharded), caches)]
        assert_logits_match(*outs)
        assert not torch.equal(outs[0], whole(step[:, :1], cache=whole.make_cache(2, 32)).logits), \
            "the step must depend on the committed cache"
    finally:
        sharded.runtime.close()
    assert all(p.poll() is not None for p in sharded.runtime.processes), "close() stops the workers"

@pytest.fixture(scope="module")
def eagle_dir(tiny_models, tmp_path_factory):
    """A one-layer target and an EAGLE head that copies it (drafts are accepted, so the tree paths are used)."""
    from tests.conftest import make_checkpoint

    root = tmp_path_factory.mktemp("tp_eagle")
    make_checkpoint(root / "target", tiny_models["tok"], seed=3, layers=1)
    target = load_target(root / "target")
    save_speculator(copy_head(target, torch.arange(target.config.vocab_size)), target, root / "copy")
    return root

@pytest.mark.slow
@pytest.mark.parametrize("method", ["plain", "draft_model", "eagle"])
def test_greedy_output_is_identical(tiny_models, eagle_dir, method):
    target, config = str(tiny_models["target"]), None
    if method == "draft_model":
        config = {"method": "draft_model", "model": str(tiny_models["draft"]), "num_speculative_tokens": 3,
                  "adaptive": False}
    elif method == "eagle":
        target = str(eagle_dir / "target")
        config = {"method": "eagle", "model": str(eagle_dir / "copy"), "num_speculative_tokens": 3, "eagle_topk": 2,
                  "adaptive": False}
    want = LLM(target, dtype="float32", max_num_seqs=4).generate(PROMPTS, GREEDY)
    llm = LLM(target, dtype="float32", speculative_config=config, max_num_seqs=4, tensor_parallel_size=2)
    try:
        got = llm.generate(PROMPTS, GREEDY)
    finally:
        llm.close()
    for prompt, w, g in zip(PROMPTS, want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, prompt
    if config is not None:
        assert 0 < llm.total_stats.accepted_tokens < llm.total_stats.draft_tokens

def test_sizes_that_do_not_divide_the_heads_are_refused(tiny_models):
    smollm2_shape = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                num_attention_heads=9, num_key_value_heads=3)
    assert valid_sizes(smollm2_shape) == [1, 3]
    with pytest.raises(ConfigError, match=r"does not divide the model's 9 query heads and 3 KV heads.*work.*1, 3"):
        check_divisible(smollm2_shape, 2)
    check_divisible(smollm2_shape, 3)
    assert valid_sizes(read_config(tiny_models["target"])) == [1, 2]
    with pytest.raises(ConfigError, match="tensor_parallel_size=4 does not divide.*2 KV heads"):
        LLM(str(tiny_models["target"]), dtype="float32", tensor_parallel_size=4)  # refused before any process starts
    with pytest.raises(ConfigError, match="draft_tensor_parallel_size=2"):
        LLM(str(tiny_models["target"]), dtype="float32", tensor_parallel_size=2, draft_tensor_parallel_size=2)


@pytest.mark.slow
def test_generate_command_takes_the_flag(tiny_models, capsys):
    from specdecode.cli import main

    texts = []
    for size in ("1", "2"):
        argv = ["generate", "def add(a, b):", "--model", str(tiny_models["target"]), "--max-tokens", "8",
                "--dtype", "float32", "--tensor-parallel-size", size]
        assert main(argv) == 0
        texts.append(capsys.readouterr().out.strip().splitlines()[:-1])  # the speed line differs
    assert texts[0] == texts[1] and texts[0]


def test_a_dead_worker_is_an_error_not_a_hang(tiny_models):
    import threading

    sharded = launch_tensor_parallel(tiny_models["target"], 2, dtype="float32", device="cpu")
    worker = sharded.runtime.processes[0]
    worker.kill()
    worker.wait(timeout=10)
    outcome = []

    def forward():
        try:
            with torch.inference_mode():
                sharded(torch.zeros(1, 4, dtype=torch.long))
            outcome.append(None)
        except RuntimeError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=forward, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert outcome and isinstance(outcome[0], RuntimeError), outcome
    sharded.runtime.close()  # after a failure: no hang either
