"""Runtime: executor over one memory arena, per-op profiling (Chrome trace), and a
bounded pool of executors for calls from several threads."""
from .alias_check import AliasingError
from .executor import ExecutionError, Executor
from .pool import DEFAULT_CONCURRENT_CALLS, ExecutorPool

__all__ = ["AliasingError", "DEFAULT_CONCURRENT_CALLS", "ExecutionError", "Executor",
           "ExecutorPool"]
