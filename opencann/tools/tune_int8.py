"""int8 as a `opencann.tune` candidate: static post-training quantization (AMCT's flow,
`opencann.engine.quantize`) of the convolutions and linears the search gives int8.

- `applies(fx_node, ep)`: which candidate nodes int8 can run — an ``aten.convolution``
  (not transposed) or a 2-D ``addmm`` / ``mm`` whose weight is a parameter, buffer or
  constant of the program (through ``t`` / ``permute`` / views), the ops the
  ``quantize_int8`` pass turns into oneDNN int8 kernels; else the reason.
- `emulate(target, args, kwargs)`: one such op on eager's inputs with x quantized to uint8
  per tensor over its own range (what calibration on these inputs gives) and the weight
  symmetric int8 per output channel (ARQ, `quantize_weight`, in the range the
  ``quantize_int8`` pass takes on this CPU: `int8_weight_qmax`, 7 bits without VNNI),
  computed in fp32 on the dequantized operands: the int8 kernel's integer products are
  exact, so this is its result up to the fp32 rescale. It returns (that, that): the gate's error-ratio rule
  (the kernel's arithmetic against fp32 on the same inputs) has nothing to judge, and
  the rounding of the operands is judged against eager by its NaN/Inf, cosine (<= 0.99
  fails) and max-abs rules.
- `calibrated(records, scopes)`: the `Candidate` whose ``apply`` puts the calibration
  records of the chosen nodes' layers into ``options["quant_config"]`` (layers are
  matched by module, AMCT's granularity: a module called twice is one layer); with a
  bf16 candidate in the search, the chosen nodes also compute their activations in bf16
  (an int8 Linear then reads and writes bf16 like its bf16 neighbours: no Casts).

Source: CANN AMCT user guide (calibration, ARQ, ``scale_d`` / ``offset_d``); msprobe's
accuracy rules (`opencann.tools.tune_gate`)."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from ..devices.cpu import int8_weight_qmax
from ..ops.kernels.int8_cpu import dynamic_params, quantize_u8
from ..passes.fusion.quantize_int8 import quantize_weight

aten = torch.ops.aten
# aten op -> (index of x, index of the weight, the weight's output-channel axis)
_OPERANDS = {aten.convolution.default: (0, 1, 0), aten.addmm.default: (1, 2, 1), aten.mm.default: (0, 1, 1)}
_THROUGH = {aten.t.default, aten.permute.default, aten.view.default, aten.reshape.default,
            aten.transpose.int, aten.expand.default}


def applies(fx_node, ep) -> str:
    """"" when int8 can run ``fx_node`` (a node of the ExportedProgram ``ep``), else why not."""
    spec = _OPERANDS.get(fx_node.target)
    if spec is None:
        return f"int8 runs convolutions and linears only, not {fx_node.target}"
    if fx_node.target == aten.convolution.default and fx_node.args[6]:
        return "transposed convolution: no int8 kernel"
    w = fx_node.args[spec[1]]
    while isinstance(w, torch.fx.Node) and w.op == "call_function" and w.target in _THROUGH:
        w = w.args[0]
    from torch.export.graph_signature import InputKind
    kinds = {s.arg.name: s.kind for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}
    if not (isinstance(w, torch.fx.Node) and w.op == "placeholder"
            and kinds.get(w.name) in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)):
        return "the weight is computed, not a parameter: int8 needs a constant weight"
    return ""


def emulate(target, args, kwargs) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(int8 result in fp32, the same) for an op of `_OPERANDS` on eager's ``args``; None for
    another op or operands that are not fp32 tensors (NaN/inf weights too: int8 refuses them)."""
    spec = _OPERANDS.get(target)
    if spec is None:
        return None
    xi, wi, axis = spec
    x, w = args[xi], args[wi]
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.dtype == w.dtype == torch.float32):
        return None
    if not torch.isfinite(w).all():
        return None
    step, off = dynamic_params(x)
    xd = (quantize_u8(x.contiguous(), step, off).float() - off) * step
    wq, ws = quantize_weight(w, axis, int8_weight_qmax())
    view = [1] * w.dim()
    view[axis] = -1
    wd = wq.float() * ws.view(view)
    a = list(args)
    a[xi], a[wi] = xd, wd
    out = target(*a, **kwargs)
    return out, out


def calibrated(base, records: Dict[str, Dict[str, Any]], scopes: Dict[str, str],
               module_of: Dict[str, str], bf16_io: Sequence[str] = (), traced: Sequence[str] = ()):
    """``base`` (the int8 `Candidate`) with an ``apply`` that quantizes the layers of the
    chosen nodes: ``records`` (fused node name -> {"scale_d", "offset_d"}, from
    `opencann.engine.quantize.calibrate`), ``scopes`` (fused node name -> its module),
    ``module_of`` (candidate node name -> its module). ``bf16_io``: the linear nodes
    (when the search has a bf16 candidate): those chosen also get ``node_precision``
    "bf16", so each int8 Linear sits in the graph as a bf16 one would (AscendQuant reading
    bf16, the layer writing bf16, no Cast around it: `QuantizeInt8`), and its own error is
    judged on operands rounded to bf16 first (`emulate_bf16`); convolutions are quantized
    from fp32. ``traced``: the captured node names whose work a recorded layer does
    (`opencann.ir.traced_names`: Q, K and V of one merged GEMM). Its ``applies`` adds to
    `applies` one rule: a node neither in ``traced`` nor of a recorded layer's module (every
    calibration batch NaN/inf at its input, or a layer of no module) fails int8's verdict
    with that reason, so the search gives it the next candidate (bf16) instead of an int8
    the ``quantize_int8`` pass would leave in fp32."""
    from dataclasses import replace

    def apply(options: Dict[str, Any], nodes: Sequence[str]) -> Dict[str, Any]:
        mods = {module_of.get(n) for n in nodes} - {None, ""}
        layers = {k: {"scale_d": r["scale_d"], "offset_d": r["offset_d"],
                      **{e: r[e] for e in ("accum", "out") if e in r}}
                  for k, r in records.items() if scopes.get(k) in mods}
        # records of the all-fp32 compile: a mixed-precision choice may keep apart sibling
        # linears merged there (their QKV GEMM's record then names no node, kept fp32 and reported)
        options["quant_config"] = {"layers": layers, "skip_layers": [], "dynamic_linear": False,
                                   "check_names": False}
        low = [n for n in nodes if n in io]
        if low:
            options["node_precision"] = {**(options.get("node_precision") or {}), **{n: "bf16" for n in low}}
        return options
    io = set(bf16_io)
    recorded = {scopes.get(k) for k in records} - {None, ""}
    done = set(traced)
    static = base.applies or applies

    def applies_calibrated(fx_node, ep) -> str:
        why = static(fx_node, ep)
        if why or fx_node.name in done or module_of.get(fx_node.name) in recorded:
            return why
        return ("no calibration record for its layer (no calibration batch had a finite value at its "
                "input, or it is no module's layer): int8 cannot run it")
    return replace(base, apply=apply, applies=applies_calibrated, **({"emulate": emulate_bf16} if io else {}))


def emulate_bf16(target, args, kwargs) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """`emulate` on x and the weight rounded to bf16 first for a linear (an int8 Linear
    inside a bf16 graph quantizes the bf16 activation and the weight the ``precision``
    pass cast to bf16; a bias stays as given, the kernel adds it in fp32); a convolution
    as `emulate` (quantized from fp32)."""
    spec = _OPERANDS.get(target)
    if spec is None or target == aten.convolution.default:
        return emulate(target, args, kwargs)
    a = list(args)
    for i in spec[:2]:
        if isinstance(a[i], torch.Tensor) and a[i].dtype == torch.float32:
            a[i] = a[i].bfloat16().float()
    return emulate(target, tuple(a), kwargs)


def int8_applied(compiled) -> Dict[str, bool]:
    """Traced node name -> whether an int8 kernel does its work in ``compiled``, for
    checking the search's int8 choices: the names each QuantConvBiasAct / QuantConvAddAct /
    QuantLinearAct records of the nodes it replaced (`opencann.ir.traced_names`; sibling
    Linears merged into one GEMM by ``fuse_qkv_linear``, Q, K and V: each of them)."""
    from ..ir import traced_names
    return {s: True for n in compiled.graph.nodes
            if n.op in ("QuantConvBiasAct", "QuantConvAddAct", "QuantLinearAct")
            for s in traced_names(n)}


def int8_skipped(compiled) -> Dict[str, str]:
    """Module -> why the ``quantize_int8`` pass left its layer out of int8 in ``compiled``
    (the pass's skip reason in the compile report, e.g. no calibration record when every
    calibration batch was NaN/inf at the layer's input)."""
    from ..engine.quantize import quant_report
    return {r["where"].split(" ")[0]: r["reason"] for r in quant_report(compiled)
            if not r["int8"] and r.get("where")}


__all__ = ["applies", "calibrated", "emulate", "emulate_bf16", "int8_applied", "int8_skipped"]
