"""Capture: `torch.export` then decomposition to core ATen.

We keep ``aten.scaled_dot_product_attention`` undecomposed so that the fusion stage
can map it to FlashAttention (the core-ATen decomposition would spell it out as
bmm/softmax/where). Source: PyTorch "torch.export" and "Core ATen IR" documentation.

torch.export is not thread-safe: it sets process-wide tracing state (the proxy mode
slot, the FX patcher, ``torch.fx._symbolic_trace._is_fx_tracing_flag``) and, in
non-strict mode, replaces ``builtins.max``, ``builtins.min`` and ``math.pow`` for the
duration of the trace (``torch._export.non_strict_utils._override_builtin_ops``). Two
overlapping traces (two exports, or an export and a dynamo compile) fail with
torch-internal assertions and can leave those replaced for good (each restores what it
found: the other's replacement), after which every torch.compile'd call fails. So
`capture` runs one export at a time (`_EXPORT_LOCK`), holds dynamo's compile lock
meanwhile (no torch.compile compiles during it), and puts back any of the four that
differ afterwards. A torch.compile'd function *called* in another thread during an
export still sees the FX flag and raises torch's "FX to symbolically trace a
dynamo-optimized function" error: torch's limit, loud and transient.
"""
from __future__ import annotations

import builtins
import contextlib
import math
import threading
import time
import warnings
from typing import Any, Dict, Tuple

import torch

from ...ir.types import DataType

KEEP = (torch.ops.aten.scaled_dot_product_attention.default,)

_EXPORT_LOCK = threading.Lock()
_PATCHED_BY_EXPORT = ((builtins, "max"), (builtins, "min"), (math, "pow"),
                      (torch.fx._symbolic_trace, "_is_fx_tracing_flag"))


class CaptureError(RuntimeError):
    """torch.export could not capture the model; the message says why and what to do."""


def decomposition_table() -> Dict:
    table = torch.export.default_decompositions()
    for op in KEEP:
        table.pop(op, None)
    return table


def capture(model: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any] | None = None,
            ) -> Tuple[torch.export.ExportedProgram, Dict[str, float]]:
    """Export ``model`` on ``args``/``kwargs`` and decompose to core ATen.

    Returns the ExportedProgram and timings in seconds (``export``, ``decompose``).
    Raises CaptureError when torch.export fails (data-dependent control flow, unsupported
    Python constructs): the message suggests ``torch.compile(backend="opencann")``, which
    splits the model at graph breaks instead."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"opencann.compile expects a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(args, tuple):
        args = (args,)
    for i, a in enumerate(torch.utils._pytree.tree_leaves((args, kwargs or {}))):
        if isinstance(a, torch.Tensor):
            DataType.from_torch(a.dtype)  # clear error for unsupported dtypes
    with _serialized_export():
        return _capture(model, args, kwargs)


@contextlib.contextmanager
def _serialized_export():
    """Hold `_EXPORT_LOCK` and dynamo's compile lock; on exit put back any of
    `_PATCHED_BY_EXPORT` that changed."""
    with _EXPORT_LOCK, _dynamo_compile_lock():
        saved = [(mod, name, getattr(mod, name)) for mod, name in _PATCHED_BY_EXPORT]
        try:
            yield
        finally:
            for mod, name, fn in saved:
                if getattr(mod, name) is not fn:
                    setattr(mod, name, fn)


def _dynamo_compile_lock():
    """torch.compile's process-wide compile lock (a reentrant lock), or a no-op context
    if this torch has none. Taken after `_EXPORT_LOCK`; dynamo's backends never take
    `_EXPORT_LOCK`, so the order is fixed."""
    try:
        from torch._dynamo.convert_frame import compile_lock
    except (ImportError, AttributeError):
        return contextlib.nullcontext()
    return compile_lock


def _capture(model, args, kwargs):
    t0 = time.perf_counter()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # torch-internal deprecation noise from export's own pytree use
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            ep = torch.export.export(model, args, kwargs or {}, strict=False)
    except Exception as e:  # noqa: BLE001 - re-raised with advice
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}\n  fix: remove data-dependent "
            "Python control flow, or use torch.compile(model, backend='opencann'), which "
            "compiles each graph between breaks") from None
    t1 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        ep = ep.run_decompositions(decomposition_table())
    t2 = time.perf_counter()
    return ep, {"export": t1 - t0, "decompose": t2 - t1}
