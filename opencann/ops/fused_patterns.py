"""The ops the pattern fusions (``opencann.passes.fusion``: rms_norm, layer_norm,
gated_mlp) make, as `OpDef` rows; the SiLU and GELU fusions make the library's Swish and
Gelu (``ops/library.py``). CPU kernels: ``ops/kernels/cpu_patterns.py``; vnpu costs:
``ops/kernels/vnpu_cost.py``.

- ``RmsNorm``: ATen ``rms_norm(input, normalized_shape, weight, eps)`` (attrs as its
  schema, plus ``upcast``: normalize in float32 and cast back, as transformers'
  LlamaRMSNorm); shape and dtype are the input's.
- ``LayerNormFormula``: a spelled-out LayerNorm, (x − μ)/√(σ² + ε) [· γ] [+ β], attrs as
  ATen ``layer_norm``'s schema (input, normalized_shape, weight, bias, eps) plus how σ²
  and the root were written (``variance`` "pow" | "var", ``root`` "sqrt" | "rsqrt"): ATen's
  LayerNorm kernel where that is the formula's value, the formula's own ops where a NaN,
  an inf or a huge value makes them differ (``cpu_patterns.make_layer_norm_formula_kernel``).
- ``GatedMLP``: silu(x·W1) * (x·W3), attrs ``x``, ``w1``, ``w3`` (tensor refs); output
  [.., N] as the product it replaces (its shape is the node's, set by the fusion).

- ``AddRmsNorm``: torch_npu's ``npu_add_rms_norm(x1, x2, gamma, epsilon)``: the residual
  sum x = x1 + x2 and y = RMSNorm(x)·gamma over the last axis, outputs (y, x) (torch_npu
  also returns rstd; nothing here reads it, so it is not made). fp32; CPU kernel
  ``ops/kernels/add_rms_norm_cpu.py`` (numba, one pass per row, out= both buffers).
- ``RotaryMul``: torch_npu's ``npu_rotary_mul(input, r1, r2)`` = input·r1 +
  rotate_half(input)·r2 (rotary position embedding, half-rotation layout), input [B, N,
  S, D], r1/r2 (cos, sin) broadcastable to it; fp32; CPU kernel
  ``ops/kernels/rotary_mul_cpu.py`` (numba, eager's bits).
- ``ApplyRotaryPosEmb``: torch_npu's ``npu_apply_rotary_pos_emb(query, key, cos, sin)``,
  here out of place: (RotaryMul(query, cos, sin), RotaryMul(key, cos, sin)) as one node
  (one numba call at decode sizes), made from two RotaryMuls sharing cos and sin.
  All three are made by CPU-only fusions (``fuse_add_rms_norm``, ``fuse_rotary_mul``,
  ``fuse_apply_rotary_pos_emb``): they have no vnpu kernel, and graphs for the vnpu keep
  the unfused ops.

Costs: the unfused ops' FLOPs (RMSNorm 4 per element; GatedMLP 2·M·N·K per GEMM plus 6
per output element for SiLU and the product), bytes read + written once.
"""
from __future__ import annotations

import torch

from ..ir import Node, numel
from .kernels import vnpu_cost, vnpu_nd
from .kernels.add_rms_norm_cpu import make_add_rms_norm_kernel
from .kernels.rotary_mul_cpu import make_apply_rotary_pos_emb_kernel, make_rotary_mul_kernel
from .kernels.cpu_patterns import (make_gated_mlp_kernel, make_layer_norm_formula_kernel,
                                   make_rms_norm_kernel, rms_norm_writes_out)
from . import per_index as pi
from .opdef import Cost, OpDef, OpKind, register


def _bytes(node: Node) -> int:
    return sum(numel(v.desc.shape) * v.desc.dtype.itemsize
               for v in (*node.inputs, *node.outputs) if v.desc.is_static)


def _gated_mlp_cost(node: Node) -> Cost:
    """2 GEMMs of 2·M·N·K FLOPs + 6 FLOPs per output element (SiLU 5, product 1)."""
    x, w = node.inputs[0].desc, node.inputs[1].desc
    m, k, n = int(x.shape[0]), int(x.shape[1]), int(w.shape[1])
    return Cost(4 * m * n * k + 6 * m * n, _bytes(node))


register(OpDef("RmsNorm", OpKind.NORM, aten=torch.ops.aten.rms_norm.default, flops_per_elem=4,
               kernel_factories={"cpu": make_rms_norm_kernel, "vnpu": vnpu_nd.make_rms_norm}, keep_fp32=True,
               out_capable=rms_norm_writes_out,
               device_cost={"vnpu": vnpu_cost.layernorm}, per_index=pi.LAYER_NORM,
               doc="RMSNorm (Llama): x·rsqrt(mean(x², -1) + eps)·w"))
register(OpDef("LayerNormFormula", OpKind.NORM, aten=torch.ops.aten.layer_norm.default,
               flops_per_elem=8, kernel_factories={"cpu": make_layer_norm_formula_kernel},
               keep_fp32=True, device_cost={"vnpu": vnpu_cost.layernorm},
               per_index=pi.LAYER_NORM,
               doc="spelled-out LayerNorm: ATen's kernel where exact, else the formula's ops"))
register(OpDef("GatedMLP", OpKind.FUSED, aliases=((),), cost_fn=_gated_mlp_cost,
               kernel_factories={"cpu": make_gated_mlp_kernel, "vnpu": vnpu_nd.make_gated_mlp},
               out_capable=lambda n: n.device.kind == "cpu",   # the vnpu kernel returns its own
               device_cost={"vnpu": vnpu_cost.gated_mlp}, per_index=pi.gated_mlp,
               doc="silu(x·W1) * (x·W3), the SwiGLU MLP's two GEMMs in one kernel"))


def _add_rms_norm_cost(node: Node) -> Cost:
    """The Add (1 FLOP per element) and the RMSNorm (4 per element); bytes: x1, x2, gamma
    read, y and x written once."""
    return Cost(5 * numel(node.outputs[0].desc.shape), _bytes(node))


def _rotary_mul_cost(node: Node) -> Cost:
    """3 FLOPs per output element (two products, one sum; the negation is free); bytes:
    the inputs read and the outputs written once."""
    return Cost(3 * sum(numel(o.desc.shape) for o in node.outputs), _bytes(node))


register(OpDef("AddRmsNorm", OpKind.FUSED, aliases=((), ()), cost_fn=_add_rms_norm_cost,
               kernel_factories={"cpu": make_add_rms_norm_kernel}, out_capable=lambda n: True,
               keep_fp32=True, fp32_kernel=True, per_index=pi.add_rms_norm,
               doc="torch_npu.npu_add_rms_norm: (RMSNorm(x1 + x2)·gamma, x1 + x2) in one pass"))
register(OpDef("RotaryMul", OpKind.FUSED, aliases=((),), cost_fn=_rotary_mul_cost,
               kernel_factories={"cpu": make_rotary_mul_kernel}, out_capable=lambda n: True,
               fp32_kernel=True, per_index=pi.rotary_mul,
               doc="torch_npu.npu_rotary_mul: x·cos + rotate_half(x)·sin in one pass"))
register(OpDef("ApplyRotaryPosEmb", OpKind.FUSED, aliases=((), ()), cost_fn=_rotary_mul_cost,
               kernel_factories={"cpu": make_apply_rotary_pos_emb_kernel}, out_capable=lambda n: True,
               fp32_kernel=True, per_index=pi.rotary_mul,
               doc="torch_npu.npu_apply_rotary_pos_emb (out of place): RotaryMul of a query and "
                   "a key sharing cos and sin, one node"))
