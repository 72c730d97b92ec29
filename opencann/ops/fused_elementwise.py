"""``FusedElementwise``: a group of elementwise ops (broadcasting, casts, at most one
trailing reduction over the last dim; the pass fuses max/min and integer sums only: a float
sum would not round as eager's cascade) as one kernel generated from the node's program
(``ops/kernels/ew_program.py``), made by the pass ``fuse_elementwise``
(``passes/fusion/elementwise.py``).

Kernels: CPU tensors run the numba kernel (``ops/kernels/ew_numba.py``), CUDA tensors the
Triton kernel (``ops/kernels/ew_triton.py``; ``OPENCANN_EW_BACKEND=triton`` forces it,
e.g. under ``TRITON_INTERPRET=1``). Out-capable when the node has one output: the kernel
writes into the planned buffer. Shapes: full-size outputs have the broadcast shape of the
inputs (attr ``shape``); the reduction's drops the last dim (keeps it as 1 with keepdim).
Cost: the member ops' FLOPs per domain element (attr ``ops``), bytes of the inputs read and
outputs written once; vnpu: one Vector kernel (`vnpu_cost.fused_elementwise`).
"""
from __future__ import annotations

import math
import os
from typing import Callable, Optional, Sequence

import torch

from ..ir import Node, TensorDesc, numel
from .kernels import vnpu_cost
from .kernels.ew_program import Program
from . import per_index
from .opdef import Cost, OpDef, OpKind, _nbytes, get_op, register


def run_fused(prog: Program, inputs: Sequence[torch.Tensor], out_dtypes: Sequence[torch.dtype],
              out: Optional[torch.Tensor] = None, backend: Optional[str] = None):
    """Run ``prog`` on ``inputs``: a tensor (one output) or a tuple, in ``out_dtypes``;
    ``out``: where output 0 goes. ``backend``: "numba", "triton" or None (by the inputs'
    device; ``OPENCANN_EW_BACKEND`` overrides)."""
    shape = tuple(torch.broadcast_shapes(*(t.shape for t in inputs)))
    dev = inputs[0].device
    keep = bool(prog.reduce and prog.reduce[3])
    res, full, red = [], [], None
    for k, name in enumerate(prog.outputs):
        oshape = (shape[:-1] + ((1,) if keep else ())) if name == "r" else shape
        if k == 0 and out is not None and (name != "r" or out.is_contiguous()):
            t = out
        else:
            t = torch.empty(oshape, dtype=out_dtypes[k], device=dev)
        res.append(t)
        if name == "r":
            red = t
        else:
            full.append(t)
    if math.prod(shape) == 0:                       # an empty domain (batch 0, or an empty row)
        _empty(prog, red)
    else:
        _launch(prog, inputs, full, red, shape, dev, backend)
    if out is not None and res[0] is not out:
        out.copy_(res[0])
        res[0] = out
    return res[0] if len(res) == 1 else tuple(res)


def _empty(prog: Program, red: Optional[torch.Tensor]) -> None:
    """Nothing to compute; a reduction over empty rows gives eager's value: sum 0, mean
    NaN; max/min raise as eager does."""
    if red is None or red.numel() == 0:
        return
    kind = prog.reduce[0]
    if kind in ("amax", "amin"):
        raise RuntimeError(f"{kind}(): expected reduction dim -1 to have non-zero size")
    red.fill_(0 if kind == "sum" else float("nan"))


_RUN_NUMBA = None


def _load_numba():
    """`ew_numba.run_numba`, imported on the first numba launch (numba takes ~1 s to
    import: not paid by compiles and models that never run a fused elementwise kernel)."""
    global _RUN_NUMBA
    from .kernels.ew_numba import run_numba
    _RUN_NUMBA = run_numba
    return run_numba


def _launch(prog, inputs, full, red, shape, dev, backend) -> None:
    backend = backend or os.environ.get("OPENCANN_EW_BACKEND") or \
        ("triton" if dev.type == "cuda" else "numba")
    if backend == "triton":
        from .kernels.ew_triton import run_triton
        run_triton(prog, inputs, full, red, shape)
    else:
        (_RUN_NUMBA or _load_numba())(prog, inputs, full, red)


def make_fused_elementwise_kernel(node: Node, in_descs: Sequence[TensorDesc], consts) -> Callable:
    """FusedElementwise(*inputs, out=None) -> output(s) of the node's program."""
    prog = Program.from_attrs(node.attrs)
    dtypes = [o.desc.dtype.torch for o in node.outputs]

    def run(*xs, out=None):
        return run_fused(prog, xs, dtypes, out)
    return run


def make_fused_elementwise_vnpu(node: Node, in_descs: Sequence[TensorDesc], consts) -> Callable:
    """On the vnpu: the host kernel, through `elementwise` on NC1HWC0 / FRACTAL_NZ storage
    when layout selection put the node in one (same-shape operands, no reduction)."""
    from ..devices.vnpu import elementwise
    from .kernels.vnpu import NPU_FORMATS
    fn = make_fused_elementwise_kernel(node, in_descs, consts)
    out = node.outputs[0].desc
    if out.format not in NPU_FORMATS:
        return fn
    fmt, shape, of = out.format.value, tuple(out.origin_shape), out.origin_format.value

    def run(*ins, out=None):
        r = elementwise(fn, *ins, fmt=fmt, origin_shape=shape, origin_format=of)
        return r if out is None else out.copy_(r)
    return run


def _cost(node: Node) -> Cost:
    """The member ops' FLOPs per element of the domain; inputs read and outputs written once."""
    n = numel(node.attrs["shape"]) if all(isinstance(s, int) for s in node.attrs["shape"]) else 0
    flops = sum(get_op(op).flops_per_elem for op in node.attrs["ops"]) * n
    return Cost(int(flops), sum(_nbytes(v.desc) for v in (*node.inputs, *node.outputs)))


register(OpDef("FusedElementwise", OpKind.FUSED, aliases=((),), cost_fn=_cost,
               kernel_factories={"cpu": make_fused_elementwise_kernel,
                                 "vnpu": make_fused_elementwise_vnpu}, npu_format="elementwise",
               out_capable=lambda node: len(node.outputs) == 1,
               device_cost={"vnpu": vnpu_cost.fused_elementwise},
               per_index=per_index.fused_elementwise,
               doc="elementwise ops (+ a trailing reduction) as one generated kernel"))

__all__ = ["make_fused_elementwise_kernel", "run_fused"]
