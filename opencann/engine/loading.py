"""A `CompiledModel` from the parts of a model file (`opencann.load`): the shape policy
the file names (static, dynamic dims, gears) and the one `CompiledModel` constructor."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from ..ir import Graph, MemoryPlan
from ..report import CompileReport
from ..runtime import DEFAULT_CONCURRENT_CALLS
from .compiled_model import CompiledModel
from .dynamic import DynamicShapes
from .gears import Gears
from .shapes import StaticShapes


def model_from_parts(graph: Graph, plan: MemoryPlan, report: CompileReport, in_spec, out_spec,
                     input_positions: Optional[Sequence[int]], baked: Dict[int, Any],
                     contiguous: Sequence[bool],
                     concurrent_calls: int = DEFAULT_CONCURRENT_CALLS,
                     arg_names: Optional[Sequence[Optional[str]]] = None,
                     storage_offsets: Optional[Sequence[int]] = None,
                     strides: Optional[Sequence[Sequence[int]]] = None,
                     dynamic: Optional[Dict[str, Any]] = None,
                     gears: Optional[Dict[str, Any]] = None,
                     onnx_inputs: Optional[Sequence[str]] = None) -> CompiledModel:
    """A compiled model from saved parts (`opencann.runtime.model_file.read`'s fields
    but ``metadata``): graph, plan, report, the calling convention
    (`CompiledModel.calling_convention`; ``storage_offsets`` absent in older files: 0,
    ``strides`` absent: not checked; ``onnx_inputs``: an ONNX graph's input names, by
    which it is called as the live model is) and the shape policy's fields (``dynamic``,
    ``gears``: None for a static model). Binds kernels (a static model) or plans the
    example's shape and every gear again (a dynamic one); no capture. Weights are not
    watched for in-place changes (the file holds its own copy). Raises KeyError or
    TypeError for malformed ``dynamic``/``gears`` fields."""
    if dynamic is None:
        shapes = StaticShapes(graph, plan, report, concurrent_calls)
    elif gears:
        shapes = Gears(**Gears.saved_args(graph, report, dynamic, concurrent_calls, gears))
    else:
        shapes = DynamicShapes(**DynamicShapes.saved_args(graph, report, dynamic,
                                                          concurrent_calls))
    return CompiledModel(graph, report, shapes, in_spec=in_spec, out_spec=out_spec,
                         input_positions=input_positions, baked=baked, contiguous=contiguous,
                         storage_offsets=storage_offsets or [], strides=strides or [],
                         arg_names=arg_names, onnx_inputs=onnx_inputs)


def load_model_file(path: str) -> CompiledModel:
    """The `CompiledModel` of the model file at ``path`` (`opencann.load`, which also
    releases the OpenMP pool). Raises ModelFileError (a ValueError, one line) and
    FileNotFoundError as `opencann.runtime.model_file.read` does."""
    from ..runtime.model_file import read
    parts = read(path)
    parts.pop("metadata")
    return model_from_parts(**parts)


__all__ = ["load_model_file", "model_from_parts"]
