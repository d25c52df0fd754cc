"""The linear-layer backend, chosen once at load time: a module swap applied after loading (gpt-fast's
quantize.py shape), so that the model's forward never branches on the platform.

On x86 CPUs, oneDNN's prepacked weights (`torch.ops.mkldnn._reorder_linear_weight` once, then
`torch.ops.mkldnn._linear_pointwise` per call) read a weight matrix 1.7-1.9x faster than `F.linear` in the
matrix-vector products of decoding, and cost less than `F.linear` when several tokens are verified at once
(measured: docs/bench/speed.md). Elsewhere (CUDA, other CPUs) the plain matmul is the fast path already.
"""
from __future__ import annotations

import platform

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.errors import ConfigError

BACKENDS = ("auto", "onednn", "plain")


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
    """nn.Linear whose weight is also held in oneDNN's blocked layout, for inference.

    `weight` and `bias` stay the original Parameters (the same objects, so ties, state dicts, save_model and
    training see no difference); the packed copy is derived from them. Whatever needs autograd or autocast, and
    training mode, runs the plain F.linear on the originals. The copy is rebuilt whenever it could be stale:
    on eval() (after training), after load_state_dict and after .to(). The price is a second copy of the
    weights in memory, never read by the plain path.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # [out, in]
        self.bias = linear.bias  # [out] or None
        self.training = linear.training
        self.packed: torch.Tensor | None = None  # oneDNN blocked layout of weight; None = use F.linear
        self.repack()

    def repack(self) -> None:
        weight = self.weight.detach()
        if onednn_supports(weight.device, weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        else:
            self.packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        if (self.packed is None or self.training or torch.is_grad_enabled()
                or torch.is_autocast_enabled(x.device.type)):
            return F.linear(x, self.weight, self.bias)
        # The kernel reads x's memory as a dense row-major matrix: a strided view would give wrong numbers.
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

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
        backend = "onednn" if self.packed is not None else "plain"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"backend={backend}"


def _swap_linears(model: nn.Module, make) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            swapped = make(child)
            if swapped is not child:
                setattr(parent, name, swapped)


def _plain(module: nn.Module) -> nn.Module:
    if not isinstance(module, PackedLinear):
        return module
    linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                       device="meta")  # parameters replaced below: allocate nothing
    linear.weight, linear.bias = module.weight, module.bias
    linear.train(module.training)
    return linear


def prepare_for_inference(model: nn.Module, backend: str = "auto") -> nn.Module:
    """Give every nn.Linear of `model` (a target, a draft or a head) the linear backend: 'onednn' packs the
    weights once (x86 CPU), 'plain' restores nn.Linear, 'auto' picks the platform's fast one. Returns model.

    Reversible and idempotent; parameters, their names and state_dict() do not change."""
    weight = next((m.weight for m in model.modules() if isinstance(m, nn.Linear | PackedLinear)), None)
    if weight is None:
        return model
    backend = resolve_backend(backend, weight.device, weight.dtype)
    _swap_linears(model, _plain)
    if backend == "onednn":
        _swap_linears(model, lambda m: PackedLinear(m) if type(m) is nn.Linear else m)
    return model


def linear_backend(model: nn.Module) -> str:
    """'onednn' if the model's linear layers run prepacked, else 'plain'."""
    packed = any(isinstance(m, PackedLinear) and m.packed is not None for m in model.modules())
    return "onednn" if packed else "plain"
