"""`QuantizeInt8` (``quantize_int8``): ConvBiasAct / ConvAddAct / LinearAct with a constant
fp32 weight ⇒ AscendQuant → QuantConvBiasAct / QuantConvAddAct / QuantLinearAct (int8
kernels, fp32 output: CANN's AscendDequant fused into the kernel), driven by the compile
option ``quant_config`` that `opencann.quantize` fills from calibration.

It runs after the CPU layout stage, so every value keeps the layout that stage chose: the
AscendQuant of an NHWC activation writes NHWC uint8, read by the int8 convolution
without a reorder, and the int8 kernels' fp32 results take the fp32 ops' places.

``quant_config`` (AMCT's record names: ``scale_d`` / ``offset_d`` for data, per layer):

- ``layers``: {fused node name: {"scale_d": step (a finite float >= 2**-126), "offset_d":
  zero point (an int in [0, 255])}} — the activation's uint8 quantization, per tensor (a
  record outside that, ``"accum"`` / ``"out"`` included, is a ValueError line naming the
  layer and the field: `check_record`, never a layer silently kept fp32); a ConvAddAct's record may
  add ``"accum"`` (the same for its residual addend: ``fuse_requant`` then quantizes an
  addend no other int8 layer reads, e.g. ResNet's downsample output) and ``"out"`` (the
  same for its result: ``fuse_requant`` keeps a residual chain in uint8 up to a last
  block whose result an fp32 op reads, e.g. ResNet's global average pool);
- ``skip_layers``: module names (AMCT's layer names: the node's ``scope``, e.g.
  ``layer1.0.conv2``), node names or traced labels (``meta["origin"]``) kept in fp32;
  a record or ``skip_layers`` name of no such node (a typo, a module name as a record's
  key, a node int8 does not take) is one ValueError line (`check_layer_names`);
- ``dynamic_linear``: LinearAct nodes without a record quantize x per call.

Inside a bf16 graph (``precision_mode`` ``allow_mix_precision_bf16``, or ``node_precision``
giving the layer "bf16", as ``opencann.tune``'s int8 candidate does) a LinearAct computes
in bf16: x and its output are bf16 and its weight a bf16 constant. It becomes
``AscendQuant(x_bf16)`` (the uint8 quantization read straight from bf16, no Cast) →
``QuantLinearAct`` writing bf16 (oneDNN's ``output_dtype``; bit for bit the fp32 result
cast to bf16), so the layer keeps the bf16 op's place with no Cast around it; when its
readers only cast its result up to fp32 (an fp32 residual Add after it) it writes fp32
itself and those Casts go (its value then is not rounded to bf16). Its int8
weight is ARQ of the bf16 weight (the fp32 one was cast at compile time by ``precision``:
one more rounding, at most a quarter of an int8 step, 2^-9 of max|w| per channel); its
bias goes back to fp32 (exact). Only a oneDNN post-op activation (none, ReLU, GELU) is
taken in bf16; convolutions are quantized from fp32 graphs only.

An ONNX model's ``quantize_dynamic`` MatMuls (their weights named in
``graph.meta["int8_dynamic_weights"]`` by ``frontend/onnx/dynamic_quant.py``) run dynamic as
well, with or without ``quant_config``.

Weights: AMCT's ARQ, symmetric int8 per output channel, ``scale_w = max|w| / qmax``,
``w_q = round_half_even(w / scale_w)`` in [-qmax, qmax] (offset_w 0), done once here; the
int8 weight and its scales are the graph's constants (saved in the model file) and the
fp32 weight is dropped. ``qmax`` is this CPU's `int8_weight_qmax`: 127 with VNNI /
AMX-int8, 64 (7-bit weights) on x86 without them, where oneDNN's kernels add pairs of
u8 x s8 products in int16 with saturation (255 x 64 x 2 = 32 640 fits, 255 x 127 x 2 does
not: `opencann.devices.cpu.int8_weight_bound`); the layers' report rows and one note say
so. Weights an ONNX file gives (`exact_int8`) keep the file's values. Source: CANN AMCT
user guide ("ARQ", "IFMR", the quantization record's scale_d / offset_d / scale_w /
offset_w); oneDNN "Int8 Inference" and "Nuances of int8 computations" (7-bit data without
VNNI); NNCF's ``overflow_fix`` (the same halved weight range)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from ...devices.cpu import int8_weight_qmax
from ...ir import DataType, Graph, Node, TensorDesc, TensorRef, Value
from ...ops.kernels.int8_quantize import check_record
from ..base import PassContext, Skip
from .common import CpuFusion
from .quant_names import check_layer_names, layer_labels

_TARGETS = {"ConvBiasAct": "QuantConvBiasAct", "ConvAddAct": "QuantConvAddAct",
            "LinearAct": "QuantLinearAct"}


def quantize_weight(w: torch.Tensor, axis: int, qmax: int = 127) -> "tuple[torch.Tensor, torch.Tensor]":
    """ARQ: ``w`` (float) to (int8 weight, fp32 scales along ``axis``), symmetric per channel:
    scale = max|w| / qmax over every other dim (1.0 for an all-zero channel), values
    round-half-even(w / scale) in [-qmax, qmax]; ``qmax`` in [1, 127] (the CPU pass gives
    `int8_weight_qmax`: 64 on x86 without VNNI). NaN/inf weights: ValueError (one line)."""
    wf = w.detach().float()
    if not torch.isfinite(wf).all():
        raise ValueError("the weight holds NaN or inf: it cannot be quantized; keep the layer "
                         "in fp32 with skip_layers")
    dims = [d for d in range(wf.dim()) if d != axis]
    amax = wf.abs().amax(dim=dims)
    scale = torch.where(amax > 0, amax / float(qmax), torch.ones_like(amax))
    view = [1] * wf.dim()
    view[axis] = -1
    q = torch.round(wf / scale.view(view)).clamp_(-qmax, qmax).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def exact_int8(w: torch.Tensor, axis: int):
    """(int8 weight, fp32 scales along ``axis``) that give back ``w`` exactly (``q * s ==
    w`` in fp32): symmetric per channel (``s = max|w| / qmax`` per channel, ARQ), else one
    symmetric scale for the tensor (repeated per channel), for qmax 127 (8-bit) or 64
    (7-bit: ONNX Runtime's ``reduce_range``, which runs on oneDNN's kernels where the
    CPU's u8 x s8 products saturate, `int8_weight_bound`); None when none does (an
    asymmetric weight, or another range)."""
    view = [1] * w.dim()
    view[axis] = -1
    amax = float(w.abs().max())
    for qmax in (127, 64):
        wq, ws = quantize_weight(w, axis, qmax)
        if torch.equal(wq.float() * ws.view(view), w):
            return wq, ws
        if amax == 0.0:
            continue
        s = torch.tensor(amax / qmax, dtype=torch.float32)
        q = torch.round(w / s).clamp_(-qmax, qmax)
        if torch.equal(q * s, w):
            return q.to(torch.int8).contiguous(), s.repeat(w.shape[axis]).contiguous()
    return None


@dataclass
class _QMatch:
    node: Node
    record: Optional[Dict[str, Any]]   # {"scale_d", "offset_d"}; None: dynamic
    detail: str = ""                   # the applied entry's text (default: the record's)
    weight: Optional[tuple] = None     # (int8 weight, fp32 scales) given; default: ARQ of the fp32 one


# activations a bf16 QuantLinearAct runs as oneDNN post-ops (before its bf16 rounding)
_BF16_ACTS = ("none", "relu", "gelu", "gelu_tanh")


def _bf16_linear(node: Node) -> bool:
    """Whether ``node`` (a LinearAct) computes in bf16: x, a constant weight, its bias
    (if any, constant) and its output all bf16."""
    x, w = node.arg("mat1"), node.arg("mat2")
    b = node.attrs.get("self")
    bf = torch.bfloat16
    return (x.desc.dtype.torch == bf and w.is_const and w.desc.dtype.torch == bf
            and node.outputs[0].desc.dtype.torch == bf
            and (not isinstance(b, TensorRef) or (node.inputs[b.index].is_const
                                                  and node.inputs[b.index].desc.dtype.torch == bf)))


def _fp32_readers(graph: Graph, v: Value) -> bool:
    """Whether every reader of the bf16 ``v`` is a Cast to fp32 (``precision``'s, before an
    fp32 op) and ``v`` is no graph output: the int8 layer may then write fp32 itself."""
    return bool(v.users) and v not in graph.outputs and all(
        u.op == "Cast" and u.outputs[0].desc.dtype.torch == torch.float32 and u.outputs[0] not in graph.outputs
        for u in v.users)


_BF16_CONV = ("a bf16 convolution: int8 takes convolutions from fp32 graphs only (kept in bf16; "
              "quantize without precision_mode to run it int8)")


def _other_float(dtype: str) -> str:
    """Why a layer of a float dtype int8 does not quantize from (float64, float16) stays so."""
    return (f"a {dtype} layer: int8 quantizes float32 (and bf16) convolutions and linears; kept in "
            f"{dtype} (cast the model to float32, model.float(), to quantize it)")


def _not_a_target(node: Node) -> Optional[str]:
    """Why a convolution or matmul with a constant float weight that the int8 rewrite
    does not take stays in float (a `quant_report` row), or None for other nodes: a
    convolution left unfused (transposed, 1-D / 3-D, output padding: `_conv_check`'s
    rules) or a matmul / batched matmul with a constant operand that is not a Linear."""
    if node.op == "Conv2D":
        w = node.arg("weight")
        if not (w.is_const and w.desc.dtype.is_floating):
            return None
        if w.desc.dtype.torch not in (torch.float32, torch.bfloat16):
            return _other_float(w.desc.dtype.value)
        if node.outputs[0].desc.dtype.torch == torch.bfloat16:
            return _BF16_CONV
        if node.attrs.get("transposed"):
            kind = "a transposed convolution"
        elif node.outputs[0].desc.rank != 4:
            kind = f"a {node.outputs[0].desc.rank - 2}-D convolution"
        else:
            kind = "a convolution not fused into ConvBiasAct"
        return (f"{kind}: the int8 kernels take 2-D forward convolutions (QuantConvBiasAct); "
                f"kept in {w.desc.dtype.value}")
    if node.op in ("MatMul", "BatchMatMul", "MatMulV2"):
        const = [v for v in node.inputs if v.is_const and v.desc.dtype.is_floating and v.desc.rank >= 2]
        if const and const[0].desc.dtype.torch not in (torch.float32, torch.bfloat16):
            return _other_float(const[0].desc.dtype.value)
        if const:
            return (f"{node.op} with a constant operand that is not a Linear's weight (LinearAct): "
                    f"kept in {const[0].desc.dtype.value}")
    return None


class QuantizeInt8(CpuFusion):
    """ConvBiasAct / ConvAddAct / LinearAct(x, W fp32 const) ⇒ AscendQuant(x) →
    QuantConvBiasAct / QuantConvAddAct / QuantLinearAct(x_u8, W_int8, scale_w) (fp32 out);
    a dynamic LinearAct ⇒ QuantLinearAct(x fp32, W_int8, scale_w, dynamic)."""

    name, stage = "quantize_int8", "fusion"
    ops = tuple(_TARGETS)

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Rewrite every target named by ``options["quant_config"]`` (nothing without it:
        the note says so); AscendQuant nodes of one value at one scale are shared. Raises
        ValueError (one line) for a record or ``skip_layers`` name of no layer here
        (`check_layer_names`)."""
        cfg = ctx.options.get("quant_config")
        onnx_dynamic = graph.meta.get("int8_dynamic_weights")
        if onnx_dynamic:
            cfg = dict(cfg or {"layers": {}}, dynamic_weights=set(onnx_dynamic))
        if not cfg:
            ctx.note("no quant_config: nothing quantized (opencann.quantize sets it)")
            return 0
        check_layer_names(graph, cfg, self.ops, _not_a_target)   # a name of no layer: one error line
        self._cfg = cfg
        self._quants: Dict[tuple, Value] = {}
        self._narrow = 0    # layers given 7-bit weights in this run (a note says why)
        n = super().run(graph, ctx)
        for node in graph.nodes:     # layers no target covers: a row each, with the reason
            why = _not_a_target(node)
            if why is not None:
                ctx.skip(Skip(why, node))
        graph.prune_constants()
        q = int8_weight_qmax()
        ctx.note(f"{n} layer(s) in int8" + (
            f"; {self._narrow} with 7-bit weights in [-{q}, {q}] (scale_w = max|w| / {q}): this CPU has "
            f"no VNNI, its oneDNN u8 x s8 kernels add pairs of products in int16 and saturate beyond "
            f"that (255 x {q} x 2 <= 32767), so they stay exact" if self._narrow else ""))
        return n

    def match(self, node: Node, graph: Graph, ctx: PassContext):
        """A `_QMatch` for a target with a constant fp32 weight and fp32 x (2-D for a
        LinearAct) that has a record in ``layers`` (or, for a LinearAct, ``dynamic_linear``);
        else a `Skip` naming why it stays fp32."""
        cfg = self._cfg
        w = node.arg("weight" if node.op != "LinearAct" else "mat2")
        x = node.arg("input" if node.op != "LinearAct" else "mat1")
        runs = "bf16" if x.desc.dtype.torch == torch.bfloat16 else "fp32"
        if layer_labels(node) & set(cfg.get("skip_layers") or ()):     # kept as it computes: fp32 or bf16
            return Skip(f"in skip_layers: kept in {runs}")
        if node.meta.get("keep_dtype"):    # the option keep_dtype named it (precision pass)
            return Skip(f"in keep_dtype: kept in {runs}, its original dtype")
        if node.op == "LinearAct" and _bf16_linear(node):
            if node.attrs.get("act", "none") not in _BF16_ACTS:
                return Skip(f"bf16 LinearAct with activation {node.attrs.get('act')!r}: int8 in a bf16 graph "
                            f"takes {', '.join(_BF16_ACTS)} (oneDNN post-ops); kept in bf16")
        elif node.op != "LinearAct" and x.desc.dtype.torch == torch.bfloat16:
            return Skip(_BF16_CONV)
        elif not (w.is_const and w.desc.dtype.torch == torch.float32 and x.desc.dtype.torch == torch.float32):
            other = {d for d in (x.desc.dtype, w.desc.dtype) if d.is_floating and d.torch not in
                     (torch.float32, torch.bfloat16)}
            if other:
                return Skip(_other_float(other.pop().value))
            return Skip("the weight is not a constant fp32 tensor or x is not fp32 (bf16 is taken by "
                        "linears only: x, weight and result bf16)")
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
            return Skip("no calibration record for this layer (quant_config['layers']: no calibration "
                        "batch had a finite value at its input, or it was not calibrated)")
        check_record(node.name, rec)     # a bad hand-written record: one error line, not fp32
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
        qmax = 127 if m.weight else int8_weight_qmax()
        wq, ws = m.weight or quantize_weight(w.const, 1 if linear else 0, qmax)
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
        if qmax < 127:
            self._narrow += 1
            detail += f"; 7-bit weights [-{qmax}, {qmax}] (no VNNI)"
        bias = attrs.get("self")
        if linear and isinstance(bias, TensorRef) and ins[bias.index].desc.dtype.torch != torch.float32:
            b = ins[bias.index]
            ins[bias.index] = graph.add_const(b.const.float(), f"{node.name}_bias_fp32")
        ins.append(graph.add_const(ws, f"{node.name}_w_scale"))
        attrs["w_scale"] = TensorRef(len(ins) - 1)
        q = graph.create_node(_TARGETS[node.op], ins, attrs, [node.outputs[0].desc],
                              name=node.name + "_int8", source=node.source, scope=node.scope,
                              before=node)
        q.meta.update({k: v for k, v in node.meta.items() if k in ("strides", "origin", "eager_strides")})
        graph.replace_all_uses_with(node.outputs[0], q.outputs[0])
        graph.erase_node(node)
        if linear and q.outputs[0].desc.dtype.torch == torch.bfloat16 and _fp32_readers(graph, q.outputs[0]):
            ups = list(q.outputs[0].users)
            q.outputs[0].desc = q.outputs[0].desc.with_(dtype=DataType.FLOAT)
            for c in ups:
                graph.replace_all_uses_with(c.outputs[0], q.outputs[0])
                graph.erase_node(c)
            detail += "; writes fp32 (its readers cast it up: not rounded to bf16)"
        ctx.applied([node], detail)
        return 1
