"""opencann IR: tensor descriptions, values, nodes, graphs, verifier, DOT export."""
from .types import DataType, Dim, Format, TensorDesc, is_dense, numel
from .graph import Graph, Node, TensorListRef, TensorRef, Value
from .replaces import traced_names
from .signature import CallSignature
from .verify import GraphError, verify
from .dot import to_dot

__all__ = ["DataType", "Dim", "Format", "TensorDesc", "Graph", "Node", "Value",
           "TensorRef", "TensorListRef", "traced_names", "CallSignature", "GraphError", "verify", "to_dot", "is_dense", "numel"]
from .plan import Buffer, MemoryPlan, Schedule, apply_schedule  # noqa: E402

__all__ += ["Buffer", "MemoryPlan", "Schedule", "apply_schedule"]
