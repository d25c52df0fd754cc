"""Capacity plan: its figures agree with what the engine allocates (parameters, packed copies, KV caches) within
10%, a budget sizes the engine's batch, and what cannot fit is refused (by `specdecode plan` with a non-zero
status, by LLM at start-up)."""
import pytest
import torch

from specdecode.cli import main
from specdecode.engine.llm import LLM
from specdecode.errors import ConfigError
from specdecode.plan import GiB, cache_bytes, module_bytes, plan_memory
from specdecode.speculation.heads import EagleHead

from tests.speculation.heads_fixtures import load_target, save_speculator

MiB = 1024 ** 2


def allocated(llm: LLM) -> tuple[int, int]:
    """(weight bytes, KV-cache bytes) the engine holds: target, proposer and their caches."""
    proposer = llm.proposer
    modules = [llm.target] + [m for m in vars(proposer).values() if isinstance(m, torch.nn.Module)] if proposer \
        else [llm.target]
    caches = [llm.runner.cache] + ([proposer.cache] if getattr(proposer, "cache", None) is not None else [])
    return module_bytes(*modules), sum(cache_bytes(c) for c in caches)


@pytest.fixture(scope="module")
def eagle_head(tiny_models, tmp_path_factory):
    target = load_target(tiny_models["target"])
    folder = tmp_path_factory.mktemp("plan") / "eagle"
    return save_speculator(EagleHead(target, torch.arange(3, target.config.vocab_size)), target, folder)


@pytest.mark.parametrize("method", [None, "draft_model", "eagle"])
def test_plan_agrees_with_what_the_engine_allocates(tiny_models, eagle_head, method):
    config = {None: None, "draft_model": {"method": "draft_model", "model": str(tiny_models["draft"]),
                                          "num_speculative_tokens": 3, "adaptive": False},
              "eagle": {"method": "eagle", "model": str(eagle_head), "num_speculative_tokens": 3, "adaptive": False}}
    config = config[method]
    llm = LLM(str(tiny_models["target"]), dtype="float32", device="cpu", speculative_config=config,
              max_num_seqs=4, max_model_len=256, memory_budget=1 * GiB)
    plan = llm.plan
    assert llm.max_num_seqs == 4 and plan.fits
    weights, kv = allocated(llm)
    planned_weights = plan.target.weights + plan.draft.weights
    assert abs(planned_weights - weights) <= 0.1 * weights, (planned_weights, weights)
    assert abs(plan.kv() - kv) <= 0.1 * kv, (plan.kv(), kv)
    if method is not None:
        assert plan.draft.weights > 0 and plan.draft.kv_per_position > 0


def test_a_budget_sizes_the_batch_and_too_small_a_budget_is_refused(tiny_models):
    """Slots layout: the budget caps the sequences (each holds max_model_len). Paged: it sizes the pool, which
    holds far more sequences of the length requests actually have, and any number of rows may share it."""
    plan = plan_memory(tiny_models["target"], 64 * MiB, 256, 1000, dtype="float32", device="cpu")
    largest = plan.largest_batch()
    assert 1 < largest < 1000 and not plan.fits
    assert f"lower --max-num-seqs to {largest}" in plan.refusal()
    llm = LLM(str(tiny_models["target"]), dtype="float32", device="cpu", max_num_seqs=1000, max_model_len=256,
              memory_budget=64 * MiB, block_size=None)
    assert llm.max_num_seqs == largest
    assert llm.runner.cache.num_slots == largest  # allocated at start-up
    paged = plan_memory(tiny_models["target"], 64 * MiB, 256, 1000, dtype="float32", device="cpu", block_size=16)
    assert paged.fits and paged.largest_batch() == 1000
    assert paged.sessions(256) > 1.5 * largest  # activations are one prefill's, not every row's full-length one
    llm = LLM(str(tiny_models["target"]), dtype="float32", device="cpu", max_num_seqs=1000, max_model_len=256,
              memory_budget=64 * MiB)
    assert llm.max_num_seqs == 1000 and llm.runner.cache.paged
    assert llm.runner.cache.num_blocks == paged.num_blocks()
    assert abs(cache_bytes(llm.runner.cache) - paged.kv()) <= 0.1 * paged.kv()
    with pytest.raises(ConfigError, match="not even one sequence fits"):
        LLM(str(tiny_models["target"]), dtype="float32", device="cpu", max_model_len=256, memory_budget=MiB)
    with pytest.raises(ConfigError, match="gpu_memory_utilization applies to CUDA"):
        LLM(str(tiny_models["target"]), dtype="float32", device="cpu", gpu_memory_utilization=0.9)


def test_plan_command(tiny_models, capsys):
    args = ["plan", "--model", str(tiny_models["target"]), "--dtype", "float32", "--device", "cpu",
            "--max-model-len", "256", "--max-num-seqs", "8"]
    assert main(args + ["--device-memory", "1"]) == 0
    out = capsys.readouterr().out
    for row in ("target weights", "KV cache pool (", "blocks of 16, paged)", "activations", "the pool holds",
                "sequences of 256", "up to 8 run at once"):
        assert row in out
    assert main(args + ["--device-memory", "1", "--block-size", "0"]) == 0
    out = capsys.readouterr().out
    for row in ("KV cache (8 x 256 positions)", "largest batch at 256 positions"):
        assert row in out
    assert main(args + ["--device-memory", "0.001"]) == 1
    assert "does not fit" in capsys.readouterr().out
    assert main(args + ["--device-memory", "1", "--tensor-parallel-size", "3"]) == 2  # 2 KV heads: refused
    assert "sizes that work for this model: 1, 2" in capsys.readouterr().err


def test_tensor_parallel_halves_the_sharded_part():
    from specdecode.model.config import ModelConfig
    from specdecode.plan import model_memory

    c = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
    whole, half = model_memory(c, 4, 4, False, 1), model_memory(c, 4, 4, False, 2)
    assert half.kv_per_position * 2 == whole.kv_per_position
    embed = c.vocab_size * c.hidden_size * 2 * 4  # untied: embedding and LM head stay whole on every rank
    assert half.weights - embed < (whole.weights - embed) / 2 + 2 * 1024


def test_plan_counts_a_gguf_as_its_blocks(tiny_models, tmp_path, capsys):
    """A GGUF is planned as the engine runs it on a CPU (its matrices kept as shipped): the target's weights are
    about the file's bytes, not the dequantised float32 model's (3.5x more for Q4_K); `plan` resolves
    --quantization as the engine does."""
    from tests.compiled import kernels_or_skip
    from specdecode.model.tokenizer import Tokenizer

    from tests.model.gguf_files import tiny_model, write_gguf

    kernels_or_skip()
    vocab = Tokenizer(tiny_models["target"]).vocab_size
    path = write_gguf(tmp_path / "tiny-q4k.gguf", tiny_model("qwen2", vocab), tiny_models["tok"] / "tokenizer.json",
                      "qwen2", "Q4_K")
    kept = plan_memory(path, GiB, 64, 2, dtype="float32", device="cpu", quantization="gguf").target.weights
    dense = plan_memory(path, GiB, 64, 2, dtype="float32", device="cpu").target.weights
    assert 0.8 * path.stat().st_size < kept < 1.2 * path.stat().st_size and dense > 3 * kept
    args = ["plan", "--model", str(path), "--device", "cpu", "--dtype", "float32", "--max-model-len", "64",
            "--max-num-seqs", "2", "--device-memory", "1"]
    assert main(args) == 0 and main(args + ["--quantization", "none"]) == 0
    auto, none = (next(line for line in out.splitlines() if line.startswith("target weights"))
                  for out in capsys.readouterr().out.split("tiny-q4k.gguf, speculation")[1:])
    assert float(auto.split()[-2]) * GiB < 0.5 * float(none.split()[-2]) * GiB
