"""``opencann atc``: the command line of CANN's ATC model converter, with its flag names
(source: Ascend "ATC Instructions", parameters --model, --framework, --output,
--input_shape, --soc_version, --precision_mode, --fusion_switch_file, --log,
--dump_graph... ). Here: the argparse types that turn ATC's values into opencann's."""
from __future__ import annotations

import argparse
import logging
import os
import re
from typing import Dict, Tuple

#: ATC's --framework codes (0 Caffe, 1 MindSpore, 3 TensorFlow, 5 ONNX) and ours
FRAMEWORKS = {"0": "Caffe", "1": "MindSpore", "3": "TensorFlow", "5": "onnx", "onnx": "onnx",
              "pytorch": "pytorch"}

#: --log levels (ATC: debug, info, warning, error, null) -> logging levels
LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
              "error": logging.ERROR, "null": logging.CRITICAL + 1}


def framework(text: str) -> str:
    """``5`` or ``onnx`` -> "onnx"; ``pytorch`` -> "pytorch"; ATC's other codes are named
    and refused."""
    f = FRAMEWORKS.get(text.lower())
    if f in ("onnx", "pytorch"):
        return f
    what = f"{text} ({f})" if f else repr(text)
    raise argparse.ArgumentTypeError(f"framework {what} is not supported; use 5 (ONNX) or "
                                     "pytorch (with --model file.py:factory)")


def soc_version(text: str) -> str:
    """An Ascend SoC name as ATC takes it (Ascend910B, Ascend910B2, Ascend910A,
    Ascend310P3...) or ``cpu`` -> an opencann device: "cpu", "vnpu:ascend910b",
    "vnpu:ascend910", "vnpu:ascend310" (the vnpu presets)."""
    t = text.strip().lower()
    if t == "cpu":
        return "cpu"
    if re.fullmatch(r"ascend910b\d*", t):
        return "vnpu:ascend910b"
    if re.fullmatch(r"ascend910[a-z]?\d*", t):
        return "vnpu:ascend910"
    if re.fullmatch(r"ascend310[a-z]?\d*", t):
        return "vnpu:ascend310"
    raise argparse.ArgumentTypeError(f"unknown soc_version {text!r}; use cpu, Ascend910B[1-4], "
                                     "Ascend910[A] or Ascend310[P3...] (vnpu presets "
                                     "ascend910b, ascend910, ascend310)")


def input_shape(text: str) -> Dict[str, Tuple[int, ...]]:
    """ATC's ``"x:1,3,224,224;mask:1,128"`` -> {"x": (1, 3, 224, 224), "mask": (1, 128)};
    -1 marks a dim the gears fill (``"x:-1,3,224,224"`` with ``--dynamic_batch_size``).
    ATC's shape ranges (``1~10``) are refused: opencann's ranges are
    ``opencann.compile(dynamic_shapes=..., dim_ranges=...)``."""
    out: Dict[str, Tuple[int, ...]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, dims = part.rpartition(":")
        if "~" in dims:
            raise argparse.ArgumentTypeError(
                f"{part!r}: shape ranges (ATC's dynamic shape) are not taken here; give sizes, "
                "-1 with a gear flag (--dynamic_batch_size...), or compile from Python with "
                "dynamic_shapes and dim_ranges")
        try:
            sizes = tuple(int(d) for d in dims.split(",")) if dims.strip() else ()
        except ValueError:
            sizes = None
        if not sep or not name or sizes is None or any(d < -1 for d in sizes):
            raise argparse.ArgumentTypeError(
                f"{part!r} is not name:sizes; write e.g. \"x:1,3,224,224;y:1,128\"")
        if name in out:
            raise argparse.ArgumentTypeError(f"input {name!r} is given twice")
        out[name] = sizes
    if not out:
        raise argparse.ArgumentTypeError("empty; write e.g. \"x:1,3,224,224\"")
    return out


def concrete_input_shape(text: str) -> Dict[str, Tuple[int, ...]]:
    """`input_shape` without -1: the sizes of one shape to run (``opencann run/bench``)."""
    out = input_shape(text)
    for name, sizes in out.items():
        if -1 in sizes:
            raise argparse.ArgumentTypeError(
                f"{name}:{','.join(map(str, sizes))} has -1; give every size of the shape to "
                "run (a gear's, for a model compiled with gears)")
    return out


def output_path(text: str) -> str:
    """``--output r50`` -> "r50.ocm" (ATC appends .om; we append .ocm unless given); a
    directory (``out/``, or one that exists) is kept as it is: `output_in` names the file
    in it after the model."""
    if text.endswith(("/", os.sep)) or os.path.isdir(text):
        return text
    return text if text.endswith(".ocm") else text + ".ocm"


def output_in(output: str, model: str) -> str:
    """The model file ``--output`` names: ``output`` itself, or for a directory
    ``<dir>/<model's file stem>.ocm`` (``--model resnet50.onnx --output out/`` ->
    ``out/resnet50.ocm``), never a hidden ``out/.ocm``."""
    if not (output.endswith(("/", os.sep)) or os.path.isdir(output)):
        return output
    stem = os.path.splitext(os.path.basename(str(model).split(":")[0].rstrip("/" + os.sep)))[0]
    return os.path.join(output, (stem or "model") + ".ocm")
