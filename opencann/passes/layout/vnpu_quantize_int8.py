"""Stage 3 (before `NpuLayoutSelection`), vnpu only: the int8 path as CANN runs it.

`VnpuQuantizeInt8` (``vnpu_quantize_int8``), driven by the same ``quant_config`` the CPU
pass ``quantize_int8`` reads (AMCT's records: ``layers`` {node name: {"scale_d",
"offset_d"}}, ``skip_layers``; `opencann.quantize` fills it from calibration):

    Conv2D(x, W, b)          ⇒ AscendQuant(x) → Conv2D(x_i8, W_i8, corr_i32; offset_x)
                                → AscendDequant(acc_i32, deq_scale, b)
    MatMulV2(b, x, W) / MatMul(x, W)
                             ⇒ AscendQuant(x) → MatMulV2(corr_i32, x_i8, W_i8; offset_x)
                                → AscendDequant(acc_i32, deq_scale, b)

- AscendQuant: fp32 (or fp16) → int8, ``round(x / scale_d) + offset_x`` with ``offset_x =
  offset_d - 128`` (AMCT's uint8 record read as int8: the same levels shifted by 128);
  the layout pass then stores it NC1HWC0 / FRACTAL_NZ at C0 = 32 where its Cube consumer
  reads those formats.
- the Cube op: int8 × int8 accumulated exactly in int32 (L0C); weights quantized once
  here by ARQ (`quantize_weight`: symmetric per output channel, ``scale_w = max|W| /
  127``, the CPU pass's function: both devices hold the same int8 weight where the host
  CPU's int8 products are exact at 8 bits; on x86 without VNNI the CPU pass takes 7 bits,
  `opencann.devices.cpu.int8_weight_bound`, and the Cube keeps 8); its int32
  bias is the offset correction ``-offset_x · Σ W_i8`` per output channel, and a
  convolution's padding reads ``offset_x`` (CANN Conv2D's attribute), so the int32 sum is
  exactly ``Σ (x_i8 - offset_x) · W_i8``.
- AscendDequant: int32 → fp32 ``acc · deq_scale[c] + b[c]``, ``deq_scale = scale_d ·
  scale_w[c]`` (fp32), the layer's fp32 bias added after it, as the CPU int8 kernels do:
  both devices give the same values to fp32 rounding. In an fp16 model (x and W fp16:
  CANN's inference default) the same fp32 arithmetic is rounded once to fp16, the output
  dtype (the FixPipe's DEQF16); `VnpuUbEpilogue` then fuses it into the Cube op where the
  preset has ``fixpipe_quant``.

An ONNX QDQ / QOperator model (the frontend's uint8 AscendQuant → AscendDequant) is not
lowered here: it runs the float emulation on the vnpu, and the pass says so in a report
note (lowering it to this int8 Cube path is not built yet). So does an ONNX
``quantize_dynamic`` model (``graph.meta["int8_dynamic_weights"]``, the frontend's MatMuls
over the file's dequantized weights, ``frontend/onnx/dynamic_quant.py``): each such MatMul
reads x through a ``DynamicQuantDequant`` (x on DynamicQuantizeLinear's uint8 grid, its
range taken per call, dequantized: the levels the CPU's dynamic QuantLinearAct takes) and
multiplies in fp32 on the Cube, with or without ``quant_config``; CANN's AscendQuant takes
a calibrated scale, so there is no int8 Cube path for it.

Layers kept in fp32, each reported with its reason: ``skip_layers``, no record, a
non-constant or non-fp32 weight or x, NaN/inf weights, a transposed or grouped
convolution, a matmul whose ``beta`` / ``alpha`` are not 1. A preset whose Cube has no
int8 (``NpuSpec.cube_dtypes``) raises `CubeDtypeError` (one line); ``quant_config``'s
``dynamic_linear`` (opencann.quantize's dynamic mode: x quantized per call) has no vnpu
kernel here and raises ValueError, as a bad record does (`check_record`: the CPU pass's rule).
Source: CANN AMCT user guide (quantization record: scale_d / offset_d / scale_w /
offset_w, "deq_scale = scale_d * scale_w"; AMCT's quantized graph: AscendQuant → int8
Conv2D / MatMulV2 with int32 bias → AscendDequant); CANN operator list (Conv2D
``offset_x``, AscendQuant, AscendDequant).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

import torch

from ...ir import DataType, Graph, Node, TensorDesc, TensorRef, Value
from ...ops.kernels.int8_quantize import check_record
from ..base import PassContext, RewritePass, Skip
from ..fusion.quant_names import check_layer_names, layer_labels
from ..fusion.quantize_int8 import quantize_weight
from .npu_layout import CubeDtypeError

_FLOATS = (DataType.FLOAT, DataType.FLOAT16)
_CONV_ATTRS = ("stride", "padding", "dilation", "transposed", "output_padding", "groups")


@dataclass
class _Match:
    node: Node
    step: float      # scale_d
    offset: int      # offset_x (int8)


def check_cube_int8(spec, what: str) -> None:
    """Raise `CubeDtypeError` (one line) when the Cube of ``spec`` takes no int8
    (``"int8" not in spec.cube_dtypes``); ``what`` names the layer or model asking."""
    if "int8" in spec.cube_dtypes:
        return
    from ...devices.vnpu import PRESETS
    ok = [p for p, s in PRESETS.items() if "int8" in s.cube_dtypes]
    raise CubeDtypeError(
        f"{what}: int8 quantization on vnpu preset {spec.name!r}, whose Cube unit takes "
        f"{'/'.join(spec.cube_dtypes)} only (no int8). Fix: quantize for a preset with an int8 Cube "
        f"({', '.join('vnpu:' + p for p in ok) or 'none built in'}) or compile this one without quant_config")


class VnpuQuantizeInt8(RewritePass):
    """Conv2D / MatMulV2 / MatMul with a calibrated fp32 input and a constant fp32 weight
    ⇒ AscendQuant → int8 Cube op (int32) → AscendDequant (fp32), module docstring."""

    name, stage = "vnpu_quantize_int8", "layout"
    ops = ("Conv2D", "MatMulV2", "MatMul")
    devices = ("vnpu",)

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Rewrite every target with a record in ``options["quant_config"]["layers"]``
        (nothing without ``quant_config``: the note says so), after the float emulation of
        an ONNX model's dynamic int8 MatMuls (`_emulate_dynamic`). Raises `CubeDtypeError` on
        a preset whose Cube has no int8 and ValueError for ``dynamic_linear`` (no vnpu
        kernel quantizes x per call) or a record / ``skip_layers`` name of no layer here
        (`check_layer_names`: records name the unfused Conv2D / MatMulV2 / MatMul nodes).
        Returns the rewrites."""
        emulated = sum(1 for n in graph.nodes if n.op == "AscendQuant" and n.outputs[0].desc.dtype == DataType.UINT8)
        if emulated and ctx.report is not None:
            ctx.report.notes.append(f"ONNX QDQ / QOperator on the vnpu: {emulated} QuantizeLinear (uint8 AscendQuant) run as float "
                     f"emulation (AscendQuant -> AscendDequant to fp32 around fp32 Cube ops), not the int8 Cube "
                     f"path. Fix: quantize the float model with opencann.quantize(model, batches, device='vnpu:...'), "
                     f"or compile for device 'cpu' (qdq_to_int8 runs int8 kernels)")
        dynamic = _emulate_dynamic(graph, ctx)
        cfg = ctx.options.get("quant_config")
        if not cfg:
            ctx.note(f"{dynamic} dynamic int8 MatMul(s) of an ONNX file as float emulation" if dynamic
                     else "no quant_config: nothing quantized (opencann.quantize sets it)")
            return dynamic
        check_cube_int8(ctx.device.spec, "quant_config")
        if cfg.get("dynamic_linear"):
            raise ValueError("dynamic int8 quantization (x quantized per call) has no vnpu kernel: CANN's "
                             "AscendQuant takes a calibrated scale. Fix: quantize with calibration data "
                             "(mode='static'), or compile for device 'cpu'")
        check_layer_names(graph, cfg, self.ops)    # a name of no layer here: one error line
        self._cfg = cfg
        self._quants: Dict[tuple, Value] = {}
        n = super().run(graph, ctx)
        graph.prune_constants()
        ctx.note(f"{n} layer(s) in int8 on the Cube" + (f", {dynamic} dynamic one(s) as float emulation"
                                                        if dynamic else ""))
        return n + dynamic

    def match(self, node: Node, graph: Graph, ctx: PassContext):
        """A `_Match` for a target with a record, fp32 (or fp16) x and a constant weight of x's dtype; else a
        `Skip` naming why it stays fp32."""
        cfg = self._cfg
        if layer_labels(node) & set(cfg.get("skip_layers") or ()):
            return Skip("in skip_layers: kept in fp32")
        if node.meta.get("keep_dtype"):
            return Skip("in keep_dtype: kept in its original dtype")
        conv = node.op == "Conv2D"
        x = node.arg("input" if conv else ("mat1" if node.op == "MatMulV2" else "self"))
        w = node.arg("weight" if conv else "mat2")
        if not (w.is_const and w.desc.dtype in _FLOATS and x.desc.dtype == w.desc.dtype):
            return Skip("the weight is not a constant fp32 / fp16 tensor of x's dtype")
        if conv and (node.attrs.get("transposed") or int(node.attrs.get("groups", 1)) != 1
                     or x.desc.rank != 4):
            return Skip("transposed, grouped or non-2-D convolution: the int8 Cube path here takes "
                        "groups=1 Conv2D only")
        if not conv and (x.desc.rank != 2 or w.desc.rank != 2
                         or node.attrs.get("beta", 1) != 1 or node.attrs.get("alpha", 1) != 1):
            return Skip("not a 2-D GEMM with beta = alpha = 1")
        if not torch.isfinite(w.const).all():
            return Skip("the weight holds NaN or inf")
        rec = (cfg.get("layers") or {}).get(node.name)
        if rec is None:
            return Skip("no calibration record for this layer (quant_config['layers']: no calibration "
                        "batch had a finite value at its input, or it was not calibrated)")
        check_record(node.name, rec)     # a bad hand-written record: one error line, not fp32
        return _Match(node, float(rec["scale_d"]), int(rec["offset_d"]) - 128)

    def _quant(self, graph: Graph, x: Value, step: float, offset: int, before: Node) -> Value:
        """The int8 value of ``x`` at (step, offset_x): one AscendQuant per key."""
        key = (x.id, step, offset)
        if key not in self._quants:
            q = graph.create_node("AscendQuant", [x], {"scale": 1.0 / step, "offset": offset},
                                  [TensorDesc(x.desc.shape, DataType.INT8, x.desc.format)],
                                  name=f"{before.name}_quant", source=before.source, scope=before.scope,
                                  before=before)
            self._quants[key] = q.outputs[0]
        return self._quants[key]

    def rewrite(self, graph: Graph, m: _Match, ctx: PassContext) -> int:
        """Replace the node by AscendQuant → int8 Cube op → AscendDequant (module
        docstring). Returns 1."""
        node, step, off = m.node, m.step, m.offset
        conv = node.op == "Conv2D"
        x = node.arg("input" if conv else ("mat1" if node.op == "MatMulV2" else "self"))
        w = node.arg("weight" if conv else "mat2")
        bias = node.arg("bias" if conv else "self") if node.op != "MatMul" else None
        wq, ws = quantize_weight(w.const.float(), 0 if conv else 1)
        corr = (-off * wq.to(torch.int64).sum(dim=(1, 2, 3) if conv else 0)).to(torch.int32)
        xq = self._quant(graph, x, step, off, node)
        wc = graph.add_const(wq, f"{node.name}_w_int8")
        cc = graph.add_const(corr.contiguous(), f"{node.name}_offset_corr")
        out = node.outputs[0].desc
        acc_desc = TensorDesc(out.shape, DataType.INT32, out.format)
        if conv:
            attrs: Dict[str, Any] = {k: node.attrs[k] for k in _CONV_ATTRS if k in node.attrs}
            attrs.update(input=TensorRef(0), weight=TensorRef(1), bias=TensorRef(2), offset_x=off)
            cube = graph.create_node("Conv2D", [xq, wc, cc], attrs, [acc_desc], name=f"{node.name}_int8",
                                     source=node.source, scope=node.scope, before=node)
        else:
            attrs = {"self": TensorRef(0), "mat1": TensorRef(1), "mat2": TensorRef(2), "beta": 1, "alpha": 1,
                     "offset_x": off}
            cube = graph.create_node("MatMulV2", [cc, xq, wc], attrs, [acc_desc], name=f"{node.name}_int8",
                                     source=node.source, scope=node.scope, before=node)
        deq = (torch.tensor(step, dtype=torch.float32) * ws).contiguous()
        ins = [cube.outputs[0], graph.add_const(deq, f"{node.name}_deq_scale")]
        dattrs: Dict[str, Any] = {"deq_scale": TensorRef(1), "axis": 1 if conv else -1}
        if bias is not None:
            ins.append(bias)
            dattrs["bias"] = TensorRef(2)
        dq = graph.create_node("AscendDequant", ins, dattrs, [out], name=f"{node.name}_dequant",
                               source=node.source, scope=node.scope, before=node)
        dq.meta.update({k: v for k, v in node.meta.items() if k in ("strides", "origin", "eager_strides")})
        graph.replace_all_uses_with(node.outputs[0], dq.outputs[0])
        graph.erase_node(node)
        ctx.applied([node], f"int8 on the Cube (scale_d={step:.4g}, offset_d={off + 128}; "
                            f"offset_x={off}, int32 accumulate, AscendDequant per channel)")
        return 1


def _emulate_dynamic(graph: Graph, ctx: PassContext) -> int:
    """The MatMul / MatMulV2 nodes over an ONNX ``quantize_dynamic`` file's weights
    (``graph.meta["int8_dynamic_weights"]``: the frontend's dequantized fp32 weights, the
    file's ``W_int8 * w_scale`` exactly) read x through a `DynamicQuantDequant` (one per x):
    the float emulation of DynamicQuantizeLinear → MatMulInteger → Cast → Mul, x on the
    uint8 levels the CPU's dynamic QuantLinearAct takes, the product in fp32 on the Cube;
    each is a skipped entry of the pass (not int8 in ``quant_report``) saying so. A weight
    read otherwise is noted and kept as it is (x not quantized). Returns the MatMuls
    rewritten."""
    names = set(graph.meta.get("int8_dynamic_weights") or ())
    if not names:
        return 0
    done: Dict[int, Value] = {}
    seen, rewritten = set(), 0
    for node in list(graph.nodes):
        w = node.arg("mat2") if node.op in ("MatMul", "MatMulV2") else None
        if not (isinstance(w, Value) and w.is_const and w.name in names):
            continue
        x = node.arg("self" if node.op == "MatMul" else "mat1")
        if x.id not in done:
            dq = graph.create_node("DynamicQuantDequant", [x], {}, [x.desc], name=f"{node.name}_dynamic_quant",
                                   source=node.source, scope=node.scope, before=node)
            done[x.id] = dq.outputs[0]
        graph.replace_input(node, x, done[x.id])
        seen.add(w.name)
        rewritten += 1
        ctx.skipped(node, "ONNX dynamic int8 runs as float emulation: x on DynamicQuantizeLinear's uint8 "
                    "grid per call (DynamicQuantDequant), the file's dequantized weight, an fp32 Cube op "
                    "(CANN's AscendQuant takes a calibrated scale: no int8 Cube path)")
    if names - seen and ctx.report is not None:
        ctx.report.notes.append(f"ONNX dynamic int8 on the vnpu: weight(s) {sorted(names - seen)} not read as "
                                "a MatMul's right operand: those layers run fp32 with x not quantized")
    return rewritten


__all__ = ["VnpuQuantizeInt8", "check_cube_int8"]
