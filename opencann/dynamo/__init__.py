"""``torch.compile`` backends: applications of the graph engine, above the compiler.

- `backend`: ``torch.compile(model, backend="opencann")`` (inference, and training when
  gradients are needed), found by name through the ``torch_dynamo_backends`` entry
  point (pyproject.toml), or registered by `register`;
- `training`: forward and backward graphs through AOTAutograd, with recomputation under
  a memory budget (`make_training_backend`);
- `partition`: the joint-graph partition (min cut, Chen checkpoints) and
  `recompute_bn`: BatchNorm outputs rebuilt from their saved statistics;
- `recompiles`: every compile per code object with dynamo's recompile reason and its
  source line, and the graphs run eagerly (`recompiles`, `eager_fallbacks`);
- `compile_fx`: the one FX → IR → `compile_graph` → executor path both backends share;
- `symbolic`: whether a graph is static, symbolic (sizes, strides, int arguments) or
  data-dependent (run eagerly), read from every value of the graph (`graph_symbols`);
- `freezing`: inference graphs get the module's parameters and buffers as constants
  (option ``freezing``), guarded per call and re-frozen when one changes.
"""
from .backend import opencann_backend, register
from .compile_fx import COMPILED_GRAPHS, compile_fx
from .partition import MemoryBudgetError, last_partition_report
from .recompiles import eager_fallbacks, recompiles
from .training import make_training_backend, opencann_training_backend

__all__ = ["COMPILED_GRAPHS", "MemoryBudgetError", "compile_fx", "eager_fallbacks",
           "last_partition_report", "make_training_backend", "opencann_backend",
           "opencann_training_backend", "recompiles", "register"]
