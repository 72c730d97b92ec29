"""The graph engine: capture entry points, the pipeline driver, kernel binding and the
compiled model with its shape behaviour (static, dynamic dims, gears).

Layer (DESIGN.md): above ``frontend | passes | runtime``, below the applications
(``dynamo``, ``llm``) and ``tools | acl``. Modules: `pipeline` (run the passes),
`binding` (the runtime stage), `compiled_model` (the one `CompiledModel`), `shapes`
(its shape policy; `StaticShapes`), `guards` (its call-time checks), `entry`
(``opencann.compile`` of a module or an ONNX model), `dispatch` (a module's shape policy), `dynamic` (dynamic dims:
`DynamicShapes`), `gears` (ATC-style gears: `Gears`), `loading` (a model from a model
file's parts), `options` (compile options).
"""
from .binding import BindKernels, measured_streams, snapshot_constants
from .compiled_model import CompiledModel, OnnxCompiledModel
from .entry import compile_module, compile_onnx, convert_exported
from .guards import Guard
from .pipeline import check_compile_options, compile_graph, graph_cost, run_pipeline
from .shapes import ShapePolicy, StaticShapes

__all__ = ["BindKernels", "CompiledModel", "Guard", "OnnxCompiledModel", "ShapePolicy",
           "StaticShapes", "check_compile_options", "compile_graph", "compile_module", "compile_onnx",
           "convert_exported", "graph_cost", "measured_streams", "run_pipeline",
           "snapshot_constants"]
