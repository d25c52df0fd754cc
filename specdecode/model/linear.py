"""The linear-layer backend, chosen once at load time: a module swap applied after loading (gpt-fast's
quantize.py shape), so that the model's forward never branches on the platform.

On x86 CPUs, oneDNN's prepacked weights (`torch.ops.mkldnn._reorder_linear_weight` once, then
`torch.ops.mkldnn._linear_pointwise` per call) read a weight matrix 1.7-1.9x faster than `F.linear` in the
matrix-vector products of decoding, and cost less than `F.linear` when several tokens are verified at once
(measured: docs/bench/speed_kernels.md). Elsewhere (CUDA, other CPUs) the plain matmul is the fast path already.
Weight-only int8 (quantization="int8") is the same kind of swap.
"""
from __future__ import annotations

import platform

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.errors import ConfigError

BACKENDS = ("auto", "onednn", "plain")
QUANTIZATIONS = (None, "int8")
"""Weight quantizations (vLLM's --quantization): None, or weight-only int8 (Int8Linear)."""


def onednn_supports(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack weights of this dtype on this device (an x86 CPU with oneDNN)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """'auto' -> 'onednn' where oneDNN can prepack this dtype on this device, else 'plain'."""
    if backend not in BACKENDS:
        raise ConfigError(f"linear backend {backend!r} is not known; use one of: {', '.join(BACKENDS)}")
    if backend == "auto":
        return "onednn" if onednn_supports(device, dtype) else "plain"
    if backend == "onednn" and not onednn_supports(device, dtype):
        raise ConfigError(f"the oneDNN linear backend needs an x86 CPU with oneDNN support for {dtype} "
                          f"(device here: {device}); use backend 'plain' or 'auto'")
    return backend


class PackedLinear(nn.Module):
    """nn.Linear with a second, derived copy of its weight in a faster form, for inference (subclasses say which).

    `weight` and `bias` stay the original Parameters (the same objects, so ties, state dicts, save_model and
    training see no difference). Whatever needs autograd or autocast, and training mode, runs the plain F.linear
    on the originals. The copy is rebuilt whenever it could be stale: on eval() (after training), after
    load_state_dict and after .to(). The price is a second copy of the weights in memory, never read by the
    plain path.
    """

    backend = "plain"

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # [out, in]
        self.bias = linear.bias  # [out] or None
        self.training = linear.training
        self.packed = None  # the derived weight; None = F.linear (this device or dtype has no fast kernel)
        self.repack()

    def pack(self, weight: torch.Tensor):
        """The derived weight of weight [out, in], or None where the kernel cannot run."""
        raise NotImplementedError

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] (contiguous) -> [M, out] with the derived weight."""
        raise NotImplementedError

    def repack(self) -> None:
        self.packed = self.pack(self.weight.detach())

    def bytes_read(self) -> int:
        """Bytes of weights one call reads (the derived copy's, where it is used)."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.bias) if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        if (self.packed is None or self.training or torch.is_grad_enabled()
                or torch.is_autocast_enabled(x.device.type)):
            return F.linear(x, self.weight, self.bias)
        # The kernels read x's memory as a dense row-major matrix: a strided view would give wrong numbers.
        if x.dim() == 2:  # the decoder's case (token-major hidden states): no reshapes around the kernel
            return self.kernel(x.contiguous())
        return self.kernel(x.reshape(-1, self.in_features).contiguous()).view(*x.shape[:-1], self.out_features)

    def train(self, mode: bool = True) -> "PackedLinear":
        was_training = self.training
        super().train(mode)
        if was_training and not mode:  # back from training: the weights may have changed
            self.repack()
        return self

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        self.repack()  # a new device or dtype
        return out

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.repack()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"backend={self.backend if self.packed is not None else 'plain'}"


class OneDNNLinear(PackedLinear):
    """The weight in oneDNN's blocked layout (x86 CPUs): `torch.ops.mkldnn._reorder_linear_weight` once, then
    `torch.ops.mkldnn._linear_pointwise` per call."""

    backend = "onednn"

    def pack(self, weight: torch.Tensor):
        if not onednn_supports(weight.device, weight.dtype):
            return None
        return torch.ops.mkldnn._reorder_linear_weight(weight)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Int8Linear(PackedLinear):
    """Weight-only int8: each output row stored as int8 with one scale (symmetric, absmax / 127), multiplied by
    `torch.ops.aten._weight_int8pack_mm` with activations in the model's dtype. Half the bytes of bfloat16 per
    decode step; rounding each weight to 1/254 of its row's largest changes the logits a little."""

    backend = "int8"

    def pack(self, weight: torch.Tensor):
        # The scale is rounded to the activations' dtype first, so that the int8 values fit the scale the kernel uses.
        scale = (weight.float().abs().amax(dim=1).clamp_min(1e-12) / 127).to(weight.dtype)  # [out]
        quantized = (weight.float() / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)  # [out, in]
        return quantized, scale

    def bytes_read(self) -> int:
        if self.packed is None:
            return super().bytes_read()
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return sum(t.numel() * t.element_size() for t in self.packed) + bias

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x, *self.packed)
        return out if self.bias is None else out + self.bias


def _swap_linears(model: nn.Module, make) -> nn.Module:
    """Replace every submodule m of model by make(m); returns make(model) (the root may be a linear layer)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            swapped = make(child)
            if swapped is not child:
                setattr(parent, name, swapped)
    return make(model)


def _plain(module: nn.Module) -> nn.Module:
    if not isinstance(module, PackedLinear):
        return module
    linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                       device="meta")  # parameters replaced below: allocate nothing
    linear.weight, linear.bias = module.weight, module.bias
    linear.train(module.training)
    return linear


def prepare_for_inference(model: nn.Module, backend: str = "auto", quantization: str | None = None) -> nn.Module:
    """Give every nn.Linear of `model` (a target, a draft or a head) the linear backend: 'onednn' packs the
    weights once (x86 CPU), 'plain' restores nn.Linear, 'auto' picks the platform's fast one; quantization
    'int8' makes them weight-only int8 instead (whatever the backend). Returns model (or, for a bare linear
    layer, its replacement).

    Reversible and idempotent; parameters, their names and state_dict() do not change."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization {quantization!r} is not supported; use one of: "
                          f"{', '.join(str(q) for q in QUANTIZATIONS)}")
    weight = next((m.weight for m in model.modules() if isinstance(m, nn.Linear | PackedLinear)), None)
    if weight is None:
        return model
    backend = resolve_backend(backend, weight.device, weight.dtype)
    if quantization == "int8" and weight.device.type == "cpu" and weight.dtype == torch.float32:
        raise ConfigError("int8 weight-only matrix products need bfloat16 (or float16) activations on CPU; with "
                          "float32 ones they run 9x slower than float32 weights. Use dtype bfloat16.")
    model = _swap_linears(model, _plain)
    fast = Int8Linear if quantization == "int8" else OneDNNLinear if backend == "onednn" else None
    if fast is not None:
        model = _swap_linears(model, lambda m: fast(m) if type(m) is nn.Linear else m)
    return model


def linear_backend(model: nn.Module) -> str:
    """How the model's linear layers run: 'onednn', 'int8' or 'plain'."""
    packed = [m for m in model.modules() if isinstance(m, PackedLinear) and m.packed is not None]
    return packed[0].backend if packed else "plain"
