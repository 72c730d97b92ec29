"""CPU kernels of opencann's int8 ops (``ops/quant.py``): bind-time factories
``f(node, in_descs, consts) -> callable(*inputs)``.

- `make_ascend_quant_kernel` (AscendQuant): fp32 or bf16 → uint8, ``saturate(round_half_even(x /
  step) + offset)`` to [0, 255], the layout of ``x`` kept (channels-last stays
  channels-last, so the convolution after it reads it without a reorder). NaN gives 0
  (the type's minimum, as ONNX Runtime's QuantizeLinear), +inf 255, -inf 0: quantization
  saturates.
- `make_quant_conv_kernel` (QuantConvBiasAct, QuantConvAddAct): oneDNN's int8 convolution
  (``torch.ops.onednn.qconv2d_pointwise``; VNNI / AMX-int8 where the CPU has them) on a
  uint8 activation (per-tensor step and offset) and an int8 weight with one symmetric
  scale per output channel, prepacked once per input size and thread count at bind time
  (``onednn.qconv_prepack``). The fp32 result is dequantized inside the kernel (oneDNN's
  output scales: CANN's AscendDequant fused into the convolution), bias and ReLU as
  post-ops; a uint8 result at the next layer's scale when the ``fuse_requant`` pass set
  ``out_scale`` / ``out_offset`` (CANN's AscendRequant fused: oneDNN's output scale and
  zero point); the residual Add as oneDNN's ``sum`` post-op written into the fp32 addend
  (``qconv2d_pointwise.binary``). After ``sum`` the ReLU runs with eager's in-place
  kernel: the fp32 addend may hold NaN/±inf, which oneDNN's ReLU would drop.
- `make_quant_linear_kernel` (QuantLinearAct): oneDNN's int8 inner product
  (``onednn.qlinear_pointwise``) on the int8 weight prepacked once at bind time
  (``onednn.qlinear_prepack``); fp32 output (bf16 inside a bf16 graph: oneDNN's
  ``output_dtype``), bias and ReLU / GELU (erf or tanh) as post-ops (or uint8 with
  ``out_scale`` / ``out_offset``, as the convolution). Dynamic quantization
  (``attrs["dynamic"]``): x comes in fp32 (or bf16) and its step and offset are taken
  per call from its min / max (ONNX DynamicQuantizeLinear's rule: the range widened to
  include 0, uint8).

oneDNN runs a layer where its uint8 x int8 products are exact for that layer's weight
(`onednn_takes`, checked once at bind time): on every CPU with VNNI / AMX-int8, and on x86
without them when max |w| <= 64 (`opencann.devices.cpu.int8_weight_bound`: the 7-bit
weights `opencann.quantize` gives there); any other layer (8-bit weights quantized on a
VNNI host, an ONNX file's int8 weights) runs the same arithmetic in fp32 (`int8_emulated`).
Both give the same values to fp32 rounding, the same NaN/Inf and the same output dtype.

These are the kernels PyTorch Inductor's x86 int8 path binds (torch/_inductor/fx_passes/
quantization.py, the X86InductorQuantizer flow); no GEMM is written here. Source of the
scheme (uint8 activations with a zero point, int8 symmetric per-channel weights): oneDNN
developer guide, "Int8 Inference"; ONNX Runtime's default QDQ (QUInt8 activations,
QInt8 per-channel weights).
"""
from __future__ import annotations

from typing import Callable, Sequence, Tuple

import torch

from ...devices.cpu import int8_weight_bound
from ...ir import Node, TensorDesc, TensorRef
from .cpu import _ACT_FN, ThreadPacks
from .int8_emulated import emulated_quant_conv, emulated_quant_linear
from .int8_quantize import QMAX, QMIN, dynamic_params, quantize_u8

_LINEAR_POST = {"relu": ("relu", ""), "gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh")}


def make_dynamic_quant_dequant_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """DynamicQuantDequant(x): x on the uint8 grid of ONNX DynamicQuantizeLinear, back in
    x's dtype: ``(quantize_u8(x, s, z) - z) * s`` with ``(s, z) = dynamic_params(x)`` per
    call, the very levels the dynamic QuantLinearAct's kernel quantizes x to (same range,
    same rounding: x * (1/s) in fp32, NaN → level 0, ±inf saturated). x fp32, fp16 or
    bf16, any shape; the arithmetic in fp32, the result cast to x's dtype. Returns
    ``run(x)`` giving a fresh tensor of x's shape and dtype."""
    def run(x):
        s, z = dynamic_params(x)
        q = quantize_u8(x if x.dtype in (torch.float32, torch.bfloat16) else x.float(), s, z)
        return ((q.to(torch.float32) - float(z)) * s).to(x.dtype)
    return run


def make_ascend_quant_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """AscendQuant(x) → uint8: ``node.attrs`` ``scale`` (CANN's: the reciprocal of the
    quantization step, y = round(x * scale) + offset) and ``offset`` (the zero point, in
    [0, 255]); with ``step`` too (an ONNX QuantizeLinear's scale), y = round(x / step) +
    offset, the division the ONNX specification writes. Returns ``run(x, out=None)``; x fp32 or bf16 (one numba pass reading it as
    it is; fp16 quantized through fp32), written into ``out`` when given (the op is
    ``out_capable`` on the CPU: the planned arena buffer; a fresh [128, 768] result cost
    ~20 µs more in BERT-base's call, docs/performance.md)."""
    divide = "step" in node.attrs   # ONNX QuantizeLinear: x / y_scale, the file's float32
    step = float(node.attrs["step"]) if divide else 1.0 / float(node.attrs["scale"])
    offset = int(node.attrs["offset"])

    def run(x, out=None):
        return quantize_u8(x, step, offset, out, divide)
    return run


def make_ascend_dequant_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """AscendDequant(x) → fp32: ``(x - offset) * scale`` (``node.attrs`` ``scale``: the step,
    ``offset``: the zero point), x uint8 (or int8); the difference is exact in fp32 and the
    product rounds once, as ONNX DequantizeLinear (ONNX Runtime). Returns ``run(x)``; x's
    layout kept. A dense x takes one numba pass (`quant_numba.dequantize_dense`, the same
    bits; uint8 [8, 2048, 7, 7]: 349 → 143 µs, least of 200 interleaved calls, load 5); any
    other the eager ops below."""
    from .quant_numba import dequantize_dense   # numba loads on the first int8 call only
    step, offset = float(node.attrs["scale"]), float(node.attrs["offset"])

    def run(x):
        y = dequantize_dense(x, step, offset)
        if y is not None:
            return y
        y = torch.empty_like(x, dtype=torch.float32)
        y.copy_(x)
        return y.sub_(offset).mul_(step)
    return run


def onednn_takes(w: torch.Tensor) -> bool:
    """Whether oneDNN's uint8 x int8 kernels compute exactly with the constant int8 weight
    ``w`` on this CPU: `int8_weight_bound` is 127 (VNNI / AMX-int8), or it is 64 (x86
    without VNNI: int16 pair sums) and max |w| <= 64; False where it is None. |w| is taken
    in int32 (|-128| does not fit int8)."""
    bound = int8_weight_bound()
    if bound is None:
        return False
    return bound >= 127 or max(int(w.max()), -int(w.min())) <= bound


def _tag(run: Callable, path: str) -> Callable:
    """``run`` with ``run.int8_path`` = ``path`` ("onednn" or "emulated"): which arithmetic
    the layer was bound to (for tests and reports)."""
    run.int8_path = path
    return run


def QConvWeightPacks(w: torch.Tensor, w_scale: torch.Tensor, x_step: float, x_offset: int,  # noqa: N802
                     conv_args: tuple, x_shape: list) -> ThreadPacks:
    """An int8 conv weight prepacked by ``onednn.qconv_prepack`` for one input size, once
    per intra-op thread count (`ThreadPacks`: oneDNN's blocking depends on the count)."""
    args = (w, w_scale, x_step, x_offset, *conv_args, x_shape)
    return ThreadPacks(lambda: torch.ops.onednn.qconv_prepack(*args))


def _act_after(act: str, native: Tuple[str, ...]):
    """(oneDNN post-op name, eager in-place activation or None) for ``act``: the ones in
    ``native`` run as post-ops, any other after the kernel with eager's in-place op."""
    if act in native:
        return act, None
    return "none", _ACT_FN.get(act)


def make_quant_conv_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """Bind-time kernel of QuantConvBiasAct / QuantConvAddAct.

    Inputs (``node.attrs`` TensorRefs): ``input`` uint8 [N, C, H, W] (NCHW or
    channels-last), ``weight`` a constant int8 [O, C/groups, KH, KW], ``w_scale`` a
    constant fp32 [O] (symmetric: zero points 0), optional ``bias`` fp32 [O], and for
    QuantConvAddAct ``other``, the fp32 addend [N, O, H', W'] (written in place when
    ``attrs["inplace"]``, as ConvAddAct). Attributes: ``stride``, ``padding``,
    ``dilation``, ``groups``, ``act`` (none, relu, or any in-place activation eager
    runs after), ``x_scale`` / ``x_offset`` (the input's step and zero point).
    Returns ``run(*inputs)`` giving fp32 [N, O, H', W'] (channels-last from oneDNN), or
    uint8 at ``out_scale`` / ``out_offset`` when the node's output is uint8 (``fuse_requant``);
    a uint8 QuantConvAddAct takes a uint8 addend at ``accum_scale`` / ``accum_offset`` and
    its ReLU as a oneDNN post-op (integers: no NaN to keep).
    Raises KeyError for a missing attribute (the quantize pass always sets them). Where
    oneDNN's int8 products are not exact for this weight (`onednn_takes`), the same
    arithmetic in fp32 (`int8_emulated`). ``run.int8_path`` says which ("onednn" or
    "emulated")."""
    a = node.attrs
    if not onednn_takes(consts[a["weight"].index]):
        return _tag(emulated_quant_conv(node, in_descs, consts), "emulated")
    conv_args = (list(a["stride"]), list(a["padding"]), list(a["dilation"]), int(a["groups"]))
    step, offset = float(a["x_scale"]), int(a["x_offset"])
    wi, si = a["weight"].index, a["w_scale"].index
    w_scale = consts[si].float()
    w_zp = torch.zeros(w_scale.numel(), dtype=torch.int64)
    packs = QConvWeightPacks(consts[wi], w_scale, step, offset, conv_args,
                             [int(d) for d in in_descs[a["input"].index].shape])
    bi = a["bias"].index if isinstance(a.get("bias"), TensorRef) else None
    xi = a["input"].index
    stride, pad, dil, groups = conv_args
    if node.op == "QuantConvAddAct":
        return _tag(_quant_conv_add(node, packs, w_scale, w_zp, xi, bi, conv_args), "onednn")

    act, post = _act_after(a["act"], ("none", "relu"))
    conv = torch.ops.onednn.qconv2d_pointwise
    o_scale, o_zp, o_dtype = _out_quant(node)

    def run(*ins):
        y = conv(ins[xi], step, offset, packs.get(), w_scale, w_zp, None if bi is None else ins[bi],
                 stride, pad, dil, groups, o_scale, o_zp, o_dtype, act, [], "")
        return y if post is None else post(y)
    return _tag(run, "onednn")


def _quant_conv_add(node: Node, packs: QConvWeightPacks, w_scale, w_zp, xi: int, bi, conv_args) -> Callable:
    """QuantConvAddAct's ``run``: ``qconv2d_pointwise.binary`` with the ``sum`` post-op into
    the addend (a copy of it unless ``attrs["inplace"]``): fp32 addend → fp32 result (ReLU
    after it with eager's op), uint8 addend at ``accum_scale`` / ``accum_offset`` → uint8
    result at ``out_scale`` / ``out_offset`` (ReLU as oneDNN's post-op)."""
    a = node.attrs
    step, offset = float(a["x_scale"]), int(a["x_offset"])
    stride, pad, dil, groups = conv_args
    oi = a["other"].index
    inplace = a.get("inplace", True)
    binary = torch.ops.onednn.qconv2d_pointwise.binary
    if node.outputs[0].desc.dtype.torch == torch.uint8:
        o_scale, o_zp, _ = _out_quant(node)
        a_scale, a_zp = float(a["accum_scale"]), int(a["accum_offset"])
        u_act = "relu" if a["act"] == "relu" else "none"

        def run_add_u8(*ins):
            other = ins[oi] if inplace else ins[oi].clone(memory_format=torch.channels_last)
            b = None if bi is None else ins[bi]
            return binary(ins[xi], step, offset, packs.get(), w_scale, w_zp, other, b, stride, pad,
                          dil, groups, o_scale, o_zp, torch.uint8, a_scale, a_zp, "sum", 1.0, u_act, [], "")
        return run_add_u8
    post = _ACT_FN.get(a["act"]) if a["act"] != "none" else None

    def run_add(*ins):
        other = ins[oi] if inplace else ins[oi].clone(memory_format=torch.channels_last)
        b = None if bi is None else ins[bi]
        y = binary(ins[xi], step, offset, packs.get(), w_scale, w_zp, other, b, stride, pad, dil,
                   groups, 1.0, 0, torch.float32, 1.0, 0, "sum", 1.0, "none", [], "")
        return y if post is None else post(y)
    return run_add


def _out_quant(node: Node) -> Tuple[float, int, torch.dtype]:
    """(output scale, zero point, dtype) for oneDNN: (``out_scale``, ``out_offset``, uint8)
    when the ``fuse_requant`` pass gave the node a uint8 output, (1.0, 0, bf16) for a
    bf16 output (a QuantLinearAct inside a bf16 graph), else (1.0, 0, fp32)."""
    dt = node.outputs[0].desc.dtype.torch
    if dt == torch.uint8:
        return float(node.attrs["out_scale"]), int(node.attrs["out_offset"]), torch.uint8
    return 1.0, 0, (torch.bfloat16 if dt == torch.bfloat16 else torch.float32)


def make_quant_linear_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """Bind-time kernel of QuantLinearAct: ``act(dequant(xq @ wq) + bias)``.

    Inputs (``node.attrs`` TensorRefs): ``mat1`` x [m, k] (uint8; fp32 or bf16 when
    ``attrs["dynamic"]``), ``mat2`` a constant int8 [k, n] (LinearAct's ``w_t``), ``w_scale``
    a constant fp32 [n], optional ``self`` (bias fp32 [n]). Attributes ``act``, and for a
    static node ``x_scale`` / ``x_offset``. Returns ``run(*inputs)`` giving a fresh [m, n]
    in the node's output dtype: fp32, bf16 (oneDNN rounds its fp32 result once: the bits
    of the fp32 output cast to bf16), or uint8 at ``out_scale`` / ``out_offset``
    (``fuse_requant``). The weight is transposed to [n, k] and prepacked once here
    (``onednn.qlinear_prepack``; it serves every m). Where oneDNN's int8 products are not
    exact for this weight (`onednn_takes`), the same arithmetic in fp32 (`int8_emulated`).
    ``run.int8_path`` says which ("onednn" or "emulated")."""
    a = node.attrs
    if not onednn_takes(consts[a["mat2"].index]):
        return _tag(emulated_quant_linear(node, in_descs, consts), "emulated")
    xi, wi, si = a["mat1"].index, a["mat2"].index, a["w_scale"].index
    bi = a["self"].index if isinstance(a.get("self"), TensorRef) else None
    w_scale = consts[si].float()
    w_zp = torch.zeros(w_scale.numel(), dtype=torch.int64)
    x_shape = [int(d) for d in in_descs[xi].shape] if in_descs[xi].is_static else None
    wp = torch.ops.onednn.qlinear_prepack(consts[wi].t().contiguous(), x_shape)
    name, algo = _LINEAR_POST.get(a["act"], ("none", ""))
    post = None if a["act"] in _LINEAR_POST or a["act"] == "none" else _ACT_FN.get(a["act"])
    lin = torch.ops.onednn.qlinear_pointwise
    dynamic = bool(a.get("dynamic"))
    step, offset = (1.0, 0) if dynamic else (float(a["x_scale"]), int(a["x_offset"]))
    o_scale, o_zp, o_dtype = _out_quant(node)

    def run(*ins):
        x = ins[xi]
        if dynamic:
            s, z = dynamic_params(x)
            x = quantize_u8(x, s, z)
        else:
            s, z = step, offset
        y = lin(x, s, z, wp, w_scale, w_zp, None if bi is None else ins[bi], o_scale, o_zp, o_dtype, name, [],
                algo)
        return y if post is None else post(y)
    return _tag(run, "onednn")


def make_quant_add_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """QuantAdd(a, b) → uint8: ``saturate(round(((a - a_offset) * a_scale + (b - b_offset) *
    b_scale) / scale) + offset)`` (``node.attrs``; a, b uint8 of one shape), by
    ``quantized::add`` on the tensors viewed as per-tensor quint8 (no copy). Returns
    ``run(a, b)`` giving uint8 in a's layout."""
    import warnings
    a = node.attrs
    sa, za, sb, zb = float(a["a_scale"]), int(a["a_offset"]), float(a["b_scale"]), int(a["b_offset"])
    s, z = float(a["scale"]), int(a["offset"])
    add = torch.ops.quantized.add
    mk = torch._make_per_tensor_quantized_tensor
    with warnings.catch_warnings():    # torch warns once that quantized tensors are deprecated
        warnings.simplefilter("ignore")
        mk(torch.zeros(1, dtype=torch.uint8), 1.0, 0)

    def run(x, y):
        return add(mk(x, sa, za), mk(y, sb, zb), s, z).int_repr()
    return run


def make_quant_max_pool_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """QuantMaxPool: max pooling of a uint8 activation (``node.attrs`` as ATen's
    ``max_pool2d``: ``kernel_size``, ``stride`` (default: the kernel), ``padding``,
    ``dilation``, ``ceil_mode``). Returns ``run(x)`` giving uint8 in x's layout.

    ATen's ``max_pool2d`` on uint8 fails for planes over 255 elements (its index type is
    the element type), so x is viewed as a per-tensor quint8 tensor (no copy; any scale:
    max commutes with it) and ``quantized::max_pool2d`` runs (its NHWC kernel); its
    integer values are the result. (A numba pass, as MaxPool's fp32 / bf16 kernel, was
    measured and not kept: ResNet-50's stem pool 248 → 164 µs at load 5 but 114 → 174
    µs at load 1.3, batch 8 1.04-1.21 → 1.36-1.45 ms; ``bench/maxpool.py``.)"""
    import warnings
    a = node.attrs
    k = list(a["kernel_size"])
    stride = list(a.get("stride") or k)
    pad = list(a.get("padding") or [0, 0])
    dil = list(a.get("dilation") or [1, 1])
    ceil = bool(a.get("ceil_mode", False))
    pool = torch.ops.quantized.max_pool2d
    with warnings.catch_warnings():    # torch warns once that quantized tensors are deprecated
        warnings.simplefilter("ignore")
        torch._make_per_tensor_quantized_tensor(torch.zeros(1, dtype=torch.uint8), 1.0, 0)

    def run(x):
        return pool(torch._make_per_tensor_quantized_tensor(x, 1.0, 0), k, stride, pad, dil, ceil).int_repr()
    return run


__all__ = ["QMAX", "QMIN", "QConvWeightPacks", "make_ascend_dequant_kernel", "make_dynamic_quant_dequant_kernel",
           "make_quant_add_kernel",
           "make_quant_max_pool_kernel", "dynamic_params", "make_ascend_quant_kernel",
           "make_quant_conv_kernel", "make_quant_linear_kernel", "onednn_takes", "quantize_u8"]
