"""The low-precision activation probe: does an activation run in bf16 or fp16 put NaN and
±inf where eager's fp32 activation does on the same values?

The precision modes lower an activation that follows a low-precision GEMM or convolution
(``allow_mix_precision*``) or every op (``force_fp16``). ATen's low-precision kernels are
not its fp32 ones: on AVX-512, ATen sends a contiguous fp32 (and bf16) GELU to oneDNN's
``eltwise_gelu_erf``, which returns NaN for +inf (pytorch/pytorch#185770), while its fp16
GELU runs ATen's own loop and returns +inf, so a Linear → GELU lowered to fp16 returned
+inf where eager fp32 returns NaN. `activation_low_differs(act, dtype)` runs every kernel
a lowered ``act`` node may bind in ``dtype``: ATen's functional, ``.out`` and in-place op
(LinearAct's activation after its GEMM) on contiguous, strided and channels-last tensors
(`activations.kernels`), and, in bf16, oneDNN's inner product with the activation as its
post-op (LinearAct's bf16 kernel on a constant weight, ``BF16_LINEAR_POST``), on
`activations.probe_input` (NaN, ±inf, ±3e38, ±1e13 at the head, body and tail), and
compares each with eager's fp32 op at the same layout on the same (rounded) values, its
result rounded to ``dtype`` (`compare.first_difference`: NaN positions, inf positions and
signs; finite values differ by the rounding, which is not compared). oneDNN's
convolution post-ops (ConvBiasAct) are covered in two steps: ``fuse_conv_act`` fuses an
activation only where the post-op gives eager's activation in the same dtype at eager's
layout (`conv_probes.conv_post_op_differs`), and this probe compares that with fp32's.
Answers are cached per (act, dtype) in memory and on disk (`probe.Probe`).
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Tuple

import torch

from ...devices.cpu import onednn_bf16_available, onednn_linear_available
from .activations import kernels, probe_input
from .compare import first_difference
from .probe import Probe, register

#: the activations the probe covers (a node's OpDef ``activation`` column; Gelu with
#: approximate="tanh" is "gelu_tanh"); ReLU is max(x, 0), exact in every dtype
LOW_ACTS = ("gelu", "gelu_tanh", "silu", "tanh", "sigmoid")
_LINEAR_COLS = 16              # output features of the identity GEMM (a vector's width)


def _linear_post_op(post_op: str, algorithm: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """oneDNN's inner product on a prepacked weight with ``post_op`` (LinearAct's bf16
    kernel) as ``f(x) -> [N, 16]``: x as [N, 1] times a [1, 16] weight of ones, so every
    column is ``post_op(x)`` (no NaN × 0 term)."""
    def run(x: torch.Tensor) -> torch.Tensor:
        w = torch.ones(_LINEAR_COLS, 1, dtype=x.dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, x.numel())
        return torch.ops.mkldnn._linear_pointwise(x.reshape(-1, 1), packed, None, post_op, [],
                                                  algorithm)
    return run


def _columns(f: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
    """Eager's side of `_linear_post_op`: ``f`` on the contiguous [N, 16] GEMM output."""
    return lambda x: f(x.reshape(-1, 1).expand(-1, _LINEAR_COLS).contiguous().reshape(-1))\
        .reshape(-1, _LINEAR_COLS)


def low_kernels(act: str, dtype: torch.dtype) -> Iterator[Tuple[str, Callable, Callable]]:
    """(name, f, eager) of each CPU kernel a node computing ``act`` in ``dtype`` (bf16 /
    fp16) may bind: ``f(x)`` runs it on a contiguous 1-D ``x`` of ``dtype``, ``eager(x)``
    eager's fp32 op at the same layout on an fp32 ``x`` (module docstring). Raises
    KeyError for another ``act``."""
    if act not in LOW_ACTS:
        raise KeyError(act)
    fp32 = dict(kernels(act, torch.float32))
    for name, f in kernels(act, dtype):
        yield name, f, fp32[name]
    from ..kernels.cpu import BF16_LINEAR_POST   # the ops layer's kernels, loaded on use
    if dtype == torch.bfloat16 and act in BF16_LINEAR_POST and onednn_linear_available() \
            and onednn_bf16_available():
        functional = next(iter(fp32.values()))   # `kernels` yields ATen's functional first
        yield (f"oneDNN's bf16 inner product with the {act} post-op (LinearAct)",
               _linear_post_op(*BF16_LINEAR_POST[act]), _columns(functional))


def activation_low_differs(act: str, dtype: torch.dtype) -> Optional[str]:
    """None when every kernel of `low_kernels` gives NaN and ±inf where eager's fp32
    ``act`` does on the same values (module docstring), else one line naming the kernel,
    the input and both results (the reason the precision pass keeps such a node in
    fp32). A kernel that raises is a difference. Uncached (`activation_low_precision_
    differs` caches it). Raises KeyError for an ``act`` outside `LOW_ACTS`."""
    x = probe_input(dtype)
    for name, f, eager in low_kernels(act, dtype):
        try:
            got = f(x)
            want = eager(x.float()).to(dtype)   # eager's fp32 result, rounded as the cast rounds it
        except (RuntimeError, TypeError, ValueError) as e:
            return f"{name} fails for {dtype} on this CPU ({str(e).splitlines()[0]})"
        i = first_difference(got, want)
        if i is not None:
            xi = x[i % x.numel()] if got.numel() == x.numel() else x[i // _LINEAR_COLS]
            low = str(dtype).replace("torch.", "")
            return (f"{name} in {low} gives {act}({xi.item():g}) = "
                    f"{got.reshape(-1)[i].item():g} on this CPU where eager's fp32 {act} gives "
                    f"{want.reshape(-1)[i].item():g} (pytorch/pytorch#185770)")
    return None


ACTIVATION_LOW_PROBE = register(Probe(
    "activation_low_precision", guards="MixedPrecision (passes/prepare/precision.py): an "
    "activation (GELU erf / tanh, SiLU, tanh, sigmoid) lowered to bf16 / fp16",
    kernel="ATen's bf16 / fp16 activation (functional, .out, in place; contiguous, strided, "
    "channels-last) and, in bf16, oneDNN's inner product with the activation as its post-op",
    inputs="linspace(-4, 4) × 1000 with NaN, ±inf, ±3e38, ±1e13 at the head, body and tail",
    run=activation_low_differs, version=2))


def activation_low_precision_differs(act: str, dtype: torch.dtype) -> Optional[str]:
    """`activation_low_differs`, cached per (act, dtype) in memory and on disk: None when
    an ``act`` node (one of `LOW_ACTS`) may compute in ``dtype`` (bf16 / fp16) keeping
    eager fp32's NaN and ±inf, else the reason it stays fp32."""
    return ACTIVATION_LOW_PROBE(act, dtype)


__all__ = ["ACTIVATION_LOW_PROBE", "LOW_ACTS", "activation_low_differs",
           "activation_low_precision_differs", "low_kernels"]
