"""uint8 activation quantization on the CPU: `quantize_u8` (AscendQuant's and ONNX
QuantizeLinear's rounding) and `dynamic_params` (ONNX DynamicQuantizeLinear's step and
offset), shared by the int8 kernels (`int8_cpu`, `int8_emulated`) and the tools; and the
checks of a hand-written quantization config every entry shares (`check_record`,
`check_skip_layers`)."""
from __future__ import annotations

import math
import numbers
from typing import List, Tuple

import torch

from .out_arg import check_out

QMIN, QMAX = 0, 255   # uint8 activations

#: the least activation step: float32's smallest normal, 2**-126. A smaller step's
#: reciprocal overflows float32 (x · (1 / step) = ±inf: every value saturates) and the
#: step itself would be a denormal in the kernels' fp32 scales.
MIN_STEP = 2.0 ** -126


def quantize_u8(x: torch.Tensor, step: float, offset: int, out: torch.Tensor = None,
                divide: bool = False) -> torch.Tensor:
    """``x`` (float) to uint8 ``saturate(round_half_even(x / step) + offset)`` in [0, 255],
    NaN → 0; x's memory format kept. ``step`` > 0 (float), ``offset`` in [0, 255]. A dense
    fp32 x takes one numba pass (`quant_numba.quantize_dense`, same values), a dense bf16
    x one pass reading it directly (`quant_bf16_numba.quantize_bf16_dense`: the values of
    quantizing ``x.float()``, no Cast); any other the eager ops below. ``out``: a uint8
    tensor of x's shape that receives the result (written in place by the numba pass when
    it has x's strides, else copied into) and is returned; None: a fresh tensor.
    ``divide``: x / step, correctly rounded (ONNX QuantizeLinear), where the default
    multiplies by 1 / step in fp32 (AscendQuant's ``x * scale``; a value on a rounding
    boundary may land one step apart). Raises ValueError (one line) for an ``out`` of
    another dtype or shape."""
    from .quant_numba import quantize_dense   # numba loads on the first int8 call only
    from .quant_bf16_numba import quantize_bf16_dense
    check_out("quantize_u8", out, x.shape, torch.uint8)
    y = (quantize_dense(x, step, offset, out, divide) if x.dtype == torch.float32
         else None if divide else quantize_bf16_dense(x, step, offset, out))
    if y is not None:
        return y
    y = torch.div(x.float(), step) if divide else torch.mul(x.float(), 1.0 / step)
    y.round_().add_(offset).clamp_(QMIN, QMAX)
    torch.nan_to_num_(y, nan=float(QMIN))
    y = y.to(torch.uint8)
    return y if out is None else out.copy_(y)


def uint8_params(lo: float, hi: float) -> Tuple[float, int]:
    """(step, offset) of uint8 over [min(lo, 0), max(hi, 0)] (finite floats): step =
    range / 255, at least `MIN_STEP` (a narrower range keeps fewer than 255 levels instead
    of saturating every value), offset = saturate(round(-min / step)); (1.0, 0) for an
    empty range (0 = 0: only zeros seen). ONNX DynamicQuantizeLinear's and calibration's
    rule (CANN AMCT's scale_d / offset_d)."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    step = (hi - lo) / 255.0
    if not (step > 0.0 and step != float("inf")):
        return 1.0, 0
    step = max(step, MIN_STEP)
    return step, int(min(max(round(-lo / step), QMIN), QMAX))


def dynamic_params(x: torch.Tensor) -> Tuple[float, int]:
    """(step, offset) of ONNX DynamicQuantizeLinear for ``x``: `uint8_params` of x's range
    (step 1.0 for an all-zero x, at least `MIN_STEP`). NaN / ±inf in x are left out of the
    range, as calibration leaves them out (a second pass, only when the first range is not
    finite): the finite values keep their resolution and the specials saturate
    (docs/guide/quantization.md); step 1.0 when no value is finite. x fp32 or bf16 (read
    as it is: bf16 values are exact in fp32)."""
    lo, hi = torch.aminmax(x)
    lo, hi = float(lo), float(hi)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        fin = x[torch.isfinite(x)]
        lo, hi = (float(fin.min()), float(fin.max())) if fin.numel() else (0.0, 0.0)
    return uint8_params(lo, hi)


#: what a record's fields take (`check_record`'s messages)
_STEP_RULE = ("a finite float >= 2**-126 (float32's smallest normal: 1 / scale_d must not overflow), "
              "e.g. (max - min) / 255 of the layer's input range")
_OFFSET_RULE = f"an int in [{QMIN}, {QMAX}] (the uint8 zero point), e.g. round(-min / scale_d)"


def check_record(layer: str, rec: object, where: str = "option 'quant_config'") -> None:
    """Raises ValueError (one line naming ``where``, the layer, the field, the bad value and
    what it takes) unless ``rec`` is a valid uint8 activation record (AMCT's): a dict whose
    ``scale_d`` is a finite real >= `MIN_STEP` and ``offset_d`` an integer in [0, 255]
    (bool refused; NumPy scalars taken), and whose optional ``"accum"`` / ``"out"`` (a ConvAddAct's addend and
    result ranges) are records of the same two fields. Other keys ("min", "max", ...) are
    not read. The one rule for every hand-written record: a bad one is an error, never a
    layer silently kept in fp32 (calibration's records always hold)."""
    _check_fields(f"{where}: layer {layer!r}", rec)
    for key in ("accum", "out"):
        if isinstance(rec, dict) and key in rec:
            _check_fields(f"{where}: layer {layer!r} record {key!r}", rec[key])


def _check_fields(at: str, rec: object) -> None:
    """`check_record`'s test of one {"scale_d", "offset_d"} dict."""
    if not isinstance(rec, dict):
        raise ValueError(f"{at} is {rec!r:.60} ({type(rec).__name__}); give a dict "
                         f"{{'scale_d': step, 'offset_d': zero_point}}")
    for key, rule in (("scale_d", _STEP_RULE), ("offset_d", _OFFSET_RULE)):
        if key not in rec:
            raise ValueError(f"{at} has no {key!r}; give {key}: {rule}")
    step, off = rec["scale_d"], rec["offset_d"]
    if isinstance(step, bool) or not isinstance(step, numbers.Real) or not (
            _finite(step) and step >= MIN_STEP):
        raise ValueError(f"{at}: scale_d = {_show(step)}; give {_STEP_RULE}")
    if isinstance(off, bool) or not isinstance(off, numbers.Integral) or not QMIN <= off <= QMAX:
        raise ValueError(f"{at}: offset_d = {_show(off)}; give {_OFFSET_RULE}")


def check_skip_layers(skip: object, where: str = "option 'quant_config': 'skip_layers'") -> List[str]:
    """``skip`` as a list of names, the one check of every entry taking ``skip_layers``
    (the compile option ``quant_config``, ``create_quant_config``, ``opencann.quantize``'s
    ``config``). It takes None (no layer) or a list / tuple / set / frozenset of non-empty
    str (module, node or traced names kept in float; a set comes back sorted). Anything
    else (a str, read letter by letter; an int, a dict, bytes, None or "" inside) is one
    ValueError line naming ``where``, the bad value and what to give. Whether each name
    labels a layer is checked where the graph is known (the int8 passes' `check_layer_names`)."""
    if skip is None:
        return []
    if isinstance(skip, str):
        raise ValueError(f"{where} takes a list of names, e.g. [{skip or 'fc'!r}], got the str {skip!r:.60} "
                         f"(a str would be read letter by letter)")
    what = f"{where} takes a list of layer names (non-empty str), e.g. ['fc'], got {skip!r:.60} ({type(skip).__name__})"
    if not isinstance(skip, (list, tuple, set, frozenset)):
        raise ValueError(what)
    bad = [s for s in skip if not (isinstance(s, str) and s)]
    if bad:
        raise ValueError(f"{what} holding {bad[0]!r:.40} ({type(bad[0]).__name__})")
    return sorted(skip) if isinstance(skip, (set, frozenset)) else list(skip)


def _finite(v: numbers.Real) -> bool:
    """Whether ``v`` is a finite float32-sized value (an int too large for a float, e.g. a
    hand-written 1 followed by 400 zeros, is not: `math.isfinite` would raise)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _show(v: object) -> str:
    """``v`` for a message: numbers as repr, anything else with its type."""
    if isinstance(v, numbers.Integral) and not isinstance(v, bool) and abs(v) > 10 ** 30:
        return f"an int of {len(str(abs(v)))} digits"
    if isinstance(v, numbers.Real) and not isinstance(v, bool):
        return repr(v)
    return f"{v!r:.40} ({type(v).__name__})"


__all__ = ["MIN_STEP", "QMAX", "QMIN", "check_record", "check_skip_layers", "dynamic_params", "quantize_u8", "uint8_params"]
