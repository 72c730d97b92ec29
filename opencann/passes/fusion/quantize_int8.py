"""`QuantizeInt8` (``quantize_int8``): ConvBiasAct / ConvAddAct / LinearAct with a constant
fp32 weight ⇒ AscendQuant → QuantConvBiasAct / QuantConvAddAct / QuantLinearAct (int8
kernels, fp32 output: CANN's AscendDequant fused into the kernel), driven by the compile
option ``quant_config`` that `opencann.quantize` fills from calibration.

It runs after the CPU layout stage, so every value keeps the layout that stage chose: the
AscendQuant of an NHWC activation writes NHWC uint8, read by the int8 convolution
without a reorder, and the int8 kernels' fp32 results take the fp32 ops' places.

``quant_config`` (AMCT's record names: ``scale_d`` / ``offset_d`` for data, per layer):

- ``layers``: {fused node name: {"scale_d": step (float > 0), "offset_d": zero point in
  [0, 255]}} — the activation's uint8 quantization, per tensor; a ConvAddAct's record may
  add ``"accum"`` (the same for its residual addend: ``fuse_requant`` then quantizes an
  addend no other int8 layer reads, e.g. ResNet's downsample output) and ``"out"`` (the
  same for its result: ``fuse_requant`` keeps a residual chain in uint8 up to a last
  block whose result an fp32 op reads, e.g. ResNet's global average pool);
- ``skip_layers``: module names (AMCT's layer names: the node's ``scope``, e.g.
  ``layer1.0.conv2``), node names or traced labels (``meta["origin"]``) kept in fp32;
- ``dynamic_linear``: LinearAct nodes without a record quantize x per call.

An ONNX model's ``quantize_dynamic`` MatMuls (their weights named in
``graph.meta["int8_dynamic_weights"]`` by ``frontend/onnx/dynamic_quant.py``) run dynamic as
well, with or without ``quant_config``.

Weights: AMCT's ARQ, symmetric int8 per output channel, ``scale_w = max|w| / 127``,
``w_q = round_half_even(w / scale_w)`` in [-127, 127] (offset_w 0), done once here; the
int8 weight and its scales are the graph's constants (saved in the model file) and the
fp32 weight is dropped. Source: CANN AMCT user guide ("ARQ", "IFMR", the quantization
record's scale_d / offset_d / scale_w / offset_w); oneDNN "Int8 Inference"."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from ...ir import DataType, Graph, Node, TensorDesc, TensorRef, Value
from ..base import PassContext, Skip
from .common import CpuFusion

_TARGETS = {"ConvBiasAct": "QuantConvBiasAct", "ConvAddAct": "QuantConvAddAct",
            "LinearAct": "QuantLinearAct"}


def quantize_weight(w: torch.Tensor, axis: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """ARQ: ``w`` (float) to (int8 weight, fp32 scales along ``axis``), symmetric per channel:
    scale = max|w| / 127 over every other dim (1.0 for an all-zero channel), values
    round-half-even(w / scale) in [-127, 127]. NaN/inf weights: ValueError (one line)."""
    wf = w.detach().float()
    if not torch.isfinite(wf).all():
        raise ValueError("the weight holds NaN or inf: it cannot be quantized; keep the layer "
                         "in fp32 with skip_layers")
    dims = [d for d in range(wf.dim()) if d != axis]
    amax = wf.abs().amax(dim=dims)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    view = [1] * wf.dim()
    view[axis] = -1
    q = torch.round(wf / scale.view(view)).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def exact_int8(w: torch.Tensor, axis: int):
    """(int8 weight, fp32 scales along ``axis``) that give back ``w`` exactly (``q * s ==
    w`` in fp32): symmetric per channel (``s = max|w| / 127`` per channel, ARQ), else one
    symmetric scale for the tensor (repeated per channel); None when neither does (an
    asymmetric or reduced-range weight)."""
    view = [1] * w.dim()
    view[axis] = -1
    wq, ws = quantize_weight(w, axis)
    if torch.equal(wq.float() * ws.view(view), w):
        return wq, ws
    amax = float(w.abs().max())
    if amax == 0.0:
        return None
    s = torch.tensor(amax / 127.0, dtype=torch.float32)
    q = torch.round(w / s).clamp_(-127, 127)
    if torch.equal(q * s, w):
        return q.to(torch.int8).contiguous(), s.repeat(w.shape[axis]).contiguous()
    return None


@dataclass
class _QMatch:
    node: Node
    record: Optional[Dict[str, Any]]   # {"scale_d", "offset_d"}; None: dynamic
    detail: str = ""                   # the applied entry's text (default: the record's)
    weight: Optional[tuple] = None     # (int8 weight, fp32 scales) given; default: ARQ of the fp32 one


def layer_labels(node: Node) -> set:
    """The names ``skip_layers`` may give for ``node``: its own, its module's (``scope``,
    AMCT's layer name, e.g. ``layer1.0.conv2``) and its traced labels."""
    own = {node.name} | ({node.scope} if node.scope else set())
    return own | {lab.partition(".")[0] for lab in (node.meta.get("origin") or ()) if lab}


class QuantizeInt8(CpuFusion):
    """ConvBiasAct / ConvAddAct / LinearAct(x, W fp32 const) ⇒ AscendQuant(x) →
    QuantConvBiasAct / QuantConvAddAct / QuantLinearAct(x_u8, W_int8, scale_w) (fp32 out);
    a dynamic LinearAct ⇒ QuantLinearAct(x fp32, W_int8, scale_w, dynamic)."""

    name, stage = "quantize_int8", "fusion"
    ops = tuple(_TARGETS)

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Rewrite every target named by ``options["quant_config"]`` (nothing without it:
        the note says so); AscendQuant nodes of one value at one scale are shared."""
        cfg = ctx.options.get("quant_config")
        onnx_dynamic = graph.meta.get("int8_dynamic_weights")
        if onnx_dynamic:
            cfg = dict(cfg or {"layers": {}}, dynamic_weights=set(onnx_dynamic))
        if not cfg:
            ctx.note("no quant_config: nothing quantized (opencann.quantize sets it)")
            return 0
        self._cfg = cfg
        self._quants: Dict[tuple, Value] = {}
        n = super().run(graph, ctx)
        graph.prune_constants()
        ctx.note(f"{n} layer(s) in int8")
        return n

    def match(self, node: Node, graph: Graph, ctx: PassContext):
        """A `_QMatch` for a target with a constant fp32 weight and fp32 x (2-D for a
        LinearAct) that has a record in ``layers`` (or, for a LinearAct, ``dynamic_linear``);
        else a `Skip` naming why it stays fp32."""
        cfg = self._cfg
        if layer_labels(node) & set(cfg.get("skip_layers") or ()):
            return Skip("in skip_layers: kept in fp32")
        w = node.arg("weight" if node.op != "LinearAct" else "mat2")
        x = node.arg("input" if node.op != "LinearAct" else "mat1")
        if not (w.is_const and w.desc.dtype.torch == torch.float32 and x.desc.dtype.torch == torch.float32):
            return Skip("the weight is not a constant fp32 tensor or x is not fp32")
        if node.op == "LinearAct" and (x.desc.rank != 2 or w.desc.rank != 2):
            return Skip("not a 2-D GEMM")
        if not torch.isfinite(w.const).all():
            return Skip("the weight holds NaN or inf")
        rec = (cfg.get("layers") or {}).get(node.name)
        if rec is None:
            if node.op == "LinearAct" and w.name in cfg.get("dynamic_weights", ()):
                weight = exact_int8(w.const, 1)    # the ONNX file's int8 weight, when symmetric
                return _QMatch(node, None, "int8 dynamic (x quantized per call); "
                               + ("the file's int8 weights" if weight else "weights requantized per channel"),
                               weight)
            if node.op == "LinearAct" and cfg.get("dynamic_linear"):
                return _QMatch(node, None)
            return Skip("no calibration record for this layer (quant_config['layers'])")
        step, off = rec.get("scale_d"), rec.get("offset_d")
        if not (isinstance(step, (int, float)) and math.isfinite(step) and step > 0
                and isinstance(off, int) and 0 <= off <= 255):
            return Skip(f"bad record {rec!r}: scale_d must be a finite float > 0, offset_d an int in [0, 255]")
        return _QMatch(node, rec)

    def _quant(self, graph: Graph, x: Value, step: float, offset: int, before: Node) -> Value:
        """The uint8 value of ``x`` at (step, offset): an AscendQuant made once per key."""
        key = (x.id, step, offset)
        if key not in self._quants:
            d = x.desc
            q = graph.create_node("AscendQuant", [x], {"scale": 1.0 / step, "offset": offset},
                                  [TensorDesc(d.shape, DataType.UINT8, d.format)],
                                  name=f"{before.name}_quant", source=before.source,
                                  scope=before.scope, before=before)
            p = x.producer
            st = (p.meta.get("strides") or [None] * len(p.outputs))[p.outputs.index(x)] if p else None
            if st is not None:
                q.meta["strides"] = [st]
            self._quants[key] = q.outputs[0]
        return self._quants[key]

    def rewrite(self, graph: Graph, m: _QMatch, ctx: PassContext) -> int:
        """Replace the node by its int8 op (inputs: the fp32 node's, with x quantized,
        the weight in int8 and ``w_scale`` appended; attrs: the same plus ``w_scale``,
        ``x_scale``, ``x_offset`` or ``dynamic``). Returns 1."""
        node, rec = m.node, m.record
        linear = node.op == "LinearAct"
        wname, xname = ("mat2", "mat1") if linear else ("weight", "input")
        w = node.arg(wname)
        wq, ws = m.weight or quantize_weight(w.const, 1 if linear else 0)
        ins = list(node.inputs)
        attrs = dict(node.attrs)
        xi, wi = attrs[xname].index, attrs[wname].index
        ins[wi] = graph.add_const(wq, f"{node.name}_w_int8")
        if rec is not None:
            step, off = float(rec["scale_d"]), int(rec["offset_d"])
            ins[xi] = self._quant(graph, node.inputs[xi], step, off, node)
            attrs.update(x_scale=step, x_offset=off)
            for key, attr in (("accum", "accum_record"), ("out", "out_record")):
                r = rec.get(key)   # the addend's / the result's range, for fuse_requant
                if node.op == "ConvAddAct" and isinstance(r, dict):
                    attrs[attr] = [float(r["scale_d"]), int(r["offset_d"])]
            detail = m.detail or f"int8 static (scale_d={step:.4g}, offset_d={off})"
        else:
            attrs["dynamic"] = True
            detail = m.detail or "int8 dynamic (x quantized per call)"
        ins.append(graph.add_const(ws, f"{node.name}_w_scale"))
        attrs["w_scale"] = TensorRef(len(ins) - 1)
        q = graph.create_node(_TARGETS[node.op], ins, attrs, [node.outputs[0].desc],
                              name=node.name + "_int8", source=node.source, scope=node.scope,
                              before=node)
        q.meta.update({k: v for k, v in node.meta.items() if k in ("strides", "origin", "eager_strides")})
        graph.replace_all_uses_with(node.outputs[0], q.outputs[0])
        graph.erase_node(node)
        ctx.applied([node], detail)
        return 1
