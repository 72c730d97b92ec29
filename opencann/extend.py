"""Extending opencann: user fusion rules and user ops (the public API of issue #16 item 4).

`register_fusion` takes a pattern and its replacement written as small torch functions,
traced to opencann's IR with example inputs (as Inductor's ``register_replacement`` in
``torch/_inductor/pattern_matcher.py`` traces its pattern functions); the rule becomes a
fusion pass under its name: in the compile report, the log, ``options["disable"]`` and
the fusion switch file (``opencann atc --fusion_switch_file``, section ``section``).

`register_op` makes a torch custom op (``torch.library.custom_op``) an opencann op with
its shape inference (the op's fake implementation, or ``infer``), a cost and a kernel per
device (``kernels={"cpu": f, "vnpu": g}``: the kernel the executor calls for nodes on that
device; a device without one runs the ``cpu`` kernel on the host). A replacement may call
such an op: that is how a rule introduces a custom fused kernel.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

import torch

from .ops import OpDef, OpKind, register
from .ops.opdef import Cost
from .passes.fusion.user_rule import FusionRule, register_rule, registered_rules, unregister_rule


def _trace(fn: Callable, example_inputs: Sequence[torch.Tensor], what: str):
    from torch.fx.experimental.proxy_tensor import make_fx

    from .frontend.torch import decomposition_table, from_fx_graph
    try:
        gm = make_fx(fn, decomposition_table=decomposition_table(),
                     tracing_mode="fake")(*example_inputs)
    except Exception as e:  # noqa: BLE001 - re-raised as one line
        raise ValueError(f"register_fusion: the {what} function does not trace with the example "
                         f"inputs: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    g = from_fx_graph(gm, list(example_inputs), name=what)
    if len(g.outputs) != 1:
        raise ValueError(f"register_fusion: the {what} function returns {len(g.outputs)} tensors; "
                         "return exactly one")
    return g


def register_fusion(name: str, pattern: Callable, replacement: Callable,
                    example_inputs: Sequence[torch.Tensor], section: str = "GraphFusion",
                    cann_names: Sequence[str] = ()) -> FusionRule:
    """Register the rewrite ``pattern(*xs) ⇒ replacement(*xs)`` under ``name``.

    ``pattern``, ``replacement``: torch functions of the same tensors, each returning one
    tensor; traced once with ``example_inputs`` (any shapes and dtypes the functions accept:
    a pattern input then matches any tensor; literal numbers in the pattern must match
    exactly). ``section``: "GraphFusion" or "UBFusion", where the fusion switch file
    switches it. Returns the `FusionRule`. Raises ValueError (one line) when a function
    does not trace or returns other than one tensor, an input is unused by the pattern,
    the pattern is an input alone, or ``name`` is taken (by a rule or a built-in pass).
    A replacement whose result does not have the matched shape and dtype stops a compile
    with a `GraphError` naming the rule."""
    from .passes import default_pipeline
    if section not in ("GraphFusion", "UBFusion"):
        raise ValueError(f"register_fusion: section {section!r}; use 'GraphFusion' or 'UBFusion'")
    if name in registered_rules():
        raise ValueError(f"register_fusion: {name!r} is a registered fusion rule already; call "
                         "opencann.unregister_fusion(name) first or choose another name")
    if name in default_pipeline().names():
        raise ValueError(f"register_fusion: {name!r} is taken by a pass; choose another name")
    pat = _trace(pattern, example_inputs, "pattern")
    rep = _trace(replacement, example_inputs, "replacement")
    if pat.outputs[0].producer is None:
        raise ValueError("register_fusion: the pattern returns an input unchanged; it must "
                         "compute something")
    unused = [i for i, v in enumerate(pat.inputs) if not v.users]
    if unused:
        raise ValueError(f"register_fusion: the pattern does not use input(s) {unused}; "
                         "every input must appear in the pattern")
    return register_rule(FusionRule(name, pat, rep, section, tuple(cann_names)))


def unregister_fusion(name: str) -> None:
    """Remove the fusion rule ``name``; raises KeyError naming the registered rules."""
    unregister_rule(name)


def register_op(name: str, op, kernels: Optional[Dict[str, Callable]] = None,
                infer: Optional[Callable] = None, kind: str = "elementwise",
                flops_per_elem: float = 1.0, cost: Optional[Callable] = None,
                device_cost: Optional[Dict[str, Callable]] = None, doc: str = "",
                per_index: Optional[Callable] = None) -> OpDef:
    """Make the torch custom op ``op`` (a ``torch.library.custom_op`` or its OpOverload)
    the opencann op ``name``.

    ``kernels``: device kind ("cpu", "vnpu") -> callable taking the op's arguments as its
    schema orders them and returning its result (default: the op itself on the host).
    ``infer``: shape/dtype inference, ``infer(*args) -> tensor`` on meta/fake tensors,
    registered as the op's fake implementation (omit it when the op has one already).
    ``kind``: an `OpKind` value ("elementwise", "reduction", "fused"...); ``flops_per_elem``
    or ``cost`` (``cost(node) -> Cost``: FLOPs, bytes) give its work in the report;
    ``device_cost``: device kind -> ``f(node, spec) -> (KernelCost, model name)`` (vnpu
    estimate). ``per_index``: along which dims the op is independent per index, a rule
    of ``opencann.ops.per_index`` (``per_index.ALL`` for an elementwise op); None (unknown)
    keeps ATC-style gear padding off for models using it. Returns the registered `OpDef`. Raises ValueError for a name or op
    registered already, ``kernels``/``device_cost`` not a dict or with a key that is not a
    device kind, or an unknown kind (nothing is registered then, not even ``infer``);
    TypeError when ``op`` is not a torch op."""
    overload = getattr(op, "_opoverload", op)
    if not isinstance(overload, torch._ops.OpOverload):
        raise TypeError(f"register_op: {op!r} is not a torch op; define it with "
                        "@torch.library.custom_op(\"ns::name\", mutates_args=())")
    try:
        opkind = OpKind(kind)
    except ValueError:
        raise ValueError(f"register_op: kind {kind!r}; kinds are {[k.value for k in OpKind]}") from None
    for col, v in (("kernels", kernels), ("device_cost", device_cost)):
        if v is not None and not isinstance(v, dict):
            raise ValueError(f"register_op: {col} is a {type(v).__name__}; give a dict of "
                             f"device kind -> function, e.g. {col}={{'cpu': fn}}")
    opdef = register(OpDef(name, opkind, aten=overload, flops_per_elem=flops_per_elem,
                           kernels=dict(kernels or {}), cost_fn=cost,
                           device_cost=dict(device_cost or {}), doc=doc, per_index=per_index))
    if infer is not None:   # after the checks: a refused registration leaves the op as it was
        torch.library.register_fake(overload)(infer)
    return opdef


__all__ = ["Cost", "FusionRule", "register_fusion", "register_op", "unregister_fusion"]
