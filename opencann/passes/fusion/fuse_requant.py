"""`FuseRequant` (``fuse_requant``): an int8 layer whose fp32 result is only quantized again
by its readers ⇒ the layer writes uint8 at its readers' scale (CANN's AscendRequant fused
into the convolution / matmul), and their AscendQuant nodes go.

Before (what ``quantize_int8`` leaves, one per layer)::

    q1 = QuantConvBiasAct(x_u8, ...)            # fp32 out (AscendDequant fused)
    a  = AscendQuant(q1, scale=1/s, offset=z)   # uint8, read by the next int8 layer
    q2 = QuantConvBiasAct(a, ...)

After::

    q1 = QuantConvBiasAct(x_u8, ..., out_scale=s, out_offset=z)   # uint8 out
    q2 = QuantConvBiasAct(q1, ...)

Readers int8 can carry: AscendQuant nodes at one (scale, offset), Reshapes whose readers
are such (a transformer's FFN: GELU's output reshaped before the down-projection; the
Reshapes then carry uint8, `quant_readers`), and MaxPool nodes whose own readers are
such AscendQuant nodes (max commutes with the monotone quantization, so
``quant(maxpool(y)) == maxpool(quant(y))`` exactly: the MaxPool becomes a QuantMaxPool on
uint8). A QuantLinearAct writing bf16 (an int8 Linear inside a bf16 graph) is taken as
an fp32 one: it then skips the bf16 rounding the unfused graph does before quantizing.
Residual chains first (`_chain_ends`, then `_uint8_addends`): a chain's last
QuantConvAddAct, read only in fp32 (ResNet's global average pool), writes uint8 at its
calibrated result range (``out_record``) dequantized once for those readers
(AscendDequant), so the chain before it can stay uint8; a QuantConvAddAct whose readers are int8 takes
a uint8 version of its fp32 addend (the AscendQuant another int8 layer already reads, or
one made at its calibrated ``accum_record``) and writes uint8 into it (oneDNN's ``sum``
post-op with an int8 accumulator). Inductor's x86 int8 path and OpenVINO's LPT do the
same (``qconv2d_pointwise`` with an output scale / zero point and a uint8 output dtype).
It runs right after ``quantize_int8``.

It does not apply (a Skip with the reason) to: a dynamic QuantLinearAct; a layer read by
anything else (an fp32 reader, a graph output, readers at different scales); an
activation oneDNN does not run as a post-op (the eager op after the kernel needs fp32);
a QuantConvAddAct whose addend stays fp32 (oneDNN's ``sum`` post-op writes uint8 only
into a uint8 addend).

Numerics: oneDNN rounds ``acc * (s_x * s_w / s)`` once (round half to even, saturated to
[0, 255]) where the unfused graph rounds the fp32 result of ``acc * s_x * s_w`` divided
by s: a value on a rounding boundary may land one uint8 step apart (one ``s``). NaN and
±inf cannot appear inside: an int8 layer's result is finite (finite scales, a finite
bias), and its input was saturated when quantized (docs/guide/quantization.md).
Source: oneDNN developer guide, "Int8 Inference" (output scales and zero points);
PyTorch torch/_inductor/fx_passes/quantization.py (the int8-output qconv / qlinear)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import torch

from ...ir import DataType, Graph, Node, TensorDesc, Value
from ..base import PassContext, Skip
from .common import CpuFusion
from .quant_readers import VIEWS, QuantReaders, quant_readers, to_uint8

# activations each int8 kernel runs as a oneDNN post-op (before the output's requantization)
_NATIVE_ACT = {"QuantConvBiasAct": ("none", "relu"), "QuantConvAddAct": ("none", "relu"),
               "QuantLinearAct": ("none", "relu", "gelu", "gelu_tanh")}


@dataclass
class _RequantMatch:
    node: Node
    scale: float                 # the uint8 step s (AscendQuant's scale is 1/s)
    offset: int
    quants: List[Node]           # AscendQuant readers, removed
    pools: List[Node]            # MaxPool readers, replaced by QuantMaxPool
    views: List[Node] = field(default_factory=list)   # Reshapes on the way, retyped to uint8


def _quant_key(n: Node) -> Optional[Tuple[float, int]]:
    return (float(n.attrs["scale"]), int(n.attrs["offset"])) if n.op == "AscendQuant" else None


class FuseRequant(CpuFusion):
    """QuantConvBiasAct / QuantLinearAct → (MaxPool →) AscendQuant(s, z) ⇒ the layer with
    ``out_scale=s, out_offset=z`` and a uint8 output (→ QuantMaxPool)."""

    name, stage = "fuse_requant", "fusion"
    ops = ("QuantConvBiasAct", "QuantConvAddAct", "QuantLinearAct")

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """First the residual chains (`_chain_ends`, `_uint8_addends`), then every layer in
        graph order (`RewritePass.run`), then what the chains changed for layers that
        stayed fp32 is undone. Returns the layers given a uint8 output."""
        ends = self._ends = _chain_ends(graph)
        old = _uint8_addends(graph)
        n = super().run(graph, ctx)
        for node, (q, d) in ends.items():   # a chain end that stayed fp32: drop its quant pair
            if node.outputs[0].desc.dtype.torch != torch.uint8:
                for u in list(d.outputs[0].users):
                    u.replace_input(d.outputs[0], node.outputs[0])
                for g in (d, q):
                    graph.erase_node(g)
        for node, a in old.items():   # an addend moved to uint8 whose layer stayed fp32: undo
            if node.outputs[0].desc.dtype.torch != torch.uint8:
                u = node.inputs[node.attrs["other"].index]
                node.replace_input(u, a)
                for k in ("accum_scale", "accum_offset"):
                    node.attrs.pop(k)
                if u.producer is not None and u.producer.op == "AscendQuant" and not u.users \
                        and u not in graph.outputs:
                    graph.erase_node(u.producer)
        return n

    def match(self, node: Node, graph: Graph, ctx: PassContext):
        """A `_RequantMatch` when every reader of the layer's fp32 output quantizes it at
        one scale (directly or after a MaxPool); else a `Skip` naming the reader or fact
        that keeps the fp32 output."""
        if node.attrs.get("dynamic"):
            return Skip("dynamic QuantLinearAct: its readers' scale is not known at compile time")
        if node.attrs.get("act", "none") not in _NATIVE_ACT[node.op]:
            return Skip(f"activation {node.attrs.get('act')!r} runs after the kernel in fp32")
        out = node.outputs[0]
        bf16 = out.desc.dtype.torch == torch.bfloat16 and node.op == "QuantLinearAct"
        if not (out.desc.dtype.torch == torch.float32 or bf16) or out in graph.outputs:
            return Skip("the result is a graph output (the caller reads fp32)")
        keys, quants, pools, views = set(), [], [], []
        for u in out.users:
            if u.op == "AscendQuant":
                keys.add(_quant_key(u))
                quants.append(u)
            elif u.op == "MaxPool" and u.outputs[0].users and u.outputs[0] not in graph.outputs \
                    and all(w.op == "AscendQuant" for w in u.outputs[0].users):
                keys |= {_quant_key(w) for w in u.outputs[0].users}
                pools.append(u)
            elif u.op in VIEWS:     # a transformer's [B·S, H] -> [B, S, H] (-> [B·S, H]) between
                r = quant_readers(graph, u.outputs[0])
                if isinstance(r, Skip):
                    return Skip(f"after {u.name} ({u.op}): {r.reason}")
                keys |= r.keys
                quants += r.quants
                views += [u] + r.views
            else:
                return Skip(f"read in {'bf16' if bf16 else 'fp32'} by {u.name} ({u.op})")
        if len(keys) != 1:
            return Skip("no reader quantizes it" if not keys else
                        f"its readers quantize it at {len(keys)} different scales")
        if node.op == "QuantConvAddAct" and "accum_scale" not in node.attrs:
            return Skip("the residual addend stays fp32 (no int8 reader quantizes it and no calibrated "
                        "'accum' record, or its own chain ends in an fp32 reader): oneDNN's sum "
                        "post-op writes uint8 only into a uint8 addend")
        inv, offset = keys.pop()
        return _RequantMatch(node, 1.0 / inv, offset, quants, pools, views)

    def rewrite(self, graph: Graph, m: _RequantMatch, ctx: PassContext) -> int:
        """Give the layer ``out_scale`` / ``out_offset`` and a uint8 output, replace its
        MaxPool readers by QuantMaxPool and bypass every AscendQuant (erased). Returns 1."""
        node = m.node
        out = node.outputs[0]
        node.attrs.update(out_scale=m.scale, out_offset=m.offset)
        out.desc = _u8(out.desc)
        for p in m.pools:
            qp = graph.create_node("QuantMaxPool", list(p.inputs), dict(p.attrs), [_u8(p.outputs[0].desc)],
                                   name=p.name + "_u8", source=p.source, scope=p.scope, before=p)
            qp.meta.update({k: v for k, v in p.meta.items() if k in ("strides", "origin", "eager_strides")})
            graph.replace_all_uses_with(p.outputs[0], qp.outputs[0])
            graph.erase_node(p)
            m.quants.extend(qp.outputs[0].users)
        to_uint8(graph, QuantReaders(m.quants, m.views))
        end = "; the residual chain's end: its fp32 readers read one AscendDequant" \
            if node in getattr(self, "_ends", {}) else ""
        ctx.applied([node], f"uint8 out (scale {m.scale:.4g}, offset {m.offset}); "
                            f"{len(m.quants)} AscendQuant removed{end}")
        return 1


def _readers_key(graph: Graph, v, moving) -> Optional[Tuple[float, int]]:
    """The one (scale, offset) at which every reader of ``v`` quantizes it, counting a
    QuantConvAddAct in ``moving`` reading it as its addend (it will read the quantized
    value instead); None when another reader, a graph output or two scales."""
    if v in graph.outputs:
        return None
    keys = set()
    for u in v.users:
        if u.op == "AscendQuant":
            keys.add(_quant_key(u))
        elif not (u in moving and u.inputs[u.attrs["other"].index] is v
                  and sum(1 for x in u.inputs if x is v) == 1):
            return None
    return keys.pop() if len(keys) == 1 else None


def _uint8_addends(graph: Graph) -> Dict[Node, Value]:
    """Residual chains (ResNet's identity blocks): a QuantConvAddAct whose fp32 addend is
    also quantized for another int8 layer (an AscendQuant reader) and whose own output
    only int8 layers read takes that uint8 tensor as its addend (``accum_scale`` /
    ``accum_offset``); an addend no AscendQuant reads is quantized at the layer's
    calibrated ``accum_record`` when it has one (a new AscendQuant, which the addend's
    producer then absorbs). Decided last block first: a block's output may be the next block's
    addend. In place into the uint8 addend when `_why_not_in_place` allows, else into a
    copy. Returns {layer: its fp32 addend} of the layers changed."""
    from .conv_add_act import _why_not_in_place
    adds = [n for n in graph.nodes if n.op == "QuantConvAddAct" and n.attrs.get("act") in ("none", "relu")]
    moving: Dict[Node, Node] = {}
    for c in reversed(adds):
        a = c.inputs[c.attrs["other"].index]
        q = next((u for u in a.users if u.op == "AscendQuant"), None)
        if a.desc.dtype.torch != torch.float32 or _readers_key(graph, c.outputs[0], moving) is None:
            continue
        if q is None and c.attrs.get("accum_record") and a.producer is not None:
            q = _quant_of(graph, a, c)     # the calibrated addend (e.g. a downsample output)
        if q is not None:
            moving[c] = q
    old = {}
    for c, q in moving.items():
        k = c.attrs["other"].index
        old[c] = c.inputs[k]
        inv, off = _quant_key(q)
        c.attrs.update(accum_scale=1.0 / inv, accum_offset=off)
        c.replace_input(old[c], q.outputs[0])
        why = _why_not_in_place(graph, c, c, q.outputs[0], conv_reads=[c.inputs[c.attrs["input"].index]])
        c.attrs["inplace"] = not why
        if why:
            c.attrs.pop("inplace_input", None)
        else:
            c.attrs["inplace_input"] = k
    return old


def _chain_ends(graph: Graph) -> Dict[Node, Tuple[Node, Node]]:
    """Residual chains ending in fp32 readers (ResNet's last block, read by the global
    average pool): a QuantConvAddAct with a calibrated result range (``out_record``)
    whose readers are all fp32 ops (not a graph output; no AscendQuant or int8 layer
    reads it) and whose addend can be uint8 (an AscendQuant reads it, or an
    ``accum_record``) gets AscendQuant → AscendDequant at that range, its readers reading
    the dequantized value. Its only reader is then an AscendQuant, so `_uint8_addends`
    and `match` give it, and the blocks before it, a uint8 result (oneDNN writes fp32
    only into an fp32 addend: without this the whole chain stays fp32, quantized again
    for every int8 reader). Returns {layer: (AscendQuant, AscendDequant)} (`run` drops
    the pair of a layer that stays fp32)."""
    from ...ir import TensorRef
    order = {n: i for i, n in enumerate(graph.nodes)}
    out: Dict[Node, Tuple[Node, Node]] = {}
    for c in list(graph.nodes):
        v = c.outputs[0] if c.op == "QuantConvAddAct" else None
        if v is None or c.attrs.get("act") not in ("none", "relu") or not c.attrs.get("out_record") \
                or v.desc.dtype.torch != torch.float32 or v in graph.outputs or not v.users \
                or any(u.op == "AscendQuant" or u.op in _NATIVE_ACT for u in v.users):
            continue
        a = c.inputs[c.attrs["other"].index]
        if not (c.attrs.get("accum_record") or any(u.op == "AscendQuant" for u in a.users)):
            continue
        step, off = c.attrs["out_record"]
        readers = sorted(v.users, key=order.__getitem__)
        q = graph.create_node("AscendQuant", [v], {"self": TensorRef(0), "scale": 1.0 / step, "offset": int(off)},
                              [_u8(v.desc)], name=f"{c.name}_out_quant", source=c.source, scope=c.scope,
                              before=readers[0])
        d = graph.create_node("AscendDequant", [q.outputs[0]], {"self": TensorRef(0), "scale": float(step),
                                                                  "offset": int(off)},
                              [v.desc], name=f"{c.name}_out_dequant", source=c.source, scope=c.scope,
                              before=readers[0])
        st = (c.meta.get("strides") or [None])[0]
        if st is not None:
            q.meta["strides"], d.meta["strides"] = [st], [st]
        for u in readers:
            u.replace_input(v, d.outputs[0])
        out[c] = (q, d)
    return out


def _quant_of(graph: Graph, a: Value, c: Node) -> Node:
    """A new AscendQuant of ``a`` at ``c``'s calibrated addend record (``accum_record``:
    [step, zero point]), placed before ``c``, keeping ``a``'s strides."""
    from ...ir import TensorRef
    step, off = c.attrs["accum_record"]
    q = graph.create_node("AscendQuant", [a], {"self": TensorRef(0), "scale": 1.0 / step, "offset": int(off)},
                          [_u8(a.desc)], name=f"{c.name}_addend_quant", source=c.source, scope=c.scope,
                          before=c)
    p = a.producer
    st = (p.meta.get("strides") or [None] * len(p.outputs))[p.outputs.index(a)]
    if st is not None:
        q.meta["strides"] = [st]
    return q


def _u8(d: TensorDesc) -> TensorDesc:
    return replace(d, dtype=DataType.UINT8)


__all__ = ["FuseRequant"]
