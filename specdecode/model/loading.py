"""Checkpoints: load Hugging Face directories (config.json + safetensors, single or sharded) or GGUF files
(see gguf.py; after the first load, from their converted copy: gguf_cache.py); save Hugging Face directories.

Only safetensors are read: pickled *.bin weights can run arbitrary code when loaded, so they are refused.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specdecode.errors import CheckpointError, ConfigError
from specdecode.hardware import cpu_has_native_bf16
from specdecode.model.config import ModelConfig
from specdecode.model.gguf import find_gguf, gguf_config, gguf_state_dict, open_gguf, release_pages
from specdecode.model.gguf_cache import gguf_model_config, read_gguf
from specdecode.model.linear import QUANTIZATIONS as FLOAT_QUANTIZATIONS
from specdecode.model.linear import prepare_for_inference
from specdecode.model.llama import LlamaForCausalLM
from specdecode.model.packed_store import keep_packed, store_for
from specdecode.model.quant import BLOCKS, GGUF_FORMATS, QuantEmbedding, attach_quantized, quantize_linears
from specdecode.model.quant import QUANTIZATIONS as KEPT_QUANTIZATIONS

CHOICES = ("auto", "none", "gguf", "q8_0", "q4_0", "q4_1", "int8")
"""What `quantization=` / --quantization take (resolve_quantization, load_model)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' means bfloat16 on CUDA and on CPUs with native bfloat16 dot products (avx512_bf16 or AMX), where
    it decodes ~1.7x faster than float32 (docs/speed.md); float32 on other CPUs."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        native_bf16 = device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())
        return torch.bfloat16 if native_bf16 else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; use one of: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _weight_files(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{index} is corrupt ({exc!r}); it must be JSON with a 'weight_map'") from exc
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise CheckpointError(f"{model_dir / missing[0]} is missing (listed in {index.name})")
        return [model_dir / s for s in shards]
    if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")) or list(model_dir.glob("*.pth")):
        raise CheckpointError(
            f"{model_dir} has only pickled weights (*.bin/*.pt); specdecode loads safetensors only because "
            "pickle can run arbitrary code. Convert it: load it in transformers and call "
            "save_pretrained(dir, safe_serialization=True)."
        )
    raise CheckpointError(f"{single} is missing: a model directory needs model.safetensors or "
                          "model.safetensors.index.json")


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    state = {}
    for path in _weight_files(model_dir):
        try:
            state.update(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path} is corrupt or unreadable ({exc}); re-download or re-save it") from exc
    return state


def read_checkpoint(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor], str]:
    """(config, state dict under HF names, what describes the config) of a HF directory or a GGUF file/directory.

    Every format ends here, so that the same name/shape checks and assignment apply to all of them."""
    gguf_path = find_gguf(path)
    if gguf_path is not None:
        config, state = read_gguf(gguf_path, dtype)
        return config, state, f"the metadata of {gguf_path.name}"
    if not path.is_dir():
        raise CheckpointError(f"model {path} does not exist: pass a Hugging Face checkpoint directory, a .gguf "
                              "file, or a model name (see `specdecode models`)")
    return ModelConfig.from_file(path / "config.json"), load_state_dict(path), "its config.json"


def read_config(path: str | Path) -> ModelConfig:
    """The model config of a checkpoint (HF directory or GGUF), without reading its weights."""
    path = Path(path)
    gguf_path = find_gguf(path)
    if gguf_path is not None:
        return gguf_model_config(gguf_path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path / 'config.json'} is missing: pass a Hugging Face checkpoint directory, a .gguf "
                              "file, or a model name (see `specdecode models`)")
    return ModelConfig.from_file(path / "config.json")


def read_quantized_gguf(gguf_path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict, str]:
    """read_checkpoint for a GGUF whose matrices stay as shipped: those of a type the kernels multiply as
    (format, bytes) pairs over the file's memory map (see gguf_state_dict), the rest (norms, biases) dequantised
    to dtype. Nothing is written: the matrices are used where they lie."""
    ckpt = open_gguf(gguf_path)
    config = gguf_config(ckpt)
    return config, gguf_state_dict(ckpt, config, dtype, keep=GGUF_FORMATS), f"the metadata of {gguf_path.name}"


def _shape(value) -> tuple[int, ...]:
    if isinstance(value, tuple):  # (format, uint8 rows): rows x (bytes / block bytes * 32) weights
        fmt, rows = value
        return rows.shape[0], rows.shape[1] // BLOCKS[fmt][1] * BLOCKS[fmt][0]
    return tuple(value.shape)


def resolve_quantization(quantization: str | None, model_dir: Path, device: torch.device,
                         tensor_parallel_size: int = 1) -> str | None:
    """'auto' (the engine's default) -> 'gguf' for a GGUF file on the CPU in one process where the quantized
    kernels build here (the file's matrices as shipped: 2.5-3.5x fewer bytes per step than bfloat16), else None
    (float weights); 'none' -> None; anything else as given (checked by load_model)."""
    if quantization == "none":
        return None
    if quantization != "auto":
        return quantization
    if device.type != "cpu" or tensor_parallel_size != 1 or find_gguf(model_dir) is None:
        return None
    from specdecode.model.quant import kernels
    if kernels() is None:
        from specdecode import kernels as compiled
        print(f"specdecode: the quantized CPU kernels could not be built ({compiled.failure()}); decoding with "
              "dequantised weights (slower)", file=sys.stderr, flush=True)
        return None
    return "gguf"


def check_quantization(quantization: str | None, model_dir: Path, device: torch.device) -> None:
    """Refuse a quantization this checkpoint or device cannot take, before anything loads."""
    if quantization is not None and quantization not in (*FLOAT_QUANTIZATIONS, *KEPT_QUANTIZATIONS):
        raise ConfigError(f"quantization {quantization!r} is not supported; use one of: {', '.join(CHOICES)}")
    if quantization in KEPT_QUANTIZATIONS and device.type != "cpu":
        raise ConfigError(f"quantization {quantization!r} runs on CPU kernels; on {device} load the model without "
                          "quantization (--quantization none)")
    if quantization == "gguf" and find_gguf(model_dir) is None:
        raise ConfigError(f"quantization 'gguf' keeps a GGUF file's matrices as shipped, and {model_dir} is not a "
                          "GGUF; use q8_0, q4_0 or q4_1 to quantize this checkpoint at load")


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "auto",
               device: str | torch.device | None = None, quantization: str | None = None,
               shard: Callable[[LlamaForCausalLM], LlamaForCausalLM] | None = None,
               keep: bool = True) -> LlamaForCausalLM:
    """Build the decoder of a checkpoint (HF directory with config.json + safetensors, a .gguf file, or a
    directory holding one .gguf) and fill it with its weights.

    quantization: None (float weights: GGUF weights are dequantised to dtype, once: later loads memory-map the
    converted copy, see gguf_cache.py); "int8" (weight-only int8 through torch, model/linear.py); "gguf" (a GGUF's
    Q8_0/Q4_0/Q4_1 matrices kept as shipped, model/quant.py); "q8_0", "q4_0", "q4_1" (every matrix quantized to
    that format at load). dtype is then the activations' dtype.
    shard: applied to the loaded model before it moves to the device and gets its linear kernels (tensor
    parallelism keeps one rank's share there, see dist/tp.py).
    keep: a GGUF's packed matrices are kept in the cache for the next start (packed_store.py); a caller that
    changes the model's matrices after this (a draft: its restricted head, its lightened matrices) passes False
    and keeps them itself (keep_packed), so that what it replaced is never packed."""
    model_dir = Path(model_dir)
    device = resolve_device(device)
    check_quantization(quantization, model_dir, device)
    # Quantized matrices read the same bytes whatever the activations are: "auto" takes float32 for them (the fused
    # layer's dtype, batch-invariant), bfloat16 would only round the activations.
    dtype = torch.float32 if quantization in KEPT_QUANTIZATIONS and dtype == "auto" else resolve_dtype(dtype, device)
    if quantization == "gguf":
        config, state, described_by = read_quantized_gguf(find_gguf(model_dir), dtype)
    else:
        config, state, described_by = read_checkpoint(model_dir, dtype)
    with torch.device("meta"):  # no storage and no random init: load_state_dict(assign=True) puts the weights in
        model = LlamaForCausalLM(config)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k for k in model.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(expected - state.keys())
    unexpected = sorted(k for k in state.keys() - expected if "rotary_emb" not in k)
    if missing or unexpected:
        detail = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise CheckpointError(f"weights in {model_dir} do not match {described_by} ({detail}); "
                              "the weights and the config come from different models")
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}  # HF names (llama.py stacks q/k/v)
    for name, tensor in state.items():
        want = shapes[name] if name in expected else None
        if want is not None and _shape(tensor) != tuple(want):
            raise CheckpointError(f"weight {name} in {model_dir} has shape {_shape(tensor)}, {described_by} "
                                  f"implies {tuple(want)}; the weights and the config do not match")
    if quantization == "gguf":
        store = store_for(find_gguf(model_dir))
        attach_quantized(model, state, dtype, store)  # the shipped matrices become modules; state keeps the rest
    state = {k: v.to(dtype) for k, v in state.items() if k in expected}
    model.load_state_dict(state, assign=True, strict=False)
    if config.tie_word_embeddings and not isinstance(model.model.embed_tokens, QuantEmbedding):
        model.lm_head.weight = model.model.embed_tokens.weight
    if shard is not None:
        model = shard(model)
    if quantization in KEPT_QUANTIZATIONS and quantization != "gguf":
        quantize_linears(model.eval(), quantization)
    if quantization == "gguf" and keep:
        keep_packed(model, store)
        release_pages(find_gguf(model_dir))  # packed: the file's pages need not stay resident
    # The platform's fastest linear kernels, or weight-only int8 (quantization="int8").
    float_quantization = quantization if quantization in FLOAT_QUANTIZATIONS else None
    return prepare_for_inference(model.to(device).eval(), quantization=float_quantization)


def save_model(model: LlamaForCausalLM, model_dir: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write config.json + model.safetensors (readable by transformers' from_pretrained)."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    config = model.config.to_hf_dict()
    dtype = dtype or model.dtype
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
