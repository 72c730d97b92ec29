"""Torch custom ops captured as opencann graph ops (``OpDef.custom_op``), including the
ones that write their arguments in place.

A custom op such as ``torch.ops.opencann.decode_attention`` (`opencann.ops.llm_torch`)
reaches the exported program as a call of its overload: it becomes one node of the op
whose ``custom_op`` names it, its schema arguments renamed by ``custom_op_args``.

A custom op that writes an argument (``mutates_args``, e.g. ``opencann::kv_cache_update``
writing the KV cache) reaches it functionalized: torch.export's decomposition wraps it in
the higher-order op ``auto_functionalized_v2(op, **args, _<arg>_base_index=i,
_all_bases=[...])`` (``auto_functionalized(op, **args)`` in the older scheme), whose value
is (the op's result, *the new value of each written base) (torch
``torch/_higher_order_ops/auto_functionalize.py``). It becomes one node of the op, whose
OpDef says which output is written into which input in place (``inplace_of``); each new
base value is that output, so later readers read the updated tensor (a write into a view
of a larger tensor, ``cache[0]``, is refused: pass the tensor itself). An in-place op
captured without functionalization (the op itself, as dynamo may hand it over) becomes
the same node, and later uses of the written FX value read its output.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.fx as fx

from ...ir import Graph, Value
from ...ops import OpDef, lookup_custom_op
from .. import errors

AUTO_FUNCTIONALIZED = tuple(getattr(torch.ops.higher_order, n) for n in
                            ("auto_functionalized", "auto_functionalized_v2")
                            if hasattr(torch.ops.higher_order, n))


class CallNode:
    """An FX node seen as the plain call ``target(**kwargs)`` with value ``val`` (what
    `convert_node` converts): name, meta and source of ``node``. For an in-place op,
    ``val`` holds the written arguments' new values (its IR outputs)."""

    def __init__(self, node: fx.Node, target, kwargs: Dict[str, Any], val: Any):
        self.name, self.target, self.args, self.kwargs = node.name, target, (), kwargs
        self.meta = dict(node.meta, val=val)


def captured_op(target) -> Optional[OpDef]:
    """The OpDef capturing the custom op overload ``target`` (`lookup_custom_op`), or None."""
    return lookup_custom_op(target) if isinstance(target, torch._ops.OpOverload) else None


def rename_args(opdef: OpDef, attrs: Dict[str, Any]) -> Dict[str, Any]:
    """``attrs`` (schema argument name -> value) under ``opdef``'s attribute names
    (``custom_op_args``)."""
    ren = opdef.custom_op_args
    return {ren.get(k, k): v for k, v in attrs.items()} if ren else attrs


def _written_args(op: torch._ops.OpOverload) -> List[str]:
    return [a.name for a in op._schema.arguments
            if a.alias_info is not None and a.alias_info.is_write]


def _refuse(node: fx.Node, op, why: str) -> errors.ConversionError:
    return errors.ConversionError(f"{node.name}: the custom op {op} {why}", kind="unsupported_op")


def convert_auto_functionalized(graph: Graph, node: fx.Node, env: Dict[fx.Node, Any], convert) -> None:
    """Convert ``auto_functionalized[_v2](op, ...)`` (module docstring) with ``convert``
    (`opencann.frontend.torch.convert.convert_node`) applied to the plain call; records
    (None for the op's result, *the new bases) in ``env``. Raises ConversionError (one
    line) for an op no OpDef captures in place, an op with results, or a write into a
    view of a larger tensor."""
    op = node.args[0]
    opdef = captured_op(op)
    written = _written_args(op)
    if opdef is None or sorted(opdef.inplace_of.values()) != sorted(written):
        raise _refuse(node, op, f"writes its argument(s) {written} in place and no opencann op "
                      "captures it (OpDef.custom_op with inplace_of naming them); fix: register "
                      "one, or use torch.compile(model, backend='opencann'), which runs it eagerly")
    if op._schema.returns:
        raise _refuse(node, op, "writes in place and also returns a result; opencann captures "
                      "in-place custom ops that return nothing (-> None)")
    kwargs = dict(node.kwargs)
    vals = list(node.meta.get("val") or ())
    if "_all_bases" in kwargs:   # v2: the written arguments are (views of) these bases
        from torch._higher_order_ops.auto_functionalize import (AliasViewInfo, NotView,
                                                               read_view_information_from_args)
        bases = kwargs.pop("_all_bases")
        types = [a.type for a in op._schema.arguments if a.name in written]
        infos = read_view_information_from_args(written, types, kwargs, bases)
        base_of = {}
        for name in written:
            info = infos[name]
            if not isinstance(info, (NotView, AliasViewInfo)):
                raise _refuse(node, op, f"writes into a view of a larger tensor (argument "
                              f"{name!r}: a slice, index or as_strided of {bases[info.base_index]}); "
                              "fix: pass the whole tensor (one cache tensor per layer)")
            kwargs[name] = bases[info.base_index]
            base_of[name] = info.base_index
        n_ret = len(vals) - len(bases)
    else:                        # v1: the new values follow, in the written arguments' order
        base_of = {name: k for k, name in enumerate(written)}
        n_ret = len(vals) - len(written)
    outs = {k: vals[n_ret + base_of[name]] for k, name in opdef.inplace_of.items()}
    val = tuple(outs[k] for k in sorted(outs))
    inner = CallNode(node, op, kwargs, val if len(val) > 1 else val[0])
    convert(graph, inner, env)
    res = env.pop(inner)
    res = list(res) if isinstance(res, (list, tuple)) else [res]
    new = [None] * (len(vals) - n_ret)
    for k, name in opdef.inplace_of.items():
        new[base_of[name]] = res[sorted(outs).index(k)]
    env[node] = [None] * n_ret + new


def custom_op_writing(ep, buffer: str) -> Optional[str]:
    """The qualified name of the captured in-place custom op (``OpDef.inplace_of``) that
    writes the buffer ``buffer`` (its state-dict name) in the exported program ``ep``, or
    None when none does (functionalized: the buffer's placeholder is among the op's
    ``_all_bases`` or arguments)."""
    holder = next((s.arg.name for s in ep.graph_signature.input_specs
                   if s.target == buffer and hasattr(s.arg, "name")), None)
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.target not in AUTO_FUNCTIONALIZED:
            continue
        op = node.args[0]
        opdef = captured_op(op)
        if opdef is None or not opdef.inplace_of:
            continue
        args = list(node.kwargs.get("_all_bases") or []) + list(node.kwargs.values())
        if any(isinstance(a, fx.Node) and a.name == holder for a in args):
            return op._schema.name
    return None


def convert_inplace_call(graph: Graph, node: fx.Node, env: Dict[fx.Node, Any], convert) -> None:
    """Convert a direct call of an in-place custom op (not functionalized: module
    docstring) with ``convert`` applied to the plain call, whose outputs are the written
    arguments after the write; later readers of each written FX argument read that output
    (``env`` rebound). The call's own value (None) is recorded for ``node``."""
    op = node.target
    opdef = captured_op(op)
    given = {a.name: x for a, x in zip(op._schema.arguments, node.args)}
    given.update(node.kwargs)
    keys = sorted(opdef.inplace_of)
    vals = tuple(given[opdef.inplace_of[k]].meta.get("val") for k in keys)
    inner = CallNode(node, op, given, vals if len(vals) > 1 else vals[0])
    convert(graph, inner, env)
    res = env.pop(inner)
    res = list(res) if isinstance(res, (list, tuple)) else [res]
    for j, k in enumerate(keys):
        env[given[opdef.inplace_of[k]]] = res[j]
    env[node] = None


__all__ = ["AUTO_FUNCTIONALIZED", "CallNode", "captured_op", "convert_auto_functionalized",
           "convert_inplace_call", "custom_op_writing", "rename_args"]
