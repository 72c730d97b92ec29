"""CPU kernels of the ops the pattern fusions make (``opencann.passes.fusion``): bind-time
factories ``f(node, in_descs, consts) -> callable(*inputs)``, inputs in ``node.inputs``
order. Each repeats the eager computation it replaces with ATen's fused kernels, so
outputs match eager (bit-for-bit where noted).

- `make_rms_norm_kernel` (RmsNorm): ATen ``rms_norm`` (bit-for-bit the spelled-out fp32
  form: x·rsqrt(mean(x²) + eps)·w); with ``upcast`` as transformers' LlamaRMSNorm:
  normalize in float32, cast back, then multiply by the weight in the input's dtype. A
  float32 decode step's rows (`rms_norm_cpu`) take a numba row kernel into the planned
  buffer instead: eager's values to fp32 rounding, one call instead of six dispatches.
- `make_layer_norm_formula_kernel` (LayerNormFormula, a spelled-out LayerNorm): ATen's
  ``native_layer_norm`` where its statistics prove it gives the formula's result up to
  rounding (`ops.parity.norm_range.layer_norm_in_range`: every |x| far from overflow,
  γ and β finite and moderate), else the formula itself, op by op as eager: a NaN, an inf
  or a huge value then gives eager's NaN / inf / β exactly.
- `make_gated_mlp_kernel` (GatedMLP): silu(x·W1) * (x·W3) as two GEMMs by the kernel
  chosen for their shape (``cpu.gemm_kernel``, as a bias-free LinearAct's: eager's ``mm``,
  same bits, or with constant fp32 weights a prepacked GEMM or the decode GEMV, eager's
  values to fp32 rounding), ATen's SiLU and the product in place: one output tensor. With
  constant fp32 weights of 1 MiB or more it runs ONE GEMM on W1‖W3 concatenated once
  (``cpu.concat_weights``, a copy shared by the graphs over the same weights, e.g. an
  LLM's prefill and decode graphs, in place of two per-weight copies): one weight stream
  and one kernel call instead of two; the same dot products.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import math

import torch

from .cpu import COLD_RACE_BYTES, FRESH_RESULT_KERNELS, concat_weights, gemm_kernel
from .rms_norm_cpu import bind_rms_norm, decode_rows
from .scratch import thread_scratch
from ..parity.formulas import layer_norm_formula
from ..parity.norm_range import affine_in_range, layer_norm_in_range
from ...ir import Node, TensorDesc


def make_rms_norm_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """RmsNorm(input [..., D], weight [D] or none; attrs eps, upcast) -> [..., D], the
    input's dtype: ``run(x, w=None)``, ATen's kernel; where `rms_norm_writes_out` holds
    (float32 decode rows), ``run(x, w=None, out=None)`` writing the planned buffer
    (`rms_norm_cpu.bind_rms_norm`, with ``prebind``)."""
    shape, eps = list(node.attrs["normalized_shape"]), node.attrs["eps"]
    if not node.attrs.get("upcast"):
        def run(x, w=None):
            return torch.rms_norm(x, shape, w, eps)
    else:
        def run(x, w=None):
            y = torch.rms_norm(x.to(torch.float32), shape, None, eps).to(x.dtype)
            return y if w is None else w * y
    if rms_norm_writes_out(node):    # a decode step's rows: the numba kernel, into out
        return bind_rms_norm(in_descs[0], in_descs[1] if len(in_descs) > 1 else None,
                             float(eps), run)
    return run


def rms_norm_writes_out(node: Node) -> bool:
    """``out_capable`` of RmsNorm: True on the CPU for a float32 norm over the last axis
    of a decode step's rows (`rms_norm_cpu.decode_rows`), whose kernel writes the
    planned buffer (`rms_norm_cpu.bind_rms_norm`)."""
    x = node.inputs[0].desc
    w = node.inputs[1].desc if len(node.inputs) > 1 else None
    shape = [int(d) for d in node.attrs["normalized_shape"]]
    return (node.device.kind == "cpu" and len(shape) == 1 and x.rank >= 1
            and tuple(x.shape[-1:]) == tuple(shape) and decode_rows(x, w))


def make_layer_norm_formula_kernel(node: Node, in_descs: Sequence[TensorDesc],
                                   consts: Sequence) -> Callable:
    """LayerNormFormula(input [..., *normalized_shape], weight and bias of
    normalized_shape or absent; attrs normalized_shape, eps, variance "pow"/"var", root
    "sqrt"/"rsqrt") -> the input's shape and dtype: ATen's ``native_layer_norm`` when
    `layer_norm_in_range` holds for its mean and rstd (and γ, β are in range), else the
    spelled-out formula (`layer_norm_formula`) on the whole input, eager's ops. Constant
    γ and β are checked once, here."""
    a = node.attrs
    shape, eps = [int(s) for s in a["normalized_shape"]], float(a["eps"])
    d, dtype = math.prod(shape), in_descs[0].dtype.torch
    wi = a["weight"].index if a.get("weight") is not None else None
    bi = a["bias"].index if a.get("bias") is not None else None
    form = (len(shape), a.get("variance", "pow"), a.get("root", "sqrt"))
    static = all(i is None or consts[i] is not None for i in (wi, bi))
    affine_ok = affine_in_range(*(consts[i] if i is not None else None for i in (wi, bi)),
                                d, dtype) if static else None

    def run(*ins):
        x = ins[0]
        w, b = (ins[i] if i is not None else None for i in (wi, bi))
        y, mean, rstd = torch.native_layer_norm(x, shape, w, b, eps)
        ok = affine_ok if affine_ok is not None else affine_in_range(w, b, d, dtype)
        if ok and layer_norm_in_range(mean, rstd, d, dtype):
            return y
        return layer_norm_formula(x, form[0], w, b, eps, form[1], form[2])
    return run


def _one_gemm(x: TensorDesc, w1, w3) -> bool:
    """Whether a GatedMLP of input ``x`` runs one GEMM on its concatenated weights: a
    static [m, k] x and constant fp32 [k, n] weights of ``COLD_RACE_BYTES`` or more each
    (module docstring)."""
    return (isinstance(w1, torch.Tensor) and isinstance(w3, torch.Tensor) and x.is_static
            and x.rank == 2
            and w1.dtype == w3.dtype == torch.float32 == x.dtype.torch
            and w1.dim() == w3.dim() == 2 and w1.shape == w3.shape
            and w1.numel() * w1.element_size() >= COLD_RACE_BYTES)


def make_gated_mlp_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """GatedMLP(x [M, K], w1 [K, N], w3 [K, N]) -> silu(x @ w1) * (x @ w3), viewed as the
    node's output shape (e.g. [B, S, N] with B·S = M); float dtypes. Both products run
    the GEMM kernel chosen for the shape (M, K, N) with no bias (``cpu.gemm_kernel``,
    recorded in ``node.meta["kernel"]``; with constant fp32 weights it races eager's
    ``mm`` against the prepacked GEMMs and, for M <= 4, the decode GEMV).
    ``run(*ins, out=None)`` writes into ``out`` (the planned buffer) when it is
    contiguous: the gate's product goes there, SiLU and the product with the up
    projection in place. With the concatenated weights the [M, 2N] product goes to this
    thread's scratch (`thread_scratch`), or stays where oneDNN's or MKL's packed GEMM
    put it (`cpu.FRESH_RESULT_KERNELS`: they return a tensor of their own), and SiLU
    reads it there. A call allocates nothing of its own (at a 512-token prefill the
    fresh [M, 2N] result and SiLU's output were 12 MiB of page faults per call)."""
    shape = tuple(int(s) for s in node.outputs[0].desc.shape)
    silu_, silu_out = torch.nn.functional.silu, torch.ops.aten.silu.out
    xi, w1i, w3i = (node.attrs[k].index for k in ("x", "w1", "w3"))
    w1, w3, x = consts[w1i], consts[w3i], in_descs[xi]
    dtype = x.dtype.torch
    n = int(node.outputs[0].desc.shape[-1])

    def into(out, m: int):
        """``out`` as [m, n] when the kernel can write it directly, else None."""
        return out.view(m, n) if out is not None and out.is_contiguous() else None

    if _one_gemm(x, w1, w3):
        w13 = concat_weights(w1, w3)
        g13 = gemm_kernel(node, x, w13, None)
        # oneDNN's and MKL's packed GEMMs return a tensor of their own: SiLU reads it there
        # (a copy into the scratch cost ~0.5 ms per 512-token prefill layer)
        fresh = node.meta.get("kernel") in FRESH_RESULT_KERNELS

        def run_one(*ins, out=None):
            xt = ins[xi]
            m = xt.shape[0]
            r = g13(None, xt, w13, None if fresh else thread_scratch(m * 2 * n, dtype).view(m, 2 * n))
            o = into(out, m)
            if o is None:
                return silu_(r[:, :n]).mul_(r[:, n:]).view(shape)
            silu_out(r[:, :n], out=o)
            o.mul_(r[:, n:])
            return out
        if hasattr(g13, "prebind"):
            run_one.prebind = lambda *ins, out=None: _prebind_one(g13, ins[xi], w13, n, out)
        return run_one
    g1 = gemm_kernel(node, in_descs[xi], consts[w1i], None)
    g3 = gemm_kernel(node, in_descs[xi], consts[w3i], None)

    def run(*ins, out=None):
        xt = ins[xi]
        m = xt.shape[0]
        o = into(out, m)
        a = g1(None, xt, ins[w1i], o)
        silu_(a, inplace=True)
        a.mul_(g3(None, xt, ins[w3i], thread_scratch(m * n, dtype).view(m, n)))
        if o is None:
            return a.view(shape)
        return out if a is o else out.copy_(a.view(shape))
    return run


def _prebind_one(g13, x: torch.Tensor, w13: torch.Tensor, n: int, out) -> Optional[Callable]:
    """``call()``: a one-GEMM fp32 GatedMLP on these very tensors (`numba_cache.prebound`:
    the same objects over the same memory at every call): the decode GEMV ``g13`` into a
    [m, 2n] buffer of its own, then SiLU and the gate in one numba loop into ``out``
    (`swiglu_numba`); None where the GEMM or the tensors do not allow it."""
    m = int(x.shape[0])
    if out is None or out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != m * n:
        return None
    r = torch.empty(m, 2 * n, dtype=torch.float32)
    gemm = g13.prebind(None, x, w13, r)
    if gemm is None:
        return None
    from .numba_cache import prebound
    from .swiglu_numba import silu_mul
    epilogue = prebound(silu_mul, (r.numpy(), n, out.numpy().reshape(m, n)))

    def call() -> torch.Tensor:
        gemm()
        epilogue()
        return out
    call.buffer = r   # held with the call
    return call


__all__ = ["make_gated_mlp_kernel", "make_layer_norm_formula_kernel", "make_rms_norm_kernel"]
