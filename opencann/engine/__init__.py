"""The graph engine: capture entry points, the pipeline driver, kernel binding and the
compiled model with its shape behaviour (static, dynamic dims, gears).

Layer (DESIGN.md): above ``frontend | passes | runtime``, below the applications
(``dynamo``, ``llm``) and ``tools | acl``. Modules: `pipeline` (run the passes),
`binding` (the runtime stage), `compiled_model`, `entry` (``opencann.compile`` of a
module or an ONNX model), `dynamic` (dynamic dims), `gears` (ATC-style gears),
`options` (compile options).
"""
from .binding import BindKernels, measured_streams, snapshot_constants
from .compiled_model import CompiledModel, OnnxCompiledModel
from .entry import compile_module, compile_onnx, convert_exported
from .pipeline import compile_graph, graph_cost, run_pipeline

__all__ = ["BindKernels", "CompiledModel", "OnnxCompiledModel", "compile_graph",
           "compile_module", "compile_onnx", "convert_exported", "graph_cost",
           "measured_streams", "run_pipeline", "snapshot_constants"]
