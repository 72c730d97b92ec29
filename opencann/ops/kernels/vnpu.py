"""vnpu kernels: bind-time factories ``f(node, in_descs, consts) -> callable(*inputs)``
for nodes placed on the virtual NPU (an `OpDef`'s ``kernel_factories["vnpu"]``).

A factory looks at the formats the layout pass (``passes/layout/npu_layout.py``) gave the
node's values; an op's ``npu_format`` column says which family it belongs to:

- ``TransData``: `trans_data` between ND/NCHW and NC1HWC0 / FRACTAL_Z / FRACTAL_NZ.
- "conv" (Conv2D): NC1HWC0 activations × FRACTAL_Z weight → NC1HWC0 (`conv2d_nc1hwc0`);
  int8 × int8 → int32 exactly, the padding reading ``attrs["offset_x"]`` (the int8 path
  of ``passes/layout/vnpu_quantize_int8.py``).
- "matmul" (MatMul/BatchMatMul/MatMulV2): FRACTAL_NZ × FRACTAL_NZ → FRACTAL_NZ
  (`matmul_nz`); MatMulV2's bias is added as a zero-padded FRACTAL_NZ tensor. int8
  operands accumulate exactly into int32 (in ND too, `int8_matmul`: a chip whose Cube
  reads ND).
- "elementwise" (the non-random elementwise ops): on NC1HWC0 / FRACTAL_NZ storage through
  `elementwise`, which keeps the padding zero.
- "channelwise" on NC1HWC0 (max/avg pooling, mean/sum/max/min over H and W, inference
  BatchNorm): run on the (N, C1·C0, H, W) view of the storage, so padded channels stay
  zero (zero in, zero out; BatchNorm pads its parameters so that holds).

A node in ND (the op has no NPU-format kernel, or its operands are in ND) runs its host
(cpu) kernel. `FACTORIES` maps an ``npu_format`` family to its factory.
Source for formats and kernels: ``opencann.devices.vnpu`` (CANN TransData, GE formats).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ...devices.vnpu import conv2d_nc1hwc0, elementwise, matmul_nz, to_fractal_nz, trans_data
from ...ir import Format, Node, TensorDesc, TensorRef
from ..opdef import call_args, get_op

NPU_FORMATS = (Format.NC1HWC0, Format.FRACTAL_Z, Format.FRACTAL_NZ)


def origin_format_for(fmt: Format) -> Format:
    """The plain format a tensor stored in ``fmt`` is read in: NCHW for NC1HWC0 and
    FRACTAL_Z (4-D activations and conv weights), ND otherwise."""
    return Format.NCHW if fmt in (Format.NC1HWC0, Format.FRACTAL_Z) else Format.ND


# -- factories ---------------------------------------------------------------------------

def host_kernel(node: Node) -> Callable:
    """The node's ATen kernel called on host tensors in ND (a vnpu node without an
    NPU-format kernel executes functionally on the host)."""
    op = get_op(node.op)
    target = op.kernels.get("cpu") or op.aten or node.meta["aten"]

    def run(*ins):
        args, kwargs = call_args(node, ins)
        return target(*args, **kwargs)
    return run


def _index(node: Node, name: str) -> Optional[int]:
    a = node.attrs.get(name)
    return a.index if isinstance(a, TensorRef) else None


def make_trans_data(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """TransData kernel: ``trans_data(x, src, dst, origin_shape, origin_format)`` into fresh
    contiguous memory, as the op is declared (``aliases``: fresh): `trans_data` returns a
    view of ``x`` when no data moves (FRACTAL_NZ -> ND of a matrix that fits one fractal
    column), which is copied here."""
    a = node.attrs
    src, dst = str(a["src_format"]), str(a["dst_format"])
    shape, of = tuple(a["origin_shape"]), str(a["origin_format"])
    groups = int(a.get("groups", 1))

    def run(x):
        r = trans_data(x, src, dst, origin_shape=shape, origin_format=of, groups=groups)
        if r.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            return r.clone(memory_format=torch.contiguous_format)
        return r
    return run


def make_conv(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """Conv2D on NC1HWC0 × FRACTAL_Z (grouped FRACTAL_Z when groups > 1); the host kernel
    when the input is ND."""
    xi, wi, bi = _index(node, "input"), _index(node, "weight"), _index(node, "bias")
    if in_descs[xi].format != Format.NC1HWC0:
        return host_kernel(node)
    wd = in_descs[wi]
    if wd.format != Format.FRACTAL_Z:
        raise ValueError(f"{node.name}: NC1HWC0 convolution needs a FRACTAL_Z weight, got {wd}")
    a = node.attrs
    groups = int(a.get("groups", 1))
    cout, cin_g, kh, kw = (int(s) for s in wd.origin_shape)
    cin = cin_g * groups

    def run(*ins):
        return conv2d_nc1hwc0(ins[xi], ins[wi], in_channels=cin, out_channels=cout, kernel_size=(kh, kw),
                              stride=a["stride"], padding=a["padding"], dilation=a["dilation"],
                              bias=ins[bi] if bi is not None else None, groups=groups,
                              offset_x=int(a.get("offset_x", 0)))
    return run


def int8_matmul(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The Cube's int8 GEMM in ND: a [M, K] int8 @ b [K, N] int8 (+ bias [N] int32) →
    int32 [M, N], exact (products summed in float64, exact below 2**53; |sum| < 2**31 for
    K < 2**17). Raises what ``torch.mm`` raises for bad shapes."""
    c = a.to(torch.float64) @ b.to(torch.float64)
    if bias is not None:
        c += bias.to(torch.float64)
    return c.to(torch.int32)


def make_matmul(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """MatMul (mm), BatchMatMul (bmm), MatMulV2 (addmm: beta·bias + alpha·a@b) on
    FRACTAL_NZ operands; the host kernel when the output is ND (`int8_matmul` for int8
    operands: torch's addmm takes one dtype)."""
    names = ("mat1", "mat2") if node.op == "MatMulV2" else ("self", "mat2")
    ai, bi = _index(node, names[0]), _index(node, names[1])
    if node.outputs[0].desc.format != Format.FRACTAL_NZ:
        if in_descs[ai].dtype.torch != torch.int8:
            return host_kernel(node)
        ci = _index(node, "self") if node.op == "MatMulV2" else None
        return lambda *ins: int8_matmul(ins[ai], ins[bi], None if ci is None else ins[ci])
    a_shape, b_shape = in_descs[ai].origin_shape, in_descs[bi].origin_shape
    if node.op != "MatMulV2":
        return lambda *ins: matmul_nz(ins[ai], ins[bi], a_shape, b_shape)
    ci = _index(node, "self")   # addmm(self=bias, mat1, mat2, beta, alpha)
    beta, alpha = node.attrs.get("beta", 1), node.attrs.get("alpha", 1)
    out_shape = tuple(node.outputs[0].desc.origin_shape)

    def bias_nz(bias: torch.Tensor) -> torch.Tensor:
        return to_fractal_nz((bias * beta if beta != 1 else bias).expand(out_shape))

    fixed = bias_nz(consts[ci]) if consts[ci] is not None else None  # constant bias: once

    def run(*ins):
        c = matmul_nz(ins[ai], ins[bi], a_shape, b_shape)
        if alpha != 1:
            c = c * alpha
        return c + (fixed if fixed is not None else bias_nz(ins[ci]))
    return run


def nz_row(t: torch.Tensor, c0: int) -> torch.Tensor:
    """A last-axis broadcast operand ([N] or [1, ..., 1, N]) laid out to broadcast against
    FRACTAL_NZ storage (..., N1, M1, 16, C0): shape (N1, 1, 1, C0), zero-padded to N1·C0
    (what the Vector unit repeats over the M fractal rows in UB)."""
    v = t.reshape(-1)
    n1 = -(-v.shape[0] // c0)
    return F.pad(v, (0, n1 * c0 - v.shape[0])).reshape(n1, 1, 1, c0)


def make_elementwise(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """Any elementwise op on NC1HWC0 / FRACTAL_NZ storage via `elementwise` (padding
    re-zeroed); on FRACTAL_NZ an ND operand broadcast along the last axis (a bias [N]) is
    laid out by `nz_row` (a constant once, at bind time); the host kernel in ND."""
    out = node.outputs[0].desc
    fn = host_kernel(node)
    if out.format not in NPU_FORMATS:
        return fn
    fmt, shape, of = out.format.value, tuple(out.origin_shape), out.origin_format.value
    c0 = int(out.shape[-1])
    rows = [i for i, d in enumerate(in_descs) if out.format == Format.FRACTAL_NZ and d.format not in NPU_FORMATS
            and d.is_static and d.numel > 1]
    if not rows:
        return lambda *ins: elementwise(fn, *ins, fmt=fmt, origin_shape=shape, origin_format=of)
    fixed = {i: nz_row(consts[i], c0) for i in rows if consts[i] is not None}

    def run(*ins):
        args = list(ins)
        for i in rows:
            args[i] = fixed[i] if i in fixed else nz_row(ins[i], c0)
        return elementwise(fn, *args, fmt=fmt, origin_shape=shape, origin_format=of)
    return run


def _to_4d(x: torch.Tensor) -> torch.Tensor:
    n, c1, h, w, c0 = x.shape
    return x.permute(0, 1, 4, 2, 3).reshape(n, c1 * c0, h, w)


def _to_5d(y: torch.Tensor, c0: int) -> torch.Tensor:
    n, c, h, w = y.shape
    return y.reshape(n, c // c0, c0, h, w).permute(0, 1, 3, 4, 2).contiguous()


def make_channelwise(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """Pooling / H,W-reductions / inference BatchNorm on NC1HWC0: the ATen op on the
    (N, C1·C0, H, W) view; output 0 back to NC1HWC0, other outputs (pool indices,
    BatchNorm's empty statistics) in ND with the padded channels dropped."""
    out = node.outputs[0].desc
    fn = host_kernel(node)
    if out.format != Format.NC1HWC0:
        return fn
    xi = _index(node, "input") if "input" in node.attrs else _index(node, "self")
    c = int(out.origin_shape[1])
    c0 = int(out.shape[-1])
    cp = int(out.shape[1]) * c0
    pads = {}
    if node.op == "BatchNorm":   # pad parameters: padded channels map 0 -> 0
        for name, fill in (("weight", 0.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
            i = _index(node, name)
            if i is not None:
                pads[i] = fill

    def pad(t: torch.Tensor, fill: float) -> torch.Tensor:
        return F.pad(t, (0, cp - c), value=fill) if cp != c else t

    fixed = {i: pad(consts[i], f) for i, f in pads.items() if consts[i] is not None}

    def run(*ins):
        args = list(ins)
        args[xi] = _to_4d(ins[xi])
        for i, f in pads.items():
            args[i] = fixed[i] if i in fixed else pad(ins[i], f)
        r = fn(*args)
        if isinstance(r, torch.Tensor):
            return _to_5d(r, c0)
        rest = [t[:, :c].contiguous() if t.dim() >= 2 and t.shape[1] == cp else t for t in r[1:]]
        return (_to_5d(r[0], c0), *rest)
    return run


# ``npu_format`` family -> its vnpu kernel factory (an op row takes its factory from here)
FACTORIES = {"conv": make_conv, "matmul": make_matmul, "elementwise": make_elementwise,
             "channelwise": make_channelwise}

__all__ = ["FACTORIES", "NPU_FORMATS", "host_kernel", "int8_matmul", "make_channelwise", "make_conv", "make_elementwise",
           "make_matmul", "make_trans_data", "nz_row", "origin_format_for"]
