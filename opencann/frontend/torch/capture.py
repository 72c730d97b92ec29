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
import inspect
import io
import logging
import math
import os
import re
import sys
import threading
import time
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from ...ir.types import DataType
from ...ops.resize import OVERLOADS as RESIZE_OVERLOADS
from .dynamic import constraint_violation, declared_ranges
from .layout_queries import LayoutQueries
from .view_writes import rewrite_written_unfolds, written_expand

# Kept whole: SDPA (torch.export's form) and the CPU flash kernel it lowers to under
# dynamo/AOTAutograd. The latter's decomposition ends in permute → clone → permute and
# gives the output (L, B, H, D)-ordered strides where eager's is contiguous: a caller's
# .view() of the output would fail or the layout would differ from eager's.
# The upsampling overloads F.interpolate reaches (`opencann.ops.resize.OVERLOADS`, ``.vec``
# from torch.export, ``.default`` from AOTAutograd) are kept too: their decompositions
# re-derive the interpolation (a zero-weight tap times a NaN neighbour is NaN where ATen's
# kernel gives a number; bicubic becomes index_put host fallbacks), so they run ATen's.
KEEP = (torch.ops.aten.scaled_dot_product_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default) + RESIZE_OVERLOADS

_EXPORT_LOCK = threading.Lock()
_PATCHED_BY_EXPORT = ((builtins, "max"), (builtins, "min"), (math, "pow"),
                      (torch.fx._symbolic_trace, "_is_fx_tracing_flag"))


class CaptureError(RuntimeError):
    """torch.export could not capture the model; the message says why and what to do."""


def decomposition_table() -> Dict:
    """torch.export's default decompositions minus `KEEP` (scaled-dot-product attention stays one
    op, so its output keeps eager's strides and the attention fusion sees it): a dict from ATen
    overload to its decomposition, for ``run_decompositions``/``make_fx``."""
    table = torch.export.default_decompositions()
    for op in KEEP:
        table.pop(op, None)
    return table


@contextlib.contextmanager
def native_dispatch_of_kept() -> Iterator[None]:
    """Within it, AOTAutograd's trace (which runs with the Python dispatcher) records the
    `KEEP` overloads whole although ``torch._decomp`` registers Python decompositions for
    them at the ``Autograd`` / ``CompositeImplicitAutograd`` dispatch keys (the upsampling
    ops; taking them out of the decomposition table is not enough for those): a
    ``.default`` overload dispatches natively, a ``.vec`` overload computes its output
    size (symbolic sizes too: ATen's C++ composite accepts concrete sizes only) and
    calls its ``.default`` (`_vec_to_default`). Everything is put back on exit; eager
    calls never consult these Python kernels (no Python dispatcher). Yields nothing."""
    keys = (torch._C.DispatchKey.Autograd, torch._C.DispatchKey.CompositeImplicitAutograd)
    saved = {op: dict(op.py_kernels) for op in KEEP if any(k in op.py_kernels for k in keys)}
    try:
        for op in saved:
            for k in keys:
                op.py_kernels.pop(k, None)
            if op._overloadname == "vec":
                for k in keys:
                    op.py_kernels[k] = _vec_to_default(op)
            op._dispatch_cache.clear()
        yield
    finally:
        for op, kernels in saved.items():
            op.py_kernels.clear()
            op.py_kernels.update(kernels)
            op._dispatch_cache.clear()


def _vec_to_default(vec: torch._ops.OpOverload):
    """``upsample_*.vec(input, output_size, [align_corners,] scale_factors)`` as a call of
    ``upsample_*.default(input, osize, [align_corners,] *scales)``, the output size as
    ATen computes it (``torch._decomp.decompositions.upsample_compute_output_size``:
    floor(size · scale) when only scales are given, symbolic sizes included)."""
    from torch._decomp.decompositions import upsample_compute_output_size
    default = vec.overloadpacket.default

    def call(input, output_size, *rest):
        *align, scale_factors = rest
        osize = upsample_compute_output_size(input.size(), output_size, scale_factors)
        scales = list(scale_factors) if scale_factors else [None] * len(osize)
        return default(input, osize, *align, *scales)
    return call


def capture(model: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any] | None = None,
            dynamic_shapes: Any = None) -> Tuple[torch.export.ExportedProgram, Dict[str, float]]:
    """Export ``model`` on ``args``/``kwargs`` and decompose to core ATen.

    ``dynamic_shapes``: torch.export's spec of dynamic dims (None: all static; see
    `opencann.frontend.torch.dynamic`).
    Returns the ExportedProgram and timings in seconds (``export``, ``decompose``).
    transformers models may return their cache objects (``DynamicCache``): their pytree
    registration (transformers' own export utilities) is made before exporting.
    Raises TypeError (not a module), ValueError (a sparse or otherwise non-strided input,
    an unsupported dtype) and CaptureError when torch.export fails, with one line saying
    why: example inputs the model rejects in eager PyTorch too (shapes, positions beyond
    the model's), an output type export cannot flatten, data-dependent control flow
    (then suggesting ``torch.compile(model, backend="opencann")``, which splits the
    model at graph breaks), a write through an ``expand`` view that repeats elements.
    Writes through ``unfold`` views are respelled before decomposition so that the
    elements no window covers keep their values (`opencann.frontend.torch.view_writes`)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"opencann.compile expects a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(args, tuple):
        args = (args,)
    for i, a in enumerate(t for t in torch.utils._pytree.tree_leaves((args, kwargs or {}))
                          if isinstance(t, torch.Tensor)):
        check_layout(a, f"tensor input {i}")
        DataType.from_torch(a.dtype)  # clear error for unsupported dtypes
    args, kwargs = _distinct_inputs(args, kwargs)
    with _serialized_export():
        _register_transformers_caches(model)   # process-wide pytree registry: under the lock
        return _capture(model, args, kwargs, dynamic_shapes)


def _distinct_inputs(args: Tuple[Any, ...], kwargs: Dict[str, Any] | None):
    """``(args, kwargs)`` with every repeat of one tensor object (``compile(m, (x, x))``)
    replaced by a copy: torch.export traces a tensor passed twice as one input, so the
    graph would read the first argument's values for both at every later call."""
    seen: set = set()

    def fresh(t):
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) in seen:
            return t.clone()
        seen.add(id(t))
        return t
    args, kwargs = torch.utils._pytree.tree_map(fresh, (args, kwargs or {}))
    return args, kwargs


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


def _capture(model, args, kwargs, dynamic_shapes=None):
    t0 = time.perf_counter()
    try:
        with torch.no_grad(), warnings.catch_warnings(), _quiet_torch_logs():
            # torch-internal deprecation noise from export's own pytree use
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            queries = LayoutQueries()   # the model's own layout queries on its inputs
            with queries:
                ep = torch.export.export(model, args, kwargs or {}, strict=False,
                                         dynamic_shapes=dynamic_shapes)
            read = queries.user_inputs(ep)
            rewrite_written_unfolds(ep.graph_module)   # keep what no window covers
            where = written_expand(ep.graph_module)
            if where:
                raise CaptureError(
                    f"the model writes through an expanded view (expand/broadcast_to at {where}) "
                    "that repeats elements; a compiled graph would add up every copy's change. "
                    "Fix: write into the tensor before expanding it, or use "
                    "torch.compile(model, backend='opencann'), which runs that graph eagerly")
            t1 = time.perf_counter()
            # decomposing re-traces the program: it fails too (an input's metadata
            # changed in place: AOTAutograd's mutation-count assertion)
            # the user outputs' strides before decomposition are eager's: functionalizing
            # can re-derive a value with others (see convert._record_eager_strides)
            eager = _user_output_strides(ep)
            ep = ep.run_decompositions(decomposition_table())
            out = next(n for n in ep.graph.nodes if n.op == "output")
            out.meta["eager_strides"], out.meta["layout_queries"] = eager, read
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with advice
        raise CaptureError(_explain(model, args, kwargs or {}, e, declared_ranges(dynamic_shapes))) from None
    t2 = time.perf_counter()
    return ep, {"export": t1 - t0, "decompose": t2 - t1}


def check_layout(t: torch.Tensor, what: str) -> None:
    """ValueError unless ``t`` is a dense (strided) tensor: graphs compute on dense
    tensors, and sparse/nested layouts reach kernels that reject them."""
    if t.layout != torch.strided or getattr(t, "is_nested", False):
        kind = "nested" if getattr(t, "is_nested", False) else str(t.layout).replace("torch.", "")
        raise ValueError(f"{what} is a {kind} tensor; opencann compiles dense tensors: pass "
                         "x.to_dense() (the compiled graph computes on dense tensors)")


def _register_transformers_caches(model: torch.nn.Module) -> None:
    """Make transformers' cache objects (``DynamicCache`` returned by decoders with their
    default ``use_cache=True``) pytree nodes, with transformers' own registration
    (``transformers.exporters.exporter_dynamo``); nothing for other models."""
    if not type(model).__module__.startswith("transformers."):
        return
    try:
        from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model
    except ImportError:  # older transformers: the error says to pass use_cache=False
        return
    register_cache_pytrees_for_model(model)


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """Hold back what torch writes while export probes a failing model (logged meta-kernel
    tracebacks, the partial FX graph it prints to stderr): the error is re-raised as one
    line. Output of a successful export is passed on; everything is kept when the user
    asked for torch's logs with TORCH_LOGS."""
    if os.environ.get("TORCH_LOGS"):
        yield
        return
    loggers = [logging.getLogger(n) for n in ("torch._subclasses.fake_tensor",
                                              "torch.fx.experimental.symbolic_shapes")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    except BaseException:  # the caller reports the failure in one line
        raise
    else:
        sys.stderr.write(held.getvalue())
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def _describe_inputs(model: torch.nn.Module, args, kwargs) -> List[Tuple[str, Any]]:
    """(name, value) of each argument, named after ``model.forward``'s parameters."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
        pairs = []
        for k, v in bound.arguments.items():
            kind = bound.signature.parameters[k].kind
            if kind == inspect.Parameter.VAR_KEYWORD:
                pairs += list(v.items())
            elif kind == inspect.Parameter.VAR_POSITIONAL:
                pairs += [(f"{k}[{i}]", x) for i, x in enumerate(v)]
            else:
                pairs.append((k, v))
        return pairs
    except (TypeError, ValueError):
        return [(f"input {i}", a) for i, a in enumerate(args)] + list(kwargs.items())


def _shape(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def _positions_hint(model: torch.nn.Module, inputs: List[Tuple[str, Any]]) -> str:
    """'; input_ids has 2000 positions, more than ...' when an integer input is longer
    than the model's position table (transformers ``config``), else ''."""
    cfg = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        limit = getattr(cfg, key, None)
        if isinstance(limit, int):
            break
    else:
        return ""
    for name, v in inputs:
        if (isinstance(v, torch.Tensor) and v.dim() >= 2 and not v.dtype.is_floating_point
                and v.shape[-1] > limit):
            return (f"; {name} has {v.shape[-1]} positions but the model has {limit} "
                    f"(config.{key}): use sequences of at most {limit}")
    return ""


_DATA_DEPENDENT = re.compile(r"data-dependent|GuardOnDataDependent|unbacked|Dynamic control flow",
                             re.IGNORECASE)


def _eager_error(model: torch.nn.Module, args, kwargs) -> BaseException | None:
    """The exception ``model`` raises in eager PyTorch on (copies of) these inputs, or
    None when it runs, or when the inputs are fake (``estimate``: nothing to run)."""
    from torch._subclasses.fake_tensor import is_fake
    leaves = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if any(is_fake(t) for t in leaves):
        return None
    copies = torch.utils._pytree.tree_map(
        lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (args, kwargs))
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(*copies[0], **copies[1])
    except Exception as e:  # noqa: BLE001 - reported as the cause
        return e
    return None


def _inputs_changed_in_place(model: torch.nn.Module, args, kwargs,
                             inputs: List[Tuple[str, Any]]) -> str | None:
    """The name of the first tensor input whose shape, strides or storage offset ``model``
    changes in place (``x.t_()``, ``x.unsqueeze_(0)``, ``x.resize_(...)``), found by
    running it eagerly on clones; None when none does, the inputs are fake or it fails."""
    from torch._subclasses.fake_tensor import is_fake
    tree = torch.utils._pytree
    leaves = tree.tree_leaves((args, kwargs))
    if any(isinstance(t, torch.Tensor) and is_fake(t) for t in leaves):
        return None
    copies = tree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (args, kwargs))

    def meta(tree_):
        return [(t.shape, t.stride(), t.storage_offset()) if isinstance(t, torch.Tensor) else None
                for t in tree.tree_leaves(tree_)]
    before = meta(copies)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(*copies[0], **copies[1])
    except Exception:  # noqa: BLE001 - no verdict
        return None
    for leaf, b, a in zip(leaves, before, meta(copies)):
        if a != b:
            return next((n for n, v in inputs if any(x is leaf for x in tree.tree_leaves(v))),
                        "x")
    return None


def _explain(model: torch.nn.Module, args, kwargs, e: BaseException,
             ranges: Optional[Dict[str, Tuple[int, Optional[int]]]] = None) -> str:
    """One line: why torch.export failed on ``model`` and what to change (``ranges``: the
    dynamic dims' declared ranges, see `declared_ranges`)."""
    name = type(model).__name__
    msg = str(e)
    violation = constraint_violation(msg, ranges)
    if violation:
        return violation
    inputs = _describe_inputs(model, args, kwargs)
    shown = ", ".join(f"{k} {_shape(v)}" for k, v in inputs if isinstance(v, torch.Tensor))
    if "not a known type" in msg or "register a pytree" in msg:
        m = re.search(r"<class '([^']+)'>", msg)
        cls = m.group(1).rsplit(".", 1)[-1] if m else "an object"
        cache = "Cache" in cls
        return (f"{name} returns or takes a {cls}, which torch.export cannot flatten into "
                "tensors; fix: " + ("call the model with use_cache=False (example_kwargs="
                                    "{'use_cache': False}), or update transformers (its "
                                    "export utilities register cache objects)" if cache else
                                    "return tensors, tuples, lists, dicts or dataclasses of "
                                    "tensors (or register the class with torch.utils._pytree)"))
    if "`dynamic_shapes" in msg:   # torch.export's own check of a spec opencann passed on
        return (f"torch.export rejects the dynamic_shapes given for {name}: "
                f"{_first_line(e)[:200]}; fix: give each input an entry of its own structure "
                "(a tensor: {0: 'batch'}; a dict, list or tuple: the same structure of "
                "entries; a pytree class: a list over its flattened values; None: static)")
    eager = _eager_error(model, args, kwargs)
    changed = _inputs_changed_in_place(model, args, kwargs, inputs) if eager is None else None
    if changed:
        return (f"{name} changes the shape/strides of its input {changed} in place (e.g. "
                f"{changed}.t_(), {changed}.unsqueeze_(0)); opencann compiles value mutations "
                f"only: use {changed} = {changed}.t() (the out-of-place op) instead, or "
                "torch.compile(model, backend='opencann')")
    if eager is not None:  # inputs the model rejects in eager too: not a capture problem
        return (f"{name} fails on these example inputs ({shown or 'no tensors'}) in eager "
                f"PyTorch too: {_first_line(eager)}{_positions_hint(model, inputs)}; fix: give "
                "example inputs of the shapes and value ranges the model accepts")
    if _DATA_DEPENDENT.search(type(e).__name__ + " " + msg):
        m = re.search(r'raised this error:\s*File "([^"]+)", line (\d+)', msg)
        at = f" at {os.path.basename(m.group(1))}:{m.group(2)}" if m else ""
        return (f"torch.export could not capture {name}: Python control flow depends on tensor "
                f"values{at} (an if/while on a tensor, .item(), .tolist()); fix: compute both "
                "branches and pick with torch.where, or use torch.compile(model, "
                "backend='opencann'), which compiles each graph between breaks")
    return (f"torch.export could not capture {name}: {_first_line(e)[:200]}; fix: use "
            "torch.compile(model, backend='opencann'), which compiles each graph between breaks")



def _user_output_strides(ep: torch.export.ExportedProgram) -> list:
    """Strides of each user output of ``ep`` as its FX values give them (None for a
    non-tensor output), in user-output order."""
    from torch.export.graph_signature import OutputKind
    out = next(n for n in ep.graph.nodes if n.op == "output")
    res = []
    for a, spec in zip(out.args[0], ep.graph_signature.output_specs):
        if spec.kind != OutputKind.USER_OUTPUT:
            continue
        val = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        res.append(tuple(int(x) for x in val.stride()) if isinstance(val, torch.Tensor)
                   and all(isinstance(x, int) for x in val.stride()) else None)
    return res
