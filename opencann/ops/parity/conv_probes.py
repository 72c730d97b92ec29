"""The convolution post-op probes: does oneDNN's convolution with a fused activation (or
sum) give eager's convolution-then-op at eager's layout of the convolution's output?

On AVX-512, ATen sends contiguous fp32/bf16 GELU to oneDNN's ``eltwise_gelu_erf``
(gelu(+inf) = NaN) and channels-last or strided tensors to its own loop (gelu(+inf) =
+inf; pytorch/pytorch#185770), so a oneDNN convolution with GELU as its post-op may or
may not be eager's GELU depending on the layout eager ran it at. `conv_post_op_differs`
(``FuseConvAct``) and `conv_sum_differs` (``FuseConvAddAct``) probe on this CPU with
`layout_probe.probe_tensor` inputs and compare with `layout_probe.values_differ`; each
answer is cached per argument tuple in memory and on disk (`probe.Probe`): 0.1-0.3 s
once per machine (oneDNN creates its primitives).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from ...devices.cpu import mkldnn_available
from ..kernels.conv_choice import ONEDNN_CONV_DTYPES
from .layout_probe import PROBE_SHAPE, at_layout, probe_tensor, values_differ, show_element
from .probe import Probe, register


# oneDNN post-op (name, algorithm) of each activation opencann fuses into a convolution
_POST_OPS = {"gelu": ("gelu", "none"), "tanh": ("tanh", ""), "sigmoid": ("sigmoid", ""),
             "silu": ("swish", "")}
_EAGER_ACT: Dict[str, Callable] = {
    "gelu": lambda t: torch.ops.aten.gelu(t), "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "silu": torch.nn.functional.silu, "relu": torch.relu}


def _identity_conv(x: torch.Tensor, post_op: str = "none", algorithm: str = "",
                   other: Optional[torch.Tensor] = None, inplace: bool = False) -> torch.Tensor:
    """oneDNN's convolution (``mkldnn._convolution_pointwise``, ConvBiasAct/ConvAddAct's
    kernel) as an identity: depthwise 1×1, weight 1, no bias; with ``other`` its binary
    "add" post-op (in place into ``other`` when ``inplace``)."""
    c = x.shape[1]
    w = torch.ones(c, 1, 1, 1, dtype=x.dtype)
    conv = (0, 0), (1, 1), (1, 1), c
    if other is None:
        return torch.ops.mkldnn._convolution_pointwise(x, w, None, *conv, post_op, [], algorithm)
    if inplace:
        return torch.ops.mkldnn._convolution_pointwise_.binary(other, x, w, None, *conv, "add",
                                                               None, None, [], "")
    return torch.ops.mkldnn._convolution_pointwise.binary(x, other, w, None, *conv, "add",
                                                          None, None, [], "")


def _conv_post_op_differs(act: str, dtype: torch.dtype, layout: str) -> Optional[str]:
    """None when a oneDNN convolution with ``act`` fused ("gelu" (erf), "tanh", "sigmoid",
    "silu" as its post-op; "relu" as eager's in-place ReLU on oneDNN's output, as
    ``ConvBiasAct`` runs it) gives the values of the convolution alone followed by
    eager's ``act`` on its output laid out as ``layout`` (eager's layout of the conv's
    output: one of `LAYOUTS`), on this CPU, for inputs of ``dtype``; else one line naming
    the input and both results (`FuseConvAct`'s Skip reason). Probed with the input both
    contiguous and channels-last; a kernel that raises is a difference. Raises KeyError for another ``act``."""
    eager = _EAGER_ACT[act]
    post_op, algorithm = _POST_OPS.get(act, ("none", ""))
    if not mkldnn_available():
        return "oneDNN (mkldnn) is not available in this torch build"
    x = probe_tensor(dtype, PROBE_SHAPE)
    for in_lay in ("contiguous", "channels_last"):
        xi = at_layout(x, in_lay)
        try:
            fused = _identity_conv(xi, post_op, algorithm)
            if act == "relu":
                fused = torch.relu_(fused)
            want = eager(at_layout(_identity_conv(xi), layout))
        except (RuntimeError, TypeError, ValueError) as e:
            return f"oneDNN's convolution with {act} fails for {dtype} ({str(e).splitlines()[0]})"
        i = values_differ(fused, want)
        if i is not None:
            return (f"oneDNN's convolution with the {act} post-op gives {act}({show_element(x, i)}) = "
                    f"{show_element(fused, i)} on this CPU where eager's {act} on the {layout} "
                    f"convolution output gives {show_element(want, i)} (pytorch/pytorch#185770)")
    return None


def _conv_sum_differs(relu: bool, dtype: torch.dtype, layout: str, other_layout: str) -> Optional[str]:
    """None when oneDNN's convolution with the binary "add" post-op (in and out of place,
    then eager's in-place ReLU when ``relu``: ``ConvAddAct``'s kernel) gives the values of
    the convolution alone laid out as ``layout``, plus the addend laid out as
    ``other_layout`` with eager's ``add`` (then ``relu``), on this CPU for ``dtype``; else
    one line naming the inputs and both results (`FuseConvAddAct`'s Skip reason)."""
    if not mkldnn_available():
        return "oneDNN (mkldnn) is not available in this torch build"
    x = probe_tensor(dtype, PROBE_SHAPE)
    other = probe_tensor(dtype, PROBE_SHAPE, shift=1)
    for in_lay in ("contiguous", "channels_last"):
        xi = at_layout(x, in_lay)
        conv = _identity_conv(xi)
        want = torch.add(at_layout(conv, layout), at_layout(other, other_layout))
        want = torch.relu(want) if relu else want
        for inplace in (False, True) if other_layout != "strided" else (False,):
            try:
                o = at_layout(other, other_layout).clone(memory_format=torch.preserve_format)
                fused = _identity_conv(xi, other=o, inplace=inplace)
                fused = torch.relu_(fused) if relu else fused
            except (RuntimeError, TypeError, ValueError) as e:
                return f"oneDNN's convolution with the sum post-op fails for {dtype} ({e})"
            i = values_differ(fused, want)
            if i is not None:
                what = "sum + ReLU" if relu else "sum"
                return (f"oneDNN's convolution with the {what} post-op gives {show_element(fused, i)} "
                        f"for ({show_element(x, i)}, {show_element(other, i)}) on this CPU where eager's add"
                        f"{' + relu' if relu else ''} at the {layout} layout gives "
                        f"{show_element(want, i)}")
    return None


#: spatial positions (of a [7, 8, 6][:rank] input) of `_conv_low_differs`'s four specials
_PROBE_POSITIONS = {1: [(3,), (1,), (4,), (5,)], 2: [(2, 3), (4, 1), (5, 6), (6, 7)],
                    3: [(2, 4, 3), (4, 1, 2), (5, 6, 4), (6, 2, 5)]}
#: a run of `_low_conv_runs`: (its name, the input's layout, f(x, w, bias, out_shape) -> out)
_Run = Tuple[str, str, Callable[..., torch.Tensor]]


def _low_conv_inputs(cin: int, cout: int, groups: int, kernel: tuple,
                     transposed: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, weight, bias) in fp32 for `_conv_low_differs`: seeded randn, x [2, cin, 7, 8,
    6][:2 + rank] with NaN, +inf, -inf, NaN in a few pixels' first, middle and last
    channels."""
    g = torch.Generator().manual_seed(0)
    rank = len(kernel)
    x = torch.randn(2, cin, *(7, 8, 6)[:rank], generator=g)
    # a first channel's special at a position odd along the last dim and even along the
    # others: the pixel before it, which the pad lane reads it into, is one a stride of 2
    # samples too (Conv2d(17, 8, 1, stride=2))
    for (n, c), v, pos in zip(((0, 0), (0, cin - 1), (1, cin // 2), (1, 0)),
                              (float("nan"), float("inf"), float("-inf"), float("nan")),
                              _PROBE_POSITIONS[rank]):
        x[(n, c) + pos] = v
    w = torch.randn(*((cin, cout // groups) if transposed else (cout, cin // groups)), *kernel,
                    generator=g)
    return x, w, torch.randn(cout, generator=g)


def _onednn_conv_runs(conv: tuple, xshape: list, dtype: torch.dtype) -> List[_Run]:
    """The runs of oneDNN's 2-D convolution a ConvBiasAct / ConvAddAct node binds
    (``make_conv_kernel``): ``mkldnn._convolution_pointwise`` and its binary "add" post-op
    out of and in place (into a zero addend), each on the plain weight (a weight that is no
    constant: oneDNN reorders it every call) and on the weight reordered to oneDNN's
    blocked layout for ``xshape`` (a constant weight, as bound: ``_reorder_convolution_
    weight``, the plain one where that raises, as at bind). ``conv``: (padding, stride,
    dilation, groups)."""
    pad, stride, dil, groups = conv
    ops = torch.ops.mkldnn

    def reordered(w):
        try:
            return ops._reorder_convolution_weight(w, pad, stride, dil, groups, xshape)
        except (RuntimeError, AttributeError):
            return w

    def pointwise(prep):
        return lambda x, w, b, _: ops._convolution_pointwise(x, prep(w), b, *conv, "none", [], "")

    def add(prep, inplace):
        def run(x, w, b, shape):
            other = torch.zeros(shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
            if inplace:
                return ops._convolution_pointwise_.binary(other, x, prep(w), b, *conv, "add",
                                                          None, None, [], "")
            return ops._convolution_pointwise.binary(x, other, prep(w), b, *conv, "add",
                                                     None, None, [], "")
        return run

    runs: List[_Run] = []
    for wname, prep in (("plain", lambda w: w), ("blocked (reordered)", reordered)):
        runs += [(f"oneDNN's convolution on its {wname} weight", "channels_last", pointwise(prep)),
                 (f"oneDNN's convolution with the sum post-op on its {wname} weight",
                  "channels_last", add(prep, False)),
                 (f"oneDNN's convolution with the in-place sum post-op on its {wname} weight",
                  "channels_last", add(prep, True))]
    return runs


def _aten_conv(conv: tuple, rank: int, transposed: bool) -> Callable[..., torch.Tensor]:
    """ATen's ``convolution`` as ``f(x, w, bias, out_shape=None)`` for ``conv`` (padding,
    stride, dilation, groups; no padding when ``transposed``) over ``rank`` spatial dims:
    the kernel of a Conv2D node, and eager's fp32 reference."""
    pad, stride, dil, groups = conv
    aten = torch.ops.aten.convolution
    return lambda x, w, b, _=None: aten(x, w, b, stride, [0] * rank if transposed else pad, dil,
                                        transposed, [0] * rank, groups)


def _low_conv_runs(rank: int, transposed: bool, dtype: torch.dtype, conv: tuple,
                   xshape: list) -> List[_Run]:
    """Every kernel a ``dtype`` convolution node of this kind may bind on the cpu: ATen's
    ``convolution`` (a Conv2D node) at the contiguous layout and, for 2-D and 3-D ones,
    at channels-last; for a 2-D, not transposed one in a dtype of oneDNN's fused
    convolution (`ONEDNN_CONV_DTYPES`: ``fuse_conv_act`` makes it a ConvBiasAct) oneDNN's
    runs too (`_onednn_conv_runs`). ``conv``: (padding, stride, dilation, groups)."""
    run_aten = _aten_conv(conv, rank, transposed)
    runs: List[_Run] = [("ATen's convolution at the contiguous layout", "contiguous", run_aten)]
    if rank in (2, 3):
        runs.append(("ATen's convolution at channels-last", "channels_last", run_aten))
    if rank == 2 and not transposed and dtype in ONEDNN_CONV_DTYPES and mkldnn_available():
        runs += _onednn_conv_runs(conv, xshape, dtype)
    return runs


def _conv_low_differs(cin: int, cout: int, groups: int, kernel: tuple, stride: tuple,
                      dilation: tuple, dtype: torch.dtype, transposed: bool = False) -> Optional[str]:
    """None when a ``dtype`` (bf16 / fp16) convolution of this configuration (``cin`` /
    ``cout`` channels in all, ``groups``, ``kernel`` / ``stride`` / ``dilation`` per
    spatial dim: 1, 2 or 3 of them; ``transposed``; padding k // 2, none when transposed)
    gives NaN and ±inf where eager's fp32 convolution of the same values does, through
    every kernel the bound node may run (`_low_conv_runs`: ATen's at both layouts; for a
    2-D one in bf16 oneDNN's on the plain and the reordered weight, alone and with the
    sum post-op), with and without a bias; else one line naming the first difference.
    Values otherwise differ by the rounding, which is not compared.
    Why: oneDNN's bf16 convolution sums products two input channels at a time
    (``vdpbf16ps``); with an odd channel count a pair reads the next pixel's first channel
    against a zero weight, and a NaN or inf there (NaN × 0) turns a neighbour's finite
    output NaN: Conv2d(3, 5, 1), Conv1d(3, 5, 3), Conv3d(3, 4, 3), ConvTranspose2d(3, 5, 2)
    on this CPU, and Conv2d(1, 8, 1) on the reordered weight only."""
    rank = len(kernel)
    x, w, bias = _low_conv_inputs(cin, cout, groups, kernel, transposed)
    conv = ([k // 2 for k in kernel], list(stride), list(dilation), groups)
    fmt = torch.channels_last if rank == 2 else torch.channels_last_3d
    wants = [(b, _aten_conv(conv, rank, transposed)(x, w, b)) for b in (bias, None)]
    for name, lay, run in _low_conv_runs(rank, transposed, dtype, conv, list(x.shape)):
        xl = x.to(dtype)
        xl = xl.contiguous(memory_format=fmt) if lay == "channels_last" else xl
        for b, want in wants:
            what = f"{name}{' with a bias' if b is not None else ''}"
            try:
                got = run(xl, w.to(dtype), None if b is None else b.to(dtype), want.shape).float()
            except (RuntimeError, TypeError, ValueError) as e:
                return f"{what} fails for {dtype} ({str(e).splitlines()[0]})"
            bad = ~(torch.isnan(got) == torch.isnan(want)) | ~(got.isinf() == want.isinf()) \
                | (want.isinf() & (got.sign() != want.sign()))
            if bad.any():
                i = int(bad.reshape(-1).nonzero()[0])
                return (f"{what} in {str(dtype).replace('torch.', '')} gives {show_element(got, i)} "
                        f"where eager's fp32 convolution gives {show_element(want, i)} (a NaN or inf "
                        f"in a neighbouring position; {cin // groups} input channels per group)")
    return None


CONV_LOW_PROBE = register(Probe(
    "conv_low_precision", guards="MixedPrecision (passes/prepare/precision.py): a Conv2D "
    "lowered to bf16 / fp16",
    kernel="ATen's bf16 / fp16 convolution (1-, 2-, 3-D, transposed) contiguous and "
    "channels-last; for a 2-D bf16 one oneDNN's (ConvBiasAct / ConvAddAct) on the plain and "
    "the reordered weight, alone and with the sum post-op in and out of place",
    inputs="seeded randn with NaN, +inf and -inf in a few pixels' first, middle and last "
    "channels; with and without a bias",
    run=_conv_low_differs, version=5))


def conv_low_precision_differs(cin: int, cout: int, groups: int, kernel: tuple, stride: tuple,
                               dilation: tuple, dtype: torch.dtype,
                               transposed: bool = False) -> Optional[str]:
    """`_conv_low_differs`, cached per configuration in memory and on disk."""
    return CONV_LOW_PROBE(int(cin), int(cout), int(groups), tuple(int(k) for k in kernel),
                          tuple(int(k) for k in stride), tuple(int(k) for k in dilation), dtype,
                          bool(transposed))


CONV_POST_OP_PROBE = register(Probe(
    "conv_post_op", guards="FuseConvAct (passes/fusion/conv_act.py): ConvBiasAct's post-op",
    kernel="oneDNN's convolution with the activation as its post-op "
    "(mkldnn._convolution_pointwise)",
    inputs="a depthwise identity 1×1 convolution of a `probe_tensor`, contiguous and channels-last",
    run=_conv_post_op_differs))
CONV_SUM_PROBE = register(Probe(
    "conv_sum", guards="FuseConvAddAct (passes/fusion/conv_add_act.py): ConvAddAct's sum [+ ReLU]",
    kernel="oneDNN's convolution with the binary add post-op, in and out of place",
    inputs="a depthwise identity 1×1 convolution of a `probe_tensor` and a second one as the addend",
    run=_conv_sum_differs))


def conv_post_op_differs(act: str, dtype: torch.dtype, layout: str) -> Optional[str]:
    """`_conv_post_op_differs`, cached per (act, dtype, layout) in memory and on disk."""
    return CONV_POST_OP_PROBE(act, dtype, layout)


def conv_sum_differs(relu: bool, dtype: torch.dtype, layout: str, other_layout: str) -> Optional[str]:
    """`_conv_sum_differs`, cached per (relu, dtype, layout, other_layout) in memory and
    on disk."""
    return CONV_SUM_PROBE(bool(relu), dtype, layout, other_layout)


__all__ = ["CONV_LOW_PROBE", "CONV_POST_OP_PROBE", "CONV_SUM_PROBE", "conv_low_precision_differs",
           "conv_post_op_differs", "conv_sum_differs"]
