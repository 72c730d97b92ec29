"""Loading and validating an ONNX model before conversion.

``load_model`` takes a path or a ``ModelProto`` and returns a checked, function-inlined
``ModelProto`` whose external data (weights stored beside the ``.onnx`` file) has been
read, relative to the file's directory. Every failure is one ``OnnxLoadError`` line
naming the problem and the fix. Uses the onnx package itself (parser, checker,
inliner), the specification's own implementation.
"""
from __future__ import annotations

import os
from typing import Any

MIN_OPSET = 13


def upgrade_opset(model, opset: int, where: str):
    """``model`` (default-domain opset ``opset`` < 13) upgraded to opset 13 by
    ``onnx.version_converter`` (the onnx project's own adapters; ATC likewise accepts old
    opsets), logged at WARNING. The IR version is raised to at least 7, since the converter
    adds initializers that are not graph inputs, which IR version 3 forbids. Raises
    OnnxLoadError naming the converter's failure when it cannot convert the model."""
    from onnx import version_converter
    from ...log import logger
    try:
        new = version_converter.convert_version(model, MIN_OPSET)
    except Exception as e:  # noqa: BLE001 - the converter raises RuntimeError/ValueError/...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OnnxLoadError(f"{where} uses opset {opset}; opencann reads opset {MIN_OPSET} and "
                            f"newer, and onnx.version_converter could not upgrade it ({first}): "
                            "re-export the model at opset 13 or newer") from None
    new.ir_version = max(new.ir_version, 7)
    logger.warning("%s uses opset %d: upgraded to opset %d with onnx.version_converter",
                   where, opset, MIN_OPSET)
    return new


class OnnxLoadError(ValueError):
    """The ONNX model cannot be loaded: the message names the problem and the fix."""


def _onnx():
    try:
        import onnx
    except ImportError:  # pragma: no cover - optional extra
        raise OnnxLoadError("the ONNX frontend needs the onnx package: "
                            "pip install 'opencann[onnx]'") from None
    return onnx


def _read(path: str):
    onnx = _onnx()
    from google.protobuf.message import DecodeError
    if not os.path.isfile(path):
        raise OnnxLoadError(f"{path}: no such ONNX file")
    if os.path.getsize(path) == 0:
        raise OnnxLoadError(f"{path}: the file is empty; re-export or re-download the model")
    try:
        model = onnx.load(path, load_external_data=False)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise OnnxLoadError(f"{path} is not a valid ONNX model (protobuf parse failed: "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}); the "
                            "file is truncated or corrupt: re-export or re-download it") from None
    try:
        from onnx.external_data_helper import load_external_data_for_model
        load_external_data_for_model(model, os.path.dirname(os.path.abspath(path)))
    except Exception as e:  # noqa: BLE001 - OSError, or onnx's ValidationError for a bad location
        raise OnnxLoadError(f"{path}: its external weight data could not be read ({e}); keep "
                            "the data file(s) next to the .onnx file, as saved") from None
    return model


def _has_external(model) -> bool:
    from onnx import TensorProto
    return any(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer)


def load_model(source: Any):
    """``source``: a path (str or os.PathLike) to a ``.onnx`` file or an
    ``onnx.ModelProto``. Returns a validated ``ModelProto`` with local functions
    inlined and external data loaded.

    Raises OnnxLoadError: missing, empty, truncated or corrupt file; external data
    missing; a ModelProto whose external data was not loaded; a model ``onnx.checker``
    rejects (the message says so, with the checker's first line); a default-domain opset below 13
    that ``onnx.version_converter`` cannot upgrade (such models are upgraded to opset 13 and
    the log says so, as ATC accepts them)."""
    onnx = _onnx()
    if isinstance(source, (str, os.PathLike)):
        where = os.fspath(source)
        model = _read(where)
    elif isinstance(source, onnx.ModelProto):
        where = source.graph.name or "the model"
        model = source
        if _has_external(model):
            raise OnnxLoadError(f"{where}: its weights are in external data files that were not "
                                "loaded; pass the .onnx path instead, or onnx.load(path) with "
                                "load_external_data=True")
    else:
        raise OnnxLoadError(f"expected a path to an .onnx file or an onnx.ModelProto, got "
                            f"{type(source).__name__}")
    if not model.graph.node and not model.graph.output:
        raise OnnxLoadError(f"{where}: the model has no graph (no nodes, no outputs); the file is "
                            "truncated or not an ONNX model")
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None:
        raise OnnxLoadError(f"{where}: the model imports no default-domain (ai.onnx) opset")
    if opset < MIN_OPSET:
        model = upgrade_opset(model, opset, where)
    try:
        onnx.checker.check_model(model)
    except (onnx.checker.ValidationError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OnnxLoadError(f"{where}: the model does not pass onnx.checker: {first}; fix the "
                            "model (e.g. give every graph output a type) or re-export it") from None
    known = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer}
    known |= {y for n in model.graph.node for y in n.output}
    missing = [o.name for o in model.graph.output if o.name not in known]
    if missing:
        raise OnnxLoadError(f"{where}: graph output(s) {missing} are produced by no node; the "
                            "file is truncated or corrupt: re-export it")
    if model.functions:
        from onnx import inliner
        model = inliner.inline_local_functions(model)
    return model
