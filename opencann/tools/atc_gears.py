"""ATC's shape-profile flags on ``opencann atc``: ``--dynamic_batch_size``,
``--dynamic_image_size``, ``--dynamic_dims`` and ``--input_format``, with ATC's rules,
mapped onto opencann's gears (`opencann.engine.gears`: the option of the same name plus
a ``dynamic_shapes`` spec naming the dims the gears fill).

ATC's rules, as its parameter reference states them (Ascend "ATC Instructions",
``--dynamic_batch_size``, ``--dynamic_image_size``, ``--dynamic_dims``, ``--input_shape``,
``--input_format``):

- each gear flag goes with ``--input_shape``, whose -1 marks the dims the gears fill;
  the three are mutually exclusive (argparse says so, one line);
- ``--dynamic_batch_size "1,2,4,8"``: N first in the shape, so -1 only at dim 0 (a batch
  elsewhere is ``--dynamic_dims``);
- ``--dynamic_image_size "h1,w1;h2,w2"``: -1 at H and W (dims 2 and 3 of NCHW, the
  default ``--input_format``; dims 1 and 2 of NHWC), both;
- ``--dynamic_dims "d1,d2;d3,d4"`` (ND format): one value per -1 of ``--input_shape``,
  in order, the same count in every gear;
- the gear count is in (1, 100]: at least 2 gears, at most 100 (`MAX_GEARS`);
- ``--input_format``: NCHW (ATC's default for ONNX), NHWC, ND, NCDHW, NDHWC (`FORMATS`).

opencann serves a call with the smallest gear holding it (padding where provably
harmless); ATC's extra dynamic-index input is opencann.acl's ``ascend_mbatch_shape_data``
(`opencann.acl.model_shapes`). A -1 without a gear flag, or a gear flag without a -1, is
one error line. Gears apply to torch models (``--framework pytorch``); an ONNX model is
compiled for static shapes, so gears on one are refused in one line."""
from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..engine.gears import MAX_GEARS

#: ATC's --input_format values (ONNX: NCHW default, NCDHW, ND; TensorFlow: NHWC, NDHWC)
FORMATS = ("NCHW", "NHWC", "ND", "NCDHW", "NDHWC")
#: the gear flags, in ATC's spelling (= opencann's gear option names)
GEAR_FLAGS = ("dynamic_batch_size", "dynamic_image_size", "dynamic_dims")
#: (H, W) dims per 4-D format, for --dynamic_image_size
HW_DIMS = {"NCHW": (2, 3), "NHWC": (1, 2)}


def _gears(text: str, width: Optional[int], eg: str) -> List[Tuple[int, ...]]:
    """``"1,2,4"`` (width 1: one value per gear, split by ',') or ``"a,b;c,d"`` (gears
    split by ';', ``width`` values each; None: any width, the same in every gear) as
    tuples of positive ints; ATC's count (1, 100] and no gear twice."""
    parts = [p.strip() for p in (text.split(",") if width == 1 else text.split(";")) if p.strip()]
    try:
        gears = [tuple(int(v) for v in p.split(",")) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not gears of whole numbers; write e.g. {eg}") from None
    if any(v < 1 for g in gears for v in g):
        raise argparse.ArgumentTypeError(f"{text!r}: every size must be at least 1; e.g. {eg}")
    widths = {len(g) for g in gears}
    if (width is not None and widths - {width}) or len(widths) > 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: every gear takes {width or 'the same number of'} value(s); e.g. {eg}")
    if not 1 < len(gears) <= MAX_GEARS:
        raise argparse.ArgumentTypeError(
            f"{text!r} has {len(gears)} gear(s); ATC takes 2 to {MAX_GEARS}, e.g. {eg}")
    twice = sorted({g for g in gears if gears.count(g) > 1})
    if twice:
        shown = [g[0] if len(g) == 1 else ",".join(map(str, g)) for g in twice]
        raise argparse.ArgumentTypeError(f"{text!r} gives gear(s) {shown} twice")
    return gears


def dynamic_batch_size(text: str) -> List[int]:
    """ATC's ``"1,2,4,8"`` -> [1, 2, 4, 8] (2 to 100 distinct positive ints)."""
    return [g[0] for g in _gears(text, 1, '"1,2,4,8"')]


def dynamic_image_size(text: str) -> List[Tuple[int, int]]:
    """ATC's ``"224,224;448,448"`` -> [(224, 224), (448, 448)] (height, width)."""
    return _gears(text, 2, '"224,224;448,448"')


def dynamic_dims(text: str) -> List[Tuple[int, ...]]:
    """ATC's ``"16,16;32,32"`` -> [(16, 16), (32, 32)]: per gear, one value per -1 of
    ``--input_shape`` in order."""
    return _gears(text, None, '"16,16;32,32;64,64"')


def input_format(text: str) -> str:
    """One of ATC's --input_format values (`FORMATS`), case-insensitive."""
    t = text.strip().upper()
    if t not in FORMATS:
        raise argparse.ArgumentTypeError(f"unknown input_format {text!r}; use one of {', '.join(FORMATS)}")
    return t


def _shown(name: str, sizes: Sequence[int]) -> str:
    return f"{name}:{','.join(map(str, sizes))}"


def _holes(shapes: Dict[str, Tuple[int, ...]]) -> List[Tuple[str, int]]:
    """(input, dim) of every -1 of ``--input_shape``, in order."""
    return [(n, i) for n, s in shapes.items() for i, d in enumerate(s) if d == -1]


def check_profile(flag: Optional[str], gears: Optional[list], shapes: Optional[Dict[str, Tuple[int, ...]]],
                  fmt: Optional[str]) -> Optional[Dict[str, Dict[int, str]]]:
    """Check ATC's rules (module docstring) for the gear flag ``flag`` (None: none given)
    with its ``gears``, ``--input_shape`` ``shapes`` and ``--input_format`` ``fmt``; return
    the dims the gears fill as a ``dynamic_shapes`` spec, input -> {dim: name} (None
    without a flag). Names: "batch"; "height", "width"; for dynamic_dims "dim<k>" per -1,
    one name shared by -1s that take the same value in every gear (torch.export sees one
    dim there). Raises ValueError, one line per violation."""
    holes = _holes(shapes or {})
    if flag is None:
        if holes:
            n, i = holes[0]
            raise ValueError(f"--input_shape {_shown(n, shapes[n])} has -1 at dim {i}: a dim the "
                             "gears fill; give --dynamic_batch_size, --dynamic_image_size or "
                             "--dynamic_dims with it, or its size")
        return None
    if not holes:
        eg = {"dynamic_batch_size": "x:-1,3,224,224", "dynamic_image_size": "x:1,3,-1,-1",
              "dynamic_dims": "input_ids:1,-1"}[flag]
        raise ValueError(f"--{flag} needs --input_shape with -1 in the dims the gears fill, "
                         f'e.g. --input_shape "{eg}"')
    if flag == "dynamic_batch_size":
        for n, i in holes:
            if i != 0:
                raise ValueError(f"--dynamic_batch_size fills dim 0 (N) only, but --input_shape "
                                 f"{_shown(n, shapes[n])} has -1 at dim {i}; a batch elsewhere "
                                 "or other dims: --dynamic_dims")
        return {n: {0: "batch"} for n, _ in holes}
    if flag == "dynamic_image_size":
        f = fmt or "NCHW"
        if f not in HW_DIMS:
            raise ValueError(f"--dynamic_image_size fills H and W of NCHW or NHWC inputs, but "
                             f"--input_format is {f}: give NCHW or NHWC, or use --dynamic_dims")
        h, w = HW_DIMS[f]
        for n in dict.fromkeys(n for n, _ in holes):
            mine = [i for m, i in holes if m == n]
            if len(shapes[n]) != 4 or mine != [h, w]:
                raise ValueError(f"--dynamic_image_size fills H and W (dims {h} and {w} of {f}), "
                                 f"both -1 in --input_shape, but {_shown(n, shapes[n])} has -1 "
                                 f"at dim(s) {mine}" + ("" if len(shapes[n]) == 4 else
                                                        f" and {len(shapes[n])} dims"))
        return {n: {h: "height", w: "width"} for n, _ in holes}
    if fmt not in (None, "ND"):
        raise ValueError(f"--dynamic_dims sets ND-format gears, but --input_format is {fmt}: "
                         "give --input_format ND (or leave it out)")
    if len(gears[0]) != len(holes):
        where = ", ".join(f"{n} dim {i}" for n, i in holes)
        raise ValueError(f"--dynamic_dims gives {len(gears[0])} value(s) per gear but "
                         f"--input_shape has {len(holes)} -1(s) ({where}): one value per -1, "
                         "in order")
    spec: Dict[str, Dict[int, str]] = {}
    first: Dict[Tuple[int, ...], str] = {}
    for k, (n, i) in enumerate(holes):
        column = tuple(g[k] for g in gears)
        spec.setdefault(n, {})[i] = first.setdefault(column, f"dim{k}")
    return spec


def gear_options(flag: str, gears: list, spec: Dict[str, Dict[int, str]]) -> Dict[str, Any]:
    """The opencann compile option for ATC's ``flag`` and its ``gears`` over ``spec``
    (`check_profile`): dynamic_dims' values reduced to one per named dim, in the order
    `opencann.engine.gears.gear_spec` reads the names."""
    if flag != "dynamic_dims":
        return {flag: [list(g) if isinstance(g, tuple) else g for g in gears]}
    names = list(dict.fromkeys(v for dims in spec.values() for v in dims.values()))
    order = [f"dim{k}" for k in range(len(gears[0]))]
    return {flag: [[g[order.index(nm)] for nm in names] for g in gears]}


def check_example(spec_shapes: Dict[str, Tuple[int, ...]], tensors: Dict[str, Any]) -> None:
    """``--input_shape`` against a torch model's example inputs (forward's argument name
    -> tensor): every name an input, the same rank, and each size other than -1 the
    example's (the example fixes the static dims). ValueError, one line."""
    for name, sizes in spec_shapes.items():
        t = tensors.get(name)
        if t is None:
            known = "; ".join(_shown(n, tuple(x.shape)) for n, x in tensors.items())
            raise ValueError(f"--input_shape names {name!r}, not a tensor input of the model; "
                             f"its inputs: {known}")
        if len(sizes) != t.dim() or any(s not in (-1, d) for s, d in zip(sizes, t.shape)):
            raise ValueError(f"--input_shape {_shown(name, sizes)} does not match the example "
                             f"input {_shown(name, tuple(t.shape))}: with --framework pytorch the "
                             "example fixes every size but the -1s")
