"""Post-training int8 quantization, following CANN AMCT's flow and names
(AMCT for PyTorch: ``create_quant_config`` → calibration → ``save_model``):

1. `create_quant_config` — what to quantize: ``skip_layers`` (kept fp32), the
   activation algorithm (``"minmax"``: AMCT's IFMR without its clipping search: the
   calibration batches' min / max, the range widened to include 0), and
   ``dynamic_linear`` (linears without a record quantize x per call).
2. `quantize` (also `quantize_model`) — compile the model in fp32 with opencann, run the
   calibration batches through it and observe the input of every convolution and
   linear (ConvBiasAct, ConvAddAct, LinearAct: the fused fp32 ops, so BatchNorm is
   already folded and the observed tensor is exactly what the int8 kernel will read),
   then compile again with ``options["quant_config"]``: the ``quantize_int8`` pass puts
   AscendQuant (uint8, per-tensor ``scale_d`` / ``offset_d``) before each and swaps it for
   an int8 kernel with per-channel symmetric int8 weights (ARQ). The result is a
   `CompiledModel` like ``opencann.compile``'s (static shapes: the first calibration
   batch's); ``opencann.save`` writes it to a ``.ocm`` file with its int8 weights and
   scales and ``opencann.load`` runs it (AMCT's ``save_model``).
   (AMCT's names: `opencann.tools.quantize`, with ``save_model``.)
3. `quant_report` — per layer: int8 or fp32 (and why), scale_d / offset_d.

Dynamic quantization only (``mode="dynamic"``, no calibration data needed): every
LinearAct in int8 with x quantized per call; convolutions stay fp32.

NaN / ±inf: quantization saturates. An activation's NaN becomes 0 (uint8's minimum:
the value ``-offset_d * scale_d``), +inf the range's top, -inf its bottom; calibration
ignores non-finite values. Layers that must keep eager's NaN/Inf go in ``skip_layers``.

Source: CANN AMCT (Ascend Model Compression Toolkit) user guide, PyTorch: "Post-training
quantization", the quantization config (``skip_layers``, ``activation_quant_params``:
IFMR) and record file (``scale_d``, ``offset_d``, ``scale_w``, ``offset_w``)."""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch

from ..devices import parse_device
from ..log import logger
from ..ops.kernels.int8_quantize import check_skip_layers, uint8_params
from ..passes.fusion.quant_names import layer_labels
from ..passes.layout.vnpu_quantize_int8 import check_cube_int8
from .compiled_model import CompiledModel
from .dispatch import compile_torch
from .entry import compile_module
from .options import check_options

TARGETS = ("ConvBiasAct", "ConvAddAct", "LinearAct")
ALGORITHMS = ("minmax",)
MODES = ("static", "dynamic")


def create_quant_config(skip_layers: Sequence[str] = (), *, mode: str = "static",
                        activation: str = "minmax", dynamic_linear: bool = False) -> Dict[str, Any]:
    """AMCT's ``create_quant_config``: a quantization config (a plain dict).

    ``skip_layers``: module names (AMCT's layer names, e.g. ``layer1.0.conv2``, ``fc``)
    or node names as the compile report shows them (``convolution_3_relu``) kept in fp32; ``mode``:
    "static" (calibrated activations) or "dynamic" (linears only, x quantized per call);
    ``activation``: the calibration algorithm (`ALGORITHMS`); ``dynamic_linear``: in
    static mode, linears without a calibration record run dynamic. Raises ValueError
    (one line) for an unknown mode or algorithm, skip_layers that is not a list of names
    (None: none; `check_skip_layers`, the rule the option ``quant_config`` shares), or a
    dynamic_linear that is not a bool. Whether each name labels a layer of the model is
    checked when it is compiled (`check_layer_names`: one line with near matches)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    if activation not in ALGORITHMS:
        raise ValueError(f"activation {activation!r} is not one of {ALGORITHMS}")
    names = check_skip_layers(skip_layers, "skip_layers")
    if not isinstance(dynamic_linear, bool):
        raise ValueError(f"dynamic_linear takes True or False, got {dynamic_linear!r:.40}")
    return {"mode": mode, "activation": activation, "skip_layers": names,
            "dynamic_linear": dynamic_linear or mode == "dynamic"}


class _Range:
    """Running min / max of the finite values seen."""

    def __init__(self):
        self.lo, self.hi = math.inf, -math.inf

    def update(self, t: torch.Tensor) -> None:
        t = t.detach()
        if not t.is_floating_point() or not t.numel():
            return
        if not torch.isfinite(t).all():
            t = t[torch.isfinite(t)]
            if not t.numel():
                return
        lo, hi = torch.aminmax(t.float())
        self.lo, self.hi = min(self.lo, float(lo)), max(self.hi, float(hi))

    def record(self) -> Optional[Dict[str, Any]]:
        """{"scale_d", "offset_d", "min", "max"} for uint8 over [min(lo, 0), max(hi, 0)]
        (`uint8_params`: step at least float32's smallest normal, 1.0 when only zeros were
        seen); None if no finite value was seen."""
        if self.lo > self.hi:
            return None
        step, offset = uint8_params(self.lo, self.hi)
        return {"scale_d": step, "offset_d": offset, "min": self.lo, "max": self.hi}


def _batches(calibration_inputs, one_shape: bool = True) -> List[tuple]:
    if isinstance(calibration_inputs, (torch.Tensor, tuple)):
        calibration_inputs = [calibration_inputs]
    if not isinstance(calibration_inputs, Iterable) or isinstance(calibration_inputs, (str, dict)):
        raise ValueError(f"calibration_inputs is {type(calibration_inputs).__name__}: give a list of batches, "
                         f"each a tensor or a tuple of the model's inputs, e.g. [x1, x2]")
    out = [b if isinstance(b, tuple) else (b,) for b in calibration_inputs]
    if not out:
        raise ValueError("calibration_inputs is empty: give at least one batch (a tensor or a "
                         "tuple of the model's inputs), e.g. [x1, x2]")
    sig = _signature if one_shape else _kinds
    first = sig(out[0])
    for k, b in enumerate(out[1:], 1):
        if sig(b) != first:
            if not one_shape:
                raise ValueError(f"calibration batch #{k} is {sig(b)} but batch #0 is {first}: every "
                                 f"calibration batch must have the first one's ranks and dtypes")
            raise ValueError(f"calibration batch #{k} is {sig(b)} but batch #0 is {first}: "
                             f"every calibration batch must have the first one's shapes and dtypes "
                             f"(the compiled shape); split or pad them to one shape, or give "
                             f"dynamic_shapes for the dims that differ")
    return out


def _numel(batch: tuple) -> int:
    return sum(t.numel() for t in batch if isinstance(t, torch.Tensor))


def _kinds(batch: tuple) -> str:
    """``batch``'s dtypes and ranks (a dynamic-shape calibration's batches may differ in sizes)."""
    return ", ".join(f"{str(t.dtype).replace('torch.', '')} rank {t.dim()}" if isinstance(t, torch.Tensor)
                     else type(t).__name__ for t in batch)


def _signature(batch: tuple) -> str:
    return ", ".join(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}" if isinstance(t, torch.Tensor)
                     else type(t).__name__ for t in batch)


# the vnpu's targets (unfused Cube ops, ``vnpu_quantize_int8``) -> the name of their x
VNPU_TARGETS = {"Conv2D": "input", "MatMulV2": "mat1", "MatMul": "self"}


_BATCH_FIX = "give batches like the example inputs (tensors of the compiled shapes and dtypes)"


def calibrate(cm: CompiledModel, batches: Iterable[tuple], targets: Optional[Dict[str, str]] = None
              ) -> Dict[str, Dict[str, Any]]:
    """Run ``batches`` through the fp32 compiled model ``cm`` and return, per target node
    (`TARGETS`; ``targets``: {op: x's argument name} instead, e.g. `VNPU_TARGETS`, nodes
    with a constant ``weight`` / ``mat2``) whose x is fp32, its record {"scale_d",
    "offset_d", "min", "max"} (uint8, per tensor), plus for a ConvAddAct ``"accum"``:
    {"scale_d", "offset_d"} of its residual addend and ``"out"``: the same of its result
    (which `fuse_requant` may carry in uint8: the addend inside a residual chain, the
    result where the chain ends in an fp32 reader). Raises ValueError (one line naming the
    batch) for a batch the compiled model refuses (another shape or dtype)."""
    graph = cm.graph
    watch: Dict[int, _Range] = {}
    names: Dict[int, List[str]] = {}
    sides: Dict[str, Dict[int, List[str]]] = {"accum": {}, "out": {}}   # a ConvAddAct's addend, result
    for n in graph.nodes:
        if targets is not None:
            w = n.arg("weight" if n.op == "Conv2D" else "mat2") if n.op in targets else None
            if w is not None and w.is_const:
                x = n.arg(targets[n.op])
                watch.setdefault(x.id, _Range())
                names.setdefault(x.id, []).append(n.name)
            continue
        if n.op in TARGETS:
            x = n.arg("mat1" if n.op == "LinearAct" else "input")
            watch.setdefault(x.id, _Range())
            names.setdefault(x.id, []).append(n.name)
        if n.op == "ConvAddAct":   # uint8 residual chains (fuse_requant): the addend and the result
            for key, v in (("accum", n.arg("other")), ("out", n.outputs[0])):
                watch.setdefault(v.id, _Range())
                sides[key].setdefault(v.id, []).append(n.name)
    inputs = {v.id: i for i, v in enumerate(graph.inputs)}

    def observe(node, outs) -> None:
        for v, t in zip(node.outputs, outs):
            r = watch.get(v.id)
            if r is not None and isinstance(t, torch.Tensor):
                r.update(t)

    for b, args in enumerate(batches):
        for vid, i in inputs.items():
            if vid in watch:
                watch[vid].update(args[i] if i < len(args) and isinstance(args[i], torch.Tensor)
                                  else torch.empty(0))
        try:
            cm.run_observed(observe, *args)
        except ValueError as e:   # the call's one line, naming the batch at fault
            raise ValueError(f"calibration batch {b}: {str(e).split('; ')[0]}; {_BATCH_FIX}") from None
    records: Dict[str, Dict[str, Any]] = {}
    for vid, r in watch.items():
        rec = r.record()
        if rec is not None:
            for name in names.get(vid, ()):
                records[name] = dict(rec)
    for key, side in sides.items():
        for vid, layers in side.items():
            rec = watch[vid].record()
            for name in layers:
                if rec is not None and name in records:
                    records[name][key] = {"scale_d": rec["scale_d"], "offset_d": rec["offset_d"]}
    return records


def quantize(model: torch.nn.Module, calibration_inputs, *, config: Optional[Dict[str, Any]] = None,
             device: str = "cpu", options: Optional[Dict[str, Any]] = None,
             dynamic_shapes: Any = None, dim_ranges: Any = None) -> CompiledModel:
    """Post-training int8 quantization of ``model`` (AMCT's flow, module docstring):
    returns a compiled model whose convolutions and linears run oneDNN's int8 kernels.

    ``calibration_inputs``: a list of batches, each a tensor or a tuple of the model's
    positional inputs, all of one shape (the compiled shape: the first batch's); real
    data (a few batches) gives the activation ranges. ``config``: `create_quant_config`'s
    dict (default: static, min/max, nothing skipped). ``options``: compile options, as
    ``opencann.compile`` (``quant_config`` is set here), gears included
    (``dynamic_batch_size``...: every gear runs the int8 kernels at the ranges calibrated
    on the batches' shape). ``dynamic_shapes`` / ``dim_ranges``: as ``opencann.compile``;
    on the cpu the calibration batches may then have any sizes those allow (each runs
    through an fp32 model compiled with the same dynamic dims). Raises ValueError (one line)
    for an empty calibration set, batches of different shapes (or, with dynamic_shapes,
    ranks) or dtypes, batches with no
    finite value at any layer's input (static mode), a ``skip_layers`` name that
    labels no node of the model (the int8 pass's `check_layer_names`), a config that is
    no dict, or a ``precision_mode``
    that lowers to fp16 (int8 layers are quantized from fp32; ``allow_mix_precision_bf16`` on
    the cpu: the linears are quantized inside the bf16 graph, calibrated on it, reading and
    writing bf16, `QuantizeInt8`; its convolutions stay bf16), and what
    ``opencann.compile`` raises. The compiled model's ``report`` lists every layer in
    the ``quantize_int8`` pass's entries (`quant_report`)."""
    cfg = _config(config)
    opts = _options(options)
    _check_target(cfg, opts, device)
    vnpu = parse_device(device).kind == "vnpu"
    dynamic = dynamic_shapes is not None and not vnpu   # calibrated at the batches' own shapes
    batches = _batches(calibration_inputs, one_shape=not dynamic)
    # the compiled example: under dynamic dims the largest batch (torch.export specialises
    # a size of 1, so a 1-row first batch must not be the example)
    example = max(batches, key=_numel) if dynamic else batches[0]
    records: Dict[str, Dict[str, Any]] = {}
    if cfg["mode"] == "static":
        if vnpu:     # the unfused graph the vnpu pass sees, observed on the host in fp32 (same names)
            fp32 = compile_module(model, batches[0], "cpu", dict(_calibration_options(opts),
                                                                 disable=_cpu_only_rewrites(opts)))
            records = calibrate(fp32, batches, VNPU_TARGETS)
        else:
            fp32 = _compile_example(model, example, device, _calibration_options(opts),
                                    dynamic_shapes if dynamic else None, dim_ranges if dynamic else None)
            records = calibrate(fp32, batches)
        _check_records(records, fp32, VNPU_TARGETS if vnpu else TARGETS, set(cfg.get("skip_layers") or ()))
    layers = {k: {"scale_d": r["scale_d"], "offset_d": r["offset_d"],
                  **{e: r[e] for e in ("accum", "out") if e in r}} for k, r in records.items()}
    opts["quant_config"] = {"layers": layers, "skip_layers": list(cfg.get("skip_layers") or ()),
                            "dynamic_linear": bool(cfg.get("dynamic_linear"))}
    cm = _compile_example(model, example, device, opts, dynamic_shapes, dim_ranges, dynamic)
    rows = quant_report(cm)
    if vnpu and rows and not any(r["int8"] for r in rows) and not cfg.get("skip_layers"):
        raise ValueError(f"no layer was quantized on {device} (first: {rows[0]['layer']}: {rows[0]['reason']}); "
                         f"fix that, or compile without opencann.quantize to run fp32")
    return cm


def _compile_example(model, example: tuple, device: str, opts: Dict[str, Any], dynamic_shapes, dim_ranges,
                     explain: bool = True) -> CompiledModel:
    """``compile_torch`` of ``model`` at ``example`` (a calibration batch). Under
    ``dynamic_shapes`` (and ``explain``) a ValueError about the example says first that
    the example is the largest calibration batch (the caller passed no example)."""
    try:
        return compile_torch(model, example, device, opts, dynamic_shapes=dynamic_shapes, dim_ranges=dim_ranges)
    except ValueError as e:
        if dynamic_shapes is None or not explain or "in the example" not in str(e):
            raise
        raise ValueError(f"with dynamic_shapes the largest calibration batch is the compiled example "
                         f"({_signature(example)}): {e}") from None


def _check_records(records: Dict[str, Dict[str, Any]], fp32: CompiledModel, targets, skip: set) -> None:
    """ValueError (one line) when calibration recorded no layer of the fp32 model ``fp32``
    that has ``targets`` (every batch NaN/inf at their inputs); `_warn_zero_ranges` else."""
    if not records and any(n.op in targets for n in fp32.graph.nodes):
        raise ValueError("calibration saw no finite value at the input of any convolution or "
                         "linear (every calibration batch is NaN/inf there): give batches of "
                         "real data")
    _warn_zero_ranges(records, skip, fp32.graph)


def _warn_zero_ranges(records: Dict[str, Dict[str, Any]], skip: set, graph) -> None:
    """A WARNING (one line, ``opencann`` logger) naming the layers whose calibration saw only
    zeros at their input (min = max = 0: an empty range, step 1.0): every later input of
    magnitude under 0.5 quantizes to 0 there, so such a layer's results are far from eager
    unless its input really is always 0 (all-zero or unrepresentative calibration batches).
    Layers named in ``skip`` (node or module names, `layer_labels` of ``graph``'s nodes) stay
    fp32 and are not named."""
    skipped = {n.name for n in graph.nodes if layer_labels(n) & skip}
    empty = sorted(k for k, r in records.items() if r.get("min") == 0.0 and r.get("max") == 0.0
                   and k not in skipped)
    if empty:
        logger.warning("calibration saw only zeros at the input of %d layer(s) (%s): their int8 input "
                       "has an empty range (scale_d=1) and later inputs under 0.5 in magnitude become 0; "
                       "calibrate on batches of real data, or keep them in fp32 with skip_layers",
                       len(empty), ", ".join(empty[:6]) + (", ..." if len(empty) > 6 else ""))


def _options(options: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``options`` checked as ``opencann.compile`` checks them (one ValueError line for no
    dict, an unknown option or value), its gear options kept as given."""
    from .options import GEAR_OPTIONS
    if options is not None and not isinstance(options, dict):
        return check_options(options)    # raises its line
    gears = {k: v for k, v in (options or {}).items() if k in GEAR_OPTIONS}
    return {**check_options({k: v for k, v in (options or {}).items() if k not in GEAR_OPTIONS}), **gears}


def _check_target(cfg: Dict[str, Any], opts: Dict[str, Any], device: str) -> None:
    """ValueError (one line) for a ``precision_mode`` that lowers layers before int8
    quantization (on the cpu ``allow_fp32_to_fp16`` lowers nothing, every op having an fp32
    kernel, and is taken), a vnpu without Cube int8, or dynamic quantization on the vnpu."""
    mode = opts.get("precision_mode")
    cpu = parse_device(device).kind == "cpu"
    # allow_fp32_to_fp16 lowers only ops the device has no fp32 kernel for: none on the cpu
    if mode not in (None, "force_fp32", "must_keep_origin_dtype", "allow_mix_precision_bf16",
                    "allow_fp32_to_fp16") \
            or (mode in ("allow_mix_precision_bf16", "allow_fp32_to_fp16") and not cpu):
        raise ValueError(f"precision_mode {mode!r} lowers layers to fp16/bf16 before int8 "
                         f"quantization on {device}; leave it unset to quantize from fp32 (on the cpu, "
                         f"'allow_mix_precision_bf16' quantizes the linears inside a bf16 graph)")
    if parse_device(device).kind == "vnpu":
        check_cube_int8(parse_device(device).spec, "opencann.quantize")
        if cfg["mode"] != "static" or cfg.get("dynamic_linear"):
            raise ValueError("dynamic int8 quantization (x quantized per call) has no vnpu kernel: CANN's "
                             "AscendQuant takes a calibrated scale. Fix: mode='static' with calibration "
                             "batches, or device='cpu'")


def _calibration_options(opts: Dict[str, Any]) -> Dict[str, Any]:
    """The fp32 calibration model's options: ``opts`` without the quantization record and
    the gear options (calibration runs at the batches' one shape; the gears are built
    for the int8 model)."""
    from .options import GEAR_OPTIONS
    return {k: v for k, v in dict(opts, quant_config=None).items() if k not in GEAR_OPTIONS}


_CONFIG_KEYS = ("mode", "activation", "skip_layers", "dynamic_linear")


def _config(config: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``config`` checked and completed as `create_quant_config` makes it (default: its
    defaults); ValueError (one line) for no dict, an unknown key, or any value
    `create_quant_config` refuses."""
    if config is None:
        return create_quant_config()
    if not isinstance(config, dict):
        raise ValueError(f"config must come from opencann.tools.quantize.create_quant_config(...), "
                         f"got {type(config).__name__} {config!r:.80}")
    unknown = sorted(set(config) - set(_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"config has unknown key(s) {unknown}: create_quant_config takes "
                         f"{', '.join(_CONFIG_KEYS)}")
    given = {k: config[k] for k in _CONFIG_KEYS if k in config}
    try:
        return create_quant_config(given.pop("skip_layers", ()), **given)
    except ValueError as e:   # "skip_layers takes ..." -> "config['skip_layers'] takes ..."
        key, _, rest = str(e).partition(" ")
        raise ValueError(f"config[{key!r}] {rest}" if rest.startswith("takes") else f"config: {e}") from None


def _cpu_only_rewrites(opts: Dict[str, Any]) -> List[str]:
    """``opts["disable"]`` plus every cpu-only rewrite of the default pipeline (fusions,
    ``drop_unused_outputs``): the host graph then keeps the vnpu's node names."""
    from ..passes import default_pipeline
    off = [p.name for p in default_pipeline().passes
           if tuple(getattr(p, "devices", ())) == ("cpu",) and p.stage != "layout"]
    return list(opts.get("disable") or ()) + off


#: AMCT's name for the calibrate-and-convert step
quantize_model = quantize


# the passes whose entries are quant_report's rows: the CPU's int8 rewrite, its ONNX QDQ /
# QOperator form (the file's own int8 layers) and the vnpu's
QUANT_PASSES = ("quantize_int8", "qdq_to_int8", "vnpu_quantize_int8")


def quant_report(cm: CompiledModel) -> List[Dict[str, Any]]:
    """One row per convolution / linear the ``quantize_int8`` pass looked at (an ONNX QDQ /
    QOperator file's: ``qdq_to_int8``; vnpu: ``vnpu_quantize_int8``): {"layer",
    "int8" (bool), "detail" (static with scale_d / offset_d, or dynamic) or "reason"
    (why it stays fp32), "where"}; from the compile report, so a loaded model has it too."""
    rows = [{"layer": e["nodes"], "int8": True, "detail": e.get("detail", ""), "where": e.get("where", "")}
            for e in cm.report.applied if e.get("pass") in QUANT_PASSES]
    rows += [{"layer": e["nodes"], "int8": False, "reason": e.get("reason", ""), "where": e.get("where", "")}
             for e in cm.report.skipped if e.get("pass") in QUANT_PASSES]
    return rows


__all__ = ["ALGORITHMS", "MODES", "QUANT_PASSES", "TARGETS", "VNPU_TARGETS", "calibrate", "create_quant_config", "quant_report",
           "quantize", "quantize_model"]
