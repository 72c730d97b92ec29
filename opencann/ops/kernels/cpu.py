"""CPU kernels of opencann's fused ops: bind-time factories ``f(node, in_descs, consts)
-> callable(*inputs)`` (an `OpDef`'s ``kernel_factories["cpu"]``).

- `make_conv_kernel` (ConvBiasAct, ConvAddAct): Conv2D (BatchNorm folded into weight and
  bias) + activation as one oneDNN convolution with a fused post-op
  (``torch.ops.mkldnn._convolution_pointwise``) on a weight reordered once to oneDNN's
  blocked layout (``_reorder_convolution_weight``); Conv2D + residual Add (+ ReLU) as
  oneDNN's ``sum`` post-op, written in place into the addend's buffer
  (``_convolution_pointwise_.binary``).
- ReLU is never a oneDNN post-op: oneDNN's drops NaN (max(x, 0)) and, after ``sum``,
  clamps +inf to FLT_MAX; it runs in place after the convolution with eager's kernel.
  GELU (erf), tanh, sigmoid and swish post-ops match eager's NaN/Inf positions (tested
  in tests/test_nan_semantics.py).
- `make_linear_kernel` (LinearAct): MatMulV2 (addmm) [+ activation] into the planned
  buffer, by addmm or MKL's packed GEMM (chosen per shape by measuring both at bind
  time); the activation runs in place on the result (one pass less over the output).

Source: oneDNN "Primitive Attributes: Post-ops" (oneapi-src.github.io/oneDNN), the same
kernels PyTorch Inductor uses for CPU freezing (torch/_inductor/fx_passes/mkldnn_fusion.py).
A kernel keeps no per-call state: one bound kernel serves every executor of its graph,
including calls running at once on several threads (``opencann.runtime.pool``).
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, Sequence

import torch

from ...devices.cpu import best_time_us, mkl_packed_available
from ...ir import Node, TensorDesc

_ACT_FN: Dict[str, Callable] = {  # in-place activations
    "relu": torch.relu_, "gelu": torch.ops.aten.gelu_, "tanh": torch.tanh_,
    "sigmoid": torch.sigmoid_, "silu": lambda t: torch.nn.functional.silu(t, inplace=True),
    "gelu_tanh": lambda t: torch.ops.aten.gelu_(t, approximate="tanh"),
}
_ONEDNN_ACT = {"none": "none", "relu": "relu", "gelu": "gelu", "tanh": "tanh",
               "sigmoid": "sigmoid", "silu": "swish"}


def _conv_weight(node: Node, x: TensorDesc, w: torch.Tensor) -> torch.Tensor:
    """Reorder the conv weight once into oneDNN's blocked layout for this input size."""
    a = node.attrs
    try:
        return torch.ops.mkldnn._reorder_convolution_weight(
            w, a["padding"], a["stride"], a["dilation"], a["groups"], list(x.shape))
    except (RuntimeError, AttributeError):
        return w


def _conv_add_kernel(wp, conv_args: tuple, unary, post, inplace: bool) -> Callable:
    """ConvAddAct's ``run(x, w[, bias], other)``: oneDNN's binary "add" post-op, written
    into ``other`` when ``inplace``; ``wp``: the reordered constant weight or None;
    ``conv_args``: (padding, stride, dilation, groups); ``post``: an in-place ReLU or None."""
    pad, stride, dil, groups = conv_args
    if inplace:
        f = torch.ops.mkldnn._convolution_pointwise_.binary

        def run(x, w, *rest):  # (x, w[, bias], other)
            b, other = (rest[0], rest[1]) if len(rest) == 2 else (None, rest[0])
            y = f(other, x, w if wp is None else wp, b, pad, stride, dil, groups, "add",
                  None, unary, [], "")
            return y if post is None else post(y)
    else:
        f = torch.ops.mkldnn._convolution_pointwise.binary

        def run(x, w, *rest):  # (x, w[, bias], other)
            b, other = (rest[0], rest[1]) if len(rest) == 2 else (None, rest[0])
            y = f(x, other, w if wp is None else wp, b, pad, stride, dil, groups, "add",
                  None, unary, [], "")
            return y if post is None else post(y)
    return run


def make_conv_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """Bind-time kernel of a ConvBiasAct or ConvAddAct node: one oneDNN convolution
    (``torch.ops.mkldnn._convolution_pointwise``) with the node's activation as a post-op.

    ``node.attrs``: ``padding``, ``stride``, ``dilation`` (pairs), ``groups``, ``act`` (none,
    relu, gelu (erf), tanh, sigmoid, silu) and, for ConvAddAct, ``inplace``. ``in_descs[0]``:
    the NCHW input's description (sizes the weight reorder); ``consts[1]``: the weight
    tensor (O, I/groups, KH, KW) when it is a constant, reordered once here to oneDNN's
    blocked layout for that input size, else None (reordered by oneDNN on every call).
    Returns ``run(x, w[, bias])`` for ConvBiasAct and ``run(x, w[, bias], other)`` for
    ConvAddAct (the sum post-op adds ``other``; with ``inplace`` it writes into ``other``'s
    memory and returns it); the result, in x's dtype, may be channels-last (the executor
    restores eager's strides where they are observed). ReLU runs after the convolution
    with ``torch.relu_`` (see the module docstring). Raises KeyError for an activation
    without a oneDNN post-op (the fusion passes never make one)."""
    a = node.attrs
    w = consts[1]
    # a constant weight is reordered once; otherwise oneDNN reorders it on every call
    wp = _conv_weight(node, in_descs[0], w) if w is not None else None
    pad, stride, dil, groups = a["padding"], a["stride"], a["dilation"], a["groups"]
    act = _ONEDNN_ACT[a["act"]]
    algorithm = "none" if act == "gelu" else ""   # oneDNN's exact (erf) GELU
    conv = torch.ops.mkldnn._convolution_pointwise
    # oneDNN's ReLU post-op (every variant: relu, leaky_relu(0), hardtanh(0, inf)) turns
    # NaN into 0, and after the sum post-op +inf into FLT_MAX; eager's ReLU keeps both.
    # So ReLU runs in place on the convolution's output with eager's kernel (torch.relu_):
    # one more pass over the output, measured at under 1% of ResNet-50's latency.
    post = None
    if act == "relu":
        act, post = "none", torch.relu_

    if node.op == "ConvAddAct":
        return _conv_add_kernel(wp, (pad, stride, dil, groups), None if act == "none" else act,
                                post, a.get("inplace", True))

    if post is not None:
        def run(x, w, b=None):
            return post(conv(x, w if wp is None else wp, b, pad, stride, dil, groups, act, [],
                             algorithm))
        return run

    # oneDNN returns channels-last; where a view reads the result or the caller gets it,
    # the executor brings it back to the traced (eager) strides
    def run(x, w, b=None):
        return conv(x, w if wp is None else wp, b, pad, stride, dil, groups, act, [], algorithm)
    return run


def make_trans_data(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """CPU TransData between NHWC (channels-last strides) and NCHW of one logical 4-D
    tensor (``opencann.passes.layout.cpu_layout``): ``run(x, out=None)`` copies ``x`` into
    ``out`` (its planned buffer, laid out as the node's ``meta["strides"]``) or into a
    fresh tensor with those strides (contiguous when none are recorded). The logical
    shape and dtype do not change; only the element order in memory does."""
    d = node.outputs[0].desc
    shape = tuple(int(s) for s in d.shape)
    st = (node.meta.get("strides") or [None])[0]
    strides = tuple(st) if st is not None else torch.empty(shape, device="meta").stride()
    dtype = d.dtype.torch

    def run(x, out=None):
        if out is None:
            out = torch.empty_strided(shape, strides, dtype=dtype)
        return out.copy_(x)
    return run


# (m, k, n, dtype) -> "mkl_packed" | "addmm": bind-time choice, measured once per shape
LINEAR_CHOICES: Dict[tuple, str] = {}
_LINEAR_CHOICES_LOCK = threading.Lock()  # one measurement per shape, even when binding races


def _measure_choice(key: tuple, run_addmm: Callable, run_packed: Callable, bias, wt) -> str:
    """"mkl_packed" or "addmm" for GEMM shape ``key`` = (m, k, n, dtype): both kernels
    timed on random data (best of 5), packed chosen when 3% faster; cached in
    `LINEAR_CHOICES` (one measurement per shape, even when binding races)."""
    m, k, n = key[:3]
    with _LINEAR_CHOICES_LOCK:
        choice = LINEAR_CHOICES.get(key)
        if choice is None:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(m, k, generator=g)
            b = bias if bias is not None else torch.zeros(n)
            out = torch.empty(m, n)
            t_addmm = best_time_us(lambda: run_addmm(b, x, wt, out))
            t_packed = best_time_us(lambda: run_packed(b, x, wt, out))
            choice = "mkl_packed" if t_packed < 0.97 * t_addmm else "addmm"
            LINEAR_CHOICES[key] = choice
    return choice


def make_linear_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """LinearAct(bias, x, w_t, out=buffer) = act(x @ w_t + bias), written into ``out``.

    Two GEMM kernels compete per shape (m, k, n), measured once at bind time on random
    data and cached in `LINEAR_CHOICES` (autotuning, as Inductor's max-autotune does):
    ``addmm`` with the bias as its C operand straight into ``out``, and MKL's packed GEMM
    (``torch.ops.mkl._mkl_linear`` on a weight packed once by ``_mkl_reorder_linear_weight``)
    whose result is copied into ``out``. Measured on this 2-core AVX2 machine: packed is
    5-19% faster at k or n >= 768 and slower at 384. The activation then runs in place."""
    post = _ACT_FN.get(node.attrs["act"])
    addmm, addmm_out = torch.ops.aten.addmm.default, torch.ops.aten.addmm.out

    def run_addmm(b, x, w, out=None):
        r = addmm(b, x, w) if out is None else addmm_out(b, x, w, out=out)
        if post is not None:
            post(r)
        return r

    wt = consts[2]
    x_desc = in_descs[1]
    if not (mkl_packed_available() and wt is not None and x_desc.rank == 2
            and x_desc.dtype.torch == torch.float32 and wt.dtype == torch.float32):
        return run_addmm
    if node.meta.get("kernel") == "addmm":  # chosen before (e.g. a loaded model): no packing
        return run_addmm
    m, k = (int(d) for d in x_desc.shape)
    n = int(wt.shape[1])
    key = (m, k, n, str(wt.dtype))
    # a choice already made for this node (an earlier bind, or a loaded model file) holds,
    # so every executor of a model, saved or live, runs the same GEMM (same bits)
    choice = node.meta.get("kernel") if node.meta.get("kernel") in ("addmm", "mkl_packed") \
        else LINEAR_CHOICES.get(key)
    if choice == "addmm":  # no packing: it copies the weight twice for nothing
        node.meta["kernel"] = choice
        return run_addmm
    w = wt.t().contiguous()  # (out_features, in_features)
    packed = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
    lin = torch.ops.mkl._mkl_linear

    def run_packed(b, x, _w, out=None):
        r = lin(x, packed, w, b, m)
        if out is not None:
            out.copy_(r)
            r = out
        if post is not None:
            post(r)
        return r

    if choice is None:
        choice = _measure_choice(key, run_addmm, run_packed, consts[0], wt)
    node.meta["kernel"] = choice
    return run_packed if choice == "mkl_packed" else run_addmm


__all__ = ["LINEAR_CHOICES", "make_conv_kernel", "make_linear_kernel", "make_trans_data"]
