"""vnpu kernels in ND: bind-time factories ``f(node, in_descs, consts) -> callable(*inputs)``
for the ops of transformers and LLMs that CANN runs in ND on an AI core (an `OpDef`'s
``kernel_factories["vnpu"]``; the NPU-format families are in ``ops/kernels/vnpu.py``).

- Vector unit (``opencann.devices.vnpu.vector_kernels``: fp16/bf16 reduced in fp32 in UB):
  ``LayerNorm``, ``RmsNorm``, ``SoftmaxV2`` / ``LogSoftmaxV2``; LayerNorm and the softmaxes
  also over the last axis of a FRACTAL_NZ input (`LAST_AXIS_NZ`, layout family "lastaxis").
- Cube + Vector (``opencann.devices.vnpu.attention_kernels``: Cube products accumulate in
  fp32, softmax in fp32, P rounded to the input dtype): ``ScaledDotProductAttention``
  (unfused, the S×S scores in HBM), ``DecodeAttention`` (``npu_incre_flash_attention``,
  GQA), ``GatedMLP`` (two Cube GEMMs, SiLU and the product in UB).
- MTE data movement (gathers, concatenation, padding, fills: `make_data_movement`), bit-exact
  on any device, so the op's ATen kernel computes it: ``Embedding`` (CANN GatherV2),
  ``GatherElements``, ``Index``, ``ConcatD``, ...; ``KvCacheUpdate`` (``scatter_update_``,
  in place).

`FACTORIES` maps an op name to its factory; `host_nodes` lists the nodes of a vnpu graph
that have no vnpu kernel (they would run on the host).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence

import torch
import torch.nn.functional as F

from ...devices.vnpu.attention_kernels import attention, cube_matmul, incre_flash_attention, scatter_update_
from ...devices.vnpu.vector_kernels import layer_norm, layer_norm_nz, rms_norm, softmax, softmax_nz
from ...ir import Format, Graph, Node, TensorDesc, TensorRef
from ..opdef import get_op
from .vnpu import host_kernel


def _ref(node: Node, name: str):
    """Input index of attribute ``name`` (a TensorRef), else None."""
    a = node.attrs.get(name)
    return a.index if isinstance(a, TensorRef) else None


def _eager_strides(node: Node, shape) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function giving its result the strides eager's op had (``node.meta["strides"]``,
    which views after the node were captured against), or the identity."""
    strides = (node.meta.get("strides") or [None])[0]
    shape = tuple(int(s) for s in shape)
    if strides is None or tuple(strides) == torch.empty(shape, device="meta").stride():
        return lambda t: t
    return lambda t: torch.empty_strided(shape, tuple(strides), dtype=t.dtype).copy_(t)


def make_data_movement(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """Gathers, concatenation, padding, creation on the MTE in ND: the op's ATen kernel
    (moving or filling elements is exact, so the host computes the NPU's bits)."""
    return host_kernel(node)


def make_layer_norm(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """LayerNorm (``native_layer_norm``: input, normalized_shape, weight, bias, eps) ->
    (y, mean, rstd) in the node's output dtypes: `vector_kernels.layer_norm` in ND,
    `vector_kernels.layer_norm_nz` on a FRACTAL_NZ input (y in NZ, mean and rstd ND)."""
    xi, wi, bi = _ref(node, "input"), _ref(node, "weight"), _ref(node, "bias")
    shape, eps = [int(s) for s in node.attrs["normalized_shape"]], float(node.attrs["eps"])
    dts = [o.desc.dtype.torch for o in node.outputs]
    x = in_descs[xi]
    nz = tuple(int(s) for s in x.origin_shape) if x.format == Format.FRACTAL_NZ else None

    def run(*ins):
        w, b = ins[wi] if wi is not None else None, ins[bi] if bi is not None else None
        r = layer_norm_nz(ins[xi], nz, w, b, eps) if nz else layer_norm(ins[xi], shape, w, b, eps)
        return tuple(t.to(dt) for t, dt in zip(r, dts))
    return run


def make_rms_norm(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """RmsNorm (input, normalized_shape, weight, eps, upcast) -> the input's shape, the
    node's dtype (`vector_kernels.rms_norm`)."""
    xi, wi = _ref(node, "input"), _ref(node, "weight")
    shape, eps, up = [int(s) for s in node.attrs["normalized_shape"]], node.attrs.get("eps"), \
        bool(node.attrs.get("upcast"))
    dt = node.outputs[0].desc.dtype.torch
    return lambda *ins: rms_norm(ins[xi], shape, ins[wi] if wi is not None else None, eps, up).to(dt)


def make_softmax(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """SoftmaxV2 / LogSoftmaxV2 (``_softmax``: self, dim, half_to_float) in the node's dtype;
    on a FRACTAL_NZ input (last axis) `vector_kernels.softmax_nz`."""
    xi, dim, log = _ref(node, "self"), int(node.attrs["dim"]), node.op == "LogSoftmaxV2"
    dt = node.outputs[0].desc.dtype.torch
    x = in_descs[xi]
    if x.format == Format.FRACTAL_NZ:
        shape = tuple(int(s) for s in x.origin_shape)
        return lambda *ins: softmax_nz(ins[xi], shape, log, dt)
    return lambda *ins: softmax(ins[xi], dim, log, dt)


def make_sdpa(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """ScaledDotProductAttention (query, key, value, attn_mask, is_causal, scale,
    enable_gqa) by `attention_kernels.attention`; the result keeps eager's strides.
    Raises ValueError at bind time for dropout (inference graphs only)."""
    if node.attrs.get("dropout_p"):
        raise ValueError(f"{node.name}: ScaledDotProductAttention with dropout_p={node.attrs['dropout_p']} has no "
                         f"vnpu kernel (inference only); call model.eval() before compiling")
    qi, ki, vi, mi = (_ref(node, n) for n in ("query", "key", "value", "attn_mask"))
    causal, scale = bool(node.attrs.get("is_causal")), node.attrs.get("scale")
    fix = _eager_strides(node, node.outputs[0].desc.shape)

    def run(*ins):
        return fix(attention(ins[qi], ins[ki], ins[vi], ins[mi] if mi is not None else None, causal, scale))
    return run


def make_decode_attention(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """DecodeAttention (query, key, value, lengths, scale) -> [B, Hq, 1, D] float32
    (`attention_kernels.incre_flash_attention`)."""
    qi, ki, vi, li = (_ref(node, n) for n in ("query", "key", "value", "lengths"))
    scale = node.attrs.get("scale")
    return lambda *ins: incre_flash_attention(ins[qi], ins[ki], ins[vi], ins[li], scale)


def make_kv_cache_update(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """KvCacheUpdate (cache, new, positions) -> the cache, written in place
    (`attention_kernels.scatter_update_`)."""
    ci, ni, pi_ = (_ref(node, n) for n in ("cache", "new", "positions"))
    return lambda *ins: scatter_update_(ins[ci], ins[ni], ins[pi_])


def make_gated_mlp(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """GatedMLP (x [M, K], w1, w3 [K, N]) -> silu(x·W1) · (x·W3) viewed as the node's shape:
    both GEMMs on the Cube (fp32 accumulation, results in x's dtype), SiLU and the product
    in UB in fp32, one rounding to x's dtype."""
    xi, w1i, w3i = (_ref(node, n) for n in ("x", "w1", "w3"))
    shape = tuple(int(s) for s in node.outputs[0].desc.shape)

    def run(*ins):
        x = ins[xi]
        a, b = cube_matmul(x, ins[w1i], x.dtype), cube_matmul(x, ins[w3i], x.dtype)
        return (F.silu(a.float()) * b.float()).to(x.dtype).view(shape)
    return run


# ops whose vnpu kernel also takes FRACTAL_NZ over the last axis (OpDef.npu_format "lastaxis")
LAST_AXIS_NZ = ("LayerNorm", "SoftmaxV2", "LogSoftmaxV2")

# op name -> its ND vnpu kernel factory (the OpDef rows take theirs from here)
FACTORIES: Dict[str, Callable] = {
    "LayerNorm": make_layer_norm, "RmsNorm": make_rms_norm, "SoftmaxV2": make_softmax,
    "LogSoftmaxV2": make_softmax, "ScaledDotProductAttention": make_sdpa,
    "DecodeAttention": make_decode_attention, "KvCacheUpdate": make_kv_cache_update, "GatedMLP": make_gated_mlp,
}


def host_nodes(graph: Graph) -> List[Node]:
    """Nodes of a vnpu ``graph`` with no vnpu kernel: neither a view (no kernel anywhere)
    nor an op with ``kernel_factories["vnpu"]``. These run their host (cpu) kernel."""
    return [n for n in graph.nodes
            if not get_op(n.op).is_view and "vnpu" not in get_op(n.op).kernel_factories]


__all__ = ["FACTORIES", "LAST_AXIS_NZ", "host_nodes", "make_data_movement", "make_decode_attention", "make_gated_mlp",
           "make_kv_cache_update", "make_layer_norm", "make_rms_norm", "make_sdpa", "make_softmax"]
