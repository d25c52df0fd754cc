"""The load-time linear backend (oneDNN prepacked weights on x86 CPUs) and the stacked q/k/v, gate/up weights."""
import pytest
import torch
from torch import nn

from specdecode.errors import ConfigError
from specdecode.hardware import cpu_has_native_bf16
from specdecode.model.config import ModelConfig
from specdecode.model.linear import OneDNNLinear, PackedLinear, linear_backend, onednn_supports, prepare_for_inference
from specdecode.model.llama import LlamaForCausalLM
from specdecode.model.loading import load_model, resolve_dtype, save_model

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not onednn_supports(CPU, torch.float32), reason="needs an x86 CPU with oneDNN")


def tiny_model(**overrides) -> LlamaForCausalLM:
    config = ModelConfig(**{**dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2), **overrides})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.05).add_(1.0 if p.dim() == 1 else 0.0)
    return model.eval()


def logits(model, ids):
    with torch.inference_mode():
        return model(ids).logits


IDS = torch.randint(0, 101, (2, 7), generator=torch.Generator().manual_seed(1))


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 64), (9, 64), (2, 5, 64)])
def test_packed_linear_matches_f_linear(shape):
    linear = nn.Linear(64, 48)
    packed = OneDNNLinear(linear)
    x = torch.randn(*shape)
    with torch.no_grad():
        assert (packed(x) - linear(x)).abs().max() <= 1e-5
        # A strided view: the kernel would read the wrong numbers without a contiguous copy.
        strided = torch.randn(64, shape[0]).t()
        assert (packed(strided) - linear(strided)).abs().max() <= 1e-5


@needs_onednn
def test_prepare_is_reversible_and_keeps_parameters():
    model = tiny_model()
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    reference = logits(model, IDS)
    prepare_for_inference(model, "onednn")
    assert linear_backend(model) == "onednn"
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, PackedLinear)
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameter objects
    assert model.lm_head.weight is model.model.embed_tokens.weight or not model.config.tie_word_embeddings
    assert (logits(model, IDS) - reference).abs().max() <= 1e-4
    prepare_for_inference(model, "plain")
    assert linear_backend(model) == "plain"
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(logits(model, IDS), reference)


@needs_onednn
def test_training_a_prepared_model_then_eval_uses_the_new_weights():
    model = prepare_for_inference(tiny_model(tie_word_embeddings=True), "onednn")
    before = logits(model, IDS)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(IDS).logits.logsumexp(-1).mean()  # gradients flow through the plain path
    loss.backward()
    assert model.model.layers[0].mlp.gate_up_proj.weight.grad.abs().sum() > 0
    optimizer.step()
    model.eval()  # repacks
    after = logits(model, IDS)
    prepare_for_inference(model, "plain")
    assert (after - before).abs().max() > 1e-3  # the step changed the model...
    assert (after - logits(model, IDS)).abs().max() <= 1e-4  # ...and the packed copy follows it


@needs_onednn
def test_load_state_dict_repacks():
    model = prepare_for_inference(tiny_model(), "onednn")
    other = tiny_model(rope_theta=10000.0)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.9)
    model.load_state_dict(other.state_dict())
    assert (logits(model, IDS) - logits(other, IDS)).abs().max() <= 1e-4


def test_unknown_backend_is_refused():
    with pytest.raises(ConfigError, match="backend"):
        prepare_for_inference(tiny_model(), "fast")


@needs_onednn
def test_load_model_prepacks_and_save_model_writes_the_checkpoint(tmp_path):
    from safetensors.torch import load_file

    save_model(tiny_model(attention_bias=True, model_type="qwen2"), tmp_path / "a", dtype=torch.float32)
    model = load_model(tmp_path / "a", dtype="float32", device="cpu")
    assert linear_backend(model) == "onednn"
    save_model(model, tmp_path / "b", dtype=torch.float32)
    original, again = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert original.keys() == again.keys()
    assert "model.layers.0.self_attn.q_proj.bias" in original  # Hugging Face names, parts split again
    assert all(torch.equal(original[k], again[k]) for k in original)


def test_stacked_projections_load_and_save_under_hf_names():
    model = tiny_model()
    state = model.state_dict()
    for part in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.1.self_attn.{part}.weight" in state
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in state)
    attn = model.model.layers[1].self_attn
    q, k, v = state["model.layers.1.self_attn.q_proj.weight"], state["model.layers.1.self_attn.k_proj.weight"], \
        state["model.layers.1.self_attn.v_proj.weight"]
    assert q.shape == (32, 32) and k.shape == v.shape == (16, 32)
    assert torch.equal(torch.cat([q, k, v]), attn.qkv_proj.weight)
    fresh = LlamaForCausalLM(model.config).eval()
    fresh.load_state_dict(state)  # strict: every HF name consumed, every stacked weight filled
    assert torch.equal(logits(fresh, IDS), logits(model, IDS))


@needs_onednn
@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN bf16 unsupported here")
def test_bfloat16_packed_close_to_plain():
    model = prepare_for_inference(tiny_model().to(torch.bfloat16), "onednn")
    packed = logits(model, IDS).float()
    prepare_for_inference(model, "plain")
    plain = logits(model, IDS).float()
    assert (packed - plain).abs().max() <= 0.05 * plain.abs().max()


def test_auto_dtype_follows_native_bf16():
    cpu = torch.device("cpu")
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert resolve_dtype("auto", cpu) == expected
    assert resolve_dtype("float32", cpu) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert not cpu_has_native_bf16(frozenset({"avx2", "avx512f"}))
    assert cpu_has_native_bf16(frozenset({"avx512f", "amx_bf16"})) == torch.backends.mkldnn.is_available()


@needs_onednn
@pytest.mark.parametrize("backend", ["onednn", "plain"])
def test_hf_parity_through_each_backend(tmp_path, backend):
    """Float32 logits within 1e-4 of transformers', for a prefill and for 1 and 9 cached tokens at a time."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = prepare_for_inference(load_model(tmp_path, dtype="float32", device="cpu"), backend)
    assert linear_backend(ours) == backend
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    cache = ours.make_cache(1, 64)
    pieces = []
    with torch.inference_mode():
        for start, stop in ((0, 10), (10, 11), (11, 20)):  # prefill, one token, nine tokens (a verify pass)
            pieces.append(ours(ids[:, start:stop], cache=cache).logits[0])
            cache.advance(torch.tensor([0]), stop - start)
    assert (torch.cat(pieces) - ref).abs().max() <= 1e-4


def test_int8_weight_only_matches_its_dequantized_weights():
    from specdecode.model.linear import Int8Linear

    torch.manual_seed(0)
    linear = nn.Linear(64, 48).to(torch.bfloat16)
    int8 = Int8Linear(linear)
    q, scale = int8.packed
    assert q.dtype == torch.int8 and q.shape == (48, 64) and scale.shape == (48,)
    dequantized = q.float() * scale.float()[:, None]
    assert (dequantized - linear.weight.float()).abs().max() <= scale.float().max() / 2 + 1e-6  # half a step
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.no_grad():
        expected = x.float() @ dequantized.t() + linear.bias.float()
        assert (int8(x).float() - expected).abs().max() <= 0.05 * expected.abs().max()


def test_int8_model_keeps_parameters_and_is_refused_in_float32():
    model = tiny_model().to(torch.bfloat16)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    reference = logits(model, IDS)
    prepare_for_inference(model, quantization="int8")
    assert linear_backend(model) == "int8"
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    quantized = logits(model, IDS)
    assert (quantized - reference).abs().max() <= 0.1 * reference.abs().max()
    with pytest.raises(ConfigError, match="bfloat16"):
        prepare_for_inference(tiny_model(), quantization="int8")
    with pytest.raises(ConfigError, match="not supported"):
        prepare_for_inference(tiny_model(), quantization="int4")


def test_llm_with_int8_generates(tiny_models):
    from specdecode.engine.llm import LLM
    from specdecode.sampling import SamplingParams

    llm = LLM(tiny_models["target"], dtype="bfloat16", device="cpu", quantization="int8", max_num_seqs=2)
    assert linear_backend(llm.target) == "int8"
    out = llm.generate(["def add(a, b):", "class Point:"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [5, 5]


def test_bfloat16_model_ragged_batch_matches_single_rows():
    """A bfloat16 model over its float32 KV cache: rows of different lengths in one batch (the indexed cache
    writes) give the logits each row gives alone."""
    model = tiny_model().to(torch.bfloat16)
    prompts = [IDS[0, :7], IDS[1, :4]]
    cache = model.make_cache(2, 32)
    assert cache.k[0].dtype == model.kv_dtype == torch.float32
    with torch.inference_mode():
        for row, ids in enumerate(prompts):
            model(ids[None], cache=cache, slots=torch.tensor([row]))
            cache.advance(torch.tensor([row]), len(ids))
        nxt = torch.tensor([[3], [4]])
        both = model(nxt, cache=cache).logits[:, 0]
        alone = [model(nxt[row:row + 1], cache=cache, slots=torch.tensor([row])).logits[0, 0] for row in range(2)]
    assert (both - torch.stack(alone)).abs().max() <= 0.05 * both.abs().max()


@needs_onednn
def test_a_bare_linear_layer_comes_back_swapped():
    linear = nn.Linear(8, 4).eval()
    packed = prepare_for_inference(linear, "onednn")
    assert isinstance(packed, OneDNNLinear) and packed.weight is linear.weight
    assert type(prepare_for_inference(packed, "plain")) is nn.Linear
