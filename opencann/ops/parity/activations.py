"""The activation probes: does every CPU kernel a fused GELU (erf or tanh form) or SiLU
node can run as keep NaN and ±inf where the spelled-out formula does?

A fusion that replaces a formula written out in elementwise ops by one library kernel is
exact only if the kernel gives the formula's NaN and ±inf: otherwise a compiled model
returns NaN where eager returned inf, silently. For GELU that depends on the machine, not
only on torch's version: ATen sends contiguous fp32/bf16 CPU tensors to oneDNN's
``eltwise_gelu_erf``, whose AVX-512 code returns NaN for +inf while the AVX2 code and the
written-out ``0.5·x·(1 + erf(x/√2))`` return +inf (pytorch/pytorch#185770, #187293; a fix
proposed in pytorch/pytorch#192318 would also turn gelu(-inf) from NaN into 0, which the
formula does not give either).

`activation_differs(act, dtype)` runs every kernel of `kernels` (ATen's functional,
``.out`` and in-place op on contiguous, strided and channels-last tensors, and, for
fp32, oneDNN's convolution with the activation as its post-op, which ``FuseConvAct``
makes of the activation after a Conv2D) on `specials.ACTIVATION_SPECIALS` (NaN, ±inf,
±3e38, ±1e13, whose cube overflows in GELU's tanh form) placed at the head, the vector
body and the tail of a 1000-element tensor, and compares each result with `formulas.
formula` evaluated by eager's own ops (`compare.first_difference`: NaN positions, inf
positions and signs).
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Tuple

import torch

from ...devices.cpu import mkldnn_available
from .compare import first_difference
from .formulas import formula
from .specials import ACTIVATION_SPECIALS

ACTS = ("gelu", "gelu_tanh", "silu")
_N = 1000                      # a length with a vector body and a scalar tail
_AT = (0, 1, 2, 3, 4, 5, 6, 497, 498, 499, 500, 501, 502, 503, 993, 994, 995, 996, 997, 998, 999)
# act -> (ATen op, its keyword arguments, oneDNN post-op name and algorithm)
_OPS = {"gelu": ("gelu", {"approximate": "none"}, ("gelu", "none")),
        "gelu_tanh": ("gelu", {"approximate": "tanh"}, ("gelu", "tanh")),
        "silu": ("silu", {}, ("swish", "")),
        # not formula fusions: `activation_low` probes their bf16 / fp16 kernels
        "tanh": ("tanh", {}, ("tanh", "")), "sigmoid": ("sigmoid", {}, ("sigmoid", ""))}


def probe_input(dtype: torch.dtype) -> torch.Tensor:
    """linspace(-4, 4) over 1000 elements with `ACTIVATION_SPECIALS` (cycling) at the
    head, the middle and the tail, in ``dtype``."""
    x = torch.linspace(-4.0, 4.0, _N, dtype=torch.float64)
    for i, at in enumerate(_AT):
        x[at] = ACTIVATION_SPECIALS[i % len(ACTIVATION_SPECIALS)]
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


def kernels(act: str, dtype: torch.dtype) -> Iterator[Tuple[str, Callable]]:
    """(name, f) of each CPU kernel a fused ``act`` node ("gelu", "gelu_tanh", "silu";
    "tanh", "sigmoid" too) may run as, ATen's functional first; ``f(x) -> act(x)`` on a
    contiguous 1-D ``x``, the same layout out. Raises KeyError for another ``act``."""
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
    if act != "gelu_tanh" and dtype == torch.float32 and mkldnn_available():
        yield f"oneDNN convolution with the {post_op} post-op (ConvBiasAct)", \
            _conv_post_op(post_op, algorithm)


def activation_differs(act: str, dtype: torch.dtype) -> Optional[str]:
    """None when every kernel of `kernels` gives NaN and ±inf exactly where the
    spelled-out formula does for ``dtype`` inputs, else one line naming the kernel, the
    input and both results. A kernel that raises is reported as a difference. Uncached
    (`special_values.special_values_differ` caches it). Raises KeyError for another
    ``act``."""
    if act not in ACTS:
        raise KeyError(act)
    x = probe_input(dtype)
    want = formula(x, act)
    for name, f in kernels(act, dtype):
        try:
            got = f(x)
        except (RuntimeError, TypeError, ValueError) as e:
            return f"{name} fails for {dtype} on this CPU ({str(e).splitlines()[0]})"
        i = first_difference(got, want)
        if i is not None:
            return (f"{name} gives {act}({x[i].item():g}) = {got[i].item():g} on this CPU "
                    f"where the spelled-out formula gives {want[i].item():g} "
                    f"(pytorch/pytorch#185770)")
    return None


__all__ = ["ACTS", "activation_differs", "kernels", "probe_input"]
