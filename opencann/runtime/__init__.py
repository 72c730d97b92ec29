"""Runtime: executor over one memory arena, per-op profiling (Chrome trace)."""
from .alias_check import AliasingError
from .executor import ExecutionError, Executor

__all__ = ["AliasingError", "ExecutionError", "Executor"]
