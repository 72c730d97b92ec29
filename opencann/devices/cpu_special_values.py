"""Whether this CPU's activation kernels keep NaN and ±inf where the spelled-out formula
does (GELU in its erf and tanh forms, SiLU).

A fusion that replaces a formula written out in elementwise ops by one library kernel is
exact only if the kernel gives the formula's NaN and ±inf: otherwise a compiled model
returns NaN where eager returned inf, silently. For GELU that depends on the machine, not
only on torch's version: ATen sends contiguous fp32/bf16 CPU tensors to oneDNN's
``eltwise_gelu_erf``, whose AVX-512 code returns NaN for +inf while the AVX2 code and the
written-out ``0.5·x·(1 + erf(x/√2))`` return +inf (pytorch/pytorch#185770, #187293; a fix
proposed in pytorch/pytorch#192318 would also turn gelu(-inf) from NaN into 0, which the
formula does not give either). So the GELU and SiLU fusions ask `special_values_differ`
before they rewrite, and keep the spelled-out form (a Skip with this module's reason)
where the kernels differ; a model file records the fusions it holds (graph meta
``formula_kernels``) and is refused with that reason on a CPU where they would differ.

`special_values_differ(act, dtype)` runs every CPU kernel a fused activation node can be
bound to (`_kernels`: ATen's functional, ``.out`` and in-place op on contiguous, strided
and channels-last tensors, and, for fp32, oneDNN's convolution with the activation as its
post-op, which `FuseConvAct` makes of the activation after a Conv2D) on NaN, ±inf, ±3e38
and ±1e13 (whose cube overflows in GELU's tanh form) placed at the head, the vector body
and the tail of a 1000-element tensor, and compares each result's NaN positions, inf
positions and inf values with the spelled-out formula evaluated by eager's own ops. The
answer is cached per (act, dtype): the probe costs a few ms once per process.

The norm formulas ("rms_norm", "layer_norm": `cpu_norm_values.NORMS`) are probed by
`cpu_norm_values.norm_differs` through the same entry point (and cache), so the fusions,
the compile report and `opencann.load` treat them as the activations.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Iterator, Optional, Tuple

import torch

from .cpu_norm_values import NORMS, norm_differs

_SPECIALS = (float("nan"), float("inf"), -float("inf"), 3e38, -3e38, 1e13, -1e13)
_N = 1000                      # a length with a vector body and a scalar tail
_AT = (0, 1, 2, 3, 4, 5, 6, 497, 498, 499, 500, 501, 502, 503, 993, 994, 995, 996, 997, 998, 999)


ACTS = ("gelu", "gelu_tanh", "silu")
FORMULAS = ACTS + NORMS
# act -> (ATen op, its keyword arguments, oneDNN post-op name and algorithm)
_OPS = {"gelu": ("gelu", {"approximate": "none"}, ("gelu", "none")),
        "gelu_tanh": ("gelu", {"approximate": "tanh"}, ("gelu", "tanh")),
        "silu": ("silu", {}, ("swish", ""))}


def formula(x: torch.Tensor, act: str) -> torch.Tensor:
    """The spelled-out activation, evaluated op by op as eager evaluates the written-out
    model: "gelu" 0.5·x·(1 + erf(x/√2)), "gelu_tanh" 0.5·x·(1 + tanh(√(2/π)·(x +
    0.044715·x³))) (Hendrycks & Gimpel 2016, arXiv:1606.08415), "silu" x·sigmoid(x)
    (Elfwing et al. 2017, arXiv:1702.03118). Raises KeyError for another ``act``."""
    if act == "gelu_tanh":
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
        return 0.5 * x * (1.0 + torch.tanh(inner))
    if act == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if act == "silu":
        return x * torch.sigmoid(x)
    raise KeyError(act)


def _probe_input(dtype: torch.dtype) -> torch.Tensor:
    x = torch.linspace(-4.0, 4.0, _N, dtype=torch.float64)
    for i, at in enumerate(_AT):
        x[at] = _SPECIALS[i % len(_SPECIALS)]
    return x.to(dtype)


def _conv_post_op(post_op: str, algorithm: str) -> Callable:
    """oneDNN's convolution with ``post_op`` (ConvBiasAct's kernel) as an identity: a
    depthwise 1×1 convolution with weight 1 and no bias over [1, C, 1, 1]."""
    def run(x: torch.Tensor) -> torch.Tensor:
        c = x.numel()
        w = torch.ones(c, 1, 1, 1, dtype=x.dtype)
        y = torch.ops.mkldnn._convolution_pointwise(x.reshape(1, c, 1, 1), w, None, [0, 0],
                                                     [1, 1], [1, 1], c, post_op, [], algorithm)
        return y.reshape(-1)
    return run


def _kernels(act: str, dtype: torch.dtype) -> Iterator[Tuple[str, Callable]]:
    """(name, f) of each CPU kernel a fused ``act`` node may run as; ``f(x) -> act(x)`` on
    a contiguous 1-D ``x``, the same layout out."""
    name, kw, (post_op, algorithm) = _OPS[act]
    fn, inplace = getattr(torch.ops.aten, name), getattr(torch.ops.aten, name + "_")

    def out_variant(x):
        out = torch.empty_like(x)
        fn.out(x, **kw, out=out)
        return out

    def strided(x):  # every other element of a buffer twice as long
        buf = torch.empty(2 * x.numel(), dtype=x.dtype)
        buf[::2] = x
        return fn(buf[::2], **kw)

    def channels_last(x):  # [1, C, 2, 5] NHWC
        t = x.reshape(1, -1, 2, 5).contiguous(memory_format=torch.channels_last)
        return fn(t, **kw).contiguous().reshape(-1)

    yield f"aten.{name}", lambda x: fn(x, **kw)
    yield f"aten.{name}.out", out_variant
    yield f"aten.{name}_ (in place, LinearAct's activation)", lambda x: inplace(x.clone(), **kw)
    yield f"aten.{name} on a strided view", strided
    yield f"aten.{name} on a channels-last tensor", channels_last
    from .cpu import mkldnn_available
    if act != "gelu_tanh" and dtype == torch.float32 and mkldnn_available():
        yield f"oneDNN convolution with the {post_op} post-op (ConvBiasAct)", \
            _conv_post_op(post_op, algorithm)


def _classes_differ(got: torch.Tensor, want: torch.Tensor) -> Optional[int]:
    """The first index where ``got`` and ``want`` differ in NaN-ness, inf-ness or the
    value of an inf; None when they agree everywhere."""
    bad = (torch.isnan(got) != torch.isnan(want)) | (torch.isinf(got) != torch.isinf(want)) \
        | (torch.isinf(want) & (got != want))
    idx = torch.nonzero(bad)
    return int(idx[0]) if idx.numel() else None


@functools.lru_cache(maxsize=None)
def special_values_differ(act: str, dtype: torch.dtype) -> Optional[str]:
    """None when every CPU kernel a fused ``act`` node can run as gives NaN and ±inf
    exactly where the spelled-out formula (`formula`) does for ``dtype`` inputs; else one
    line naming the kernel, the input and both results (the fusion's Skip reason, and the
    reason a model file fused that way is refused on this CPU).

    ``act``: one of `FORMULAS` ("gelu" (erf), "gelu_tanh", "silu", and the norms
    "rms_norm", "layer_norm", probed by `cpu_norm_values.norm_differs`); ``dtype``: a
    floating torch dtype. A kernel that raises for this dtype is reported as a difference
    (the fusion must not rely on it). Cached per (act, dtype). Raises KeyError for another
    ``act``. Source of the fault it guards against: pytorch/pytorch#185770 (oneDNN's
    AVX-512 exact GELU returns NaN for +inf)."""
    if act in NORMS:
        return norm_differs(act, dtype)
    x = _probe_input(dtype)
    want = formula(x, act)
    for name, f in _kernels(act, dtype):
        try:
            got = f(x)
        except (RuntimeError, TypeError, ValueError) as e:
            return f"{name} fails for {dtype} on this CPU ({str(e).splitlines()[0]})"
        i = _classes_differ(got, want)
        if i is not None:
            return (f"{name} gives {act}({x[i].item():g}) = {got[i].item():g} on this CPU "
                    f"where the spelled-out formula gives {want[i].item():g} "
                    f"(pytorch/pytorch#185770)")
    return None


__all__ = ["ACTS", "FORMULAS", "formula", "special_values_differ"]
