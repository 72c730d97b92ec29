"""Runtime: executor over one memory arena, per-op profiling (Chrome trace)."""
from .executor import ExecutionError, Executor

__all__ = ["ExecutionError", "Executor"]
