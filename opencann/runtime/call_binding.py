"""Binding a call's arguments to the calling convention a model was compiled with.

A compiled graph takes its inputs in the order of the example call: the pytree spec of
``(args, kwargs)`` at compile time (`torch.utils._pytree`, the flattening torch.export
uses). Python binds arguments by name, so a caller may pass keywords in another order or
a positional parameter by keyword (``cm(x, y=y)`` for a model compiled on ``(x, y)``).
`bind_call` rearranges such a call into the compile-time form, using the names of
``forward``'s positional parameters (`forward_arg_names`, read with `inspect.signature`
as Python's own binding does); `input_labels` names each flattened input for errors.
"""
from __future__ import annotations

import collections
import inspect
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.utils._pytree as pytree


def forward_arg_names(model: Any) -> Optional[List[Optional[str]]]:
    """Names of ``model.forward``'s positional parameters in order (None for a
    positional-only one), up to ``*args``; None when it has no readable signature."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    names: List[Optional[str]] = []
    for p in params:
        if p.kind == inspect.Parameter.POSITIONAL_ONLY:
            names.append(None)
        elif p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD:
            names.append(p.name)
        else:
            break
    return names


def _compiled_form(in_spec) -> Tuple[int, List[str]]:
    want_args, want_kw = pytree.tree_unflatten([None] * in_spec.num_leaves, in_spec)
    return len(want_args), list(want_kw)


def bind_call(args: Sequence[Any], kwargs: Dict[str, Any], in_spec,
              arg_names: Optional[Sequence[Optional[str]]]) -> Tuple[tuple, Dict[str, Any]]:
    """``(args, kwargs)`` of a call arranged like the compile-time call: keywords in the
    compile-time order, a positional parameter given by keyword moved to its position, a
    compile-time keyword given positionally moved to the keywords. Raises ValueError
    (one line naming the missing, unexpected or doubly given arguments)."""
    n, keys = _compiled_form(in_spec)
    names = list(arg_names or [])
    name_at = lambda j: names[j] if j < len(names) else None  # noqa: E731
    given = list(args)
    out_args, kw = given[:n], dict(kwargs)
    missing: List[str] = []
    unexpected: List[str] = []
    twice = [k for k in kwargs if k in names[:len(given)]]
    for j in range(n, len(given)):          # extra positional: a compile-time keyword?
        nm = name_at(j)
        if nm is not None and nm in keys and nm not in kw:
            kw[nm] = given[j]
        else:
            unexpected.append(f"positional #{j}" + (f" ({nm})" if nm else ""))
    for j in range(len(given), n):          # missing positional: given by keyword?
        nm = name_at(j)
        if nm is not None and nm in kw and nm not in twice:
            out_args.append(kw.pop(nm))
        else:
            missing.append(nm or f"positional #{j}")
            out_args.append(None)
    missing += [k for k in keys if k not in kw and k not in missing]
    unexpected += [k for k in kw if k not in keys and k not in twice]
    if missing or unexpected or twice:
        what = "; ".join(s for s in (
            missing and f"lacks {', '.join(missing)}",
            unexpected and f"has unexpected {', '.join(unexpected)}",
            twice and f"gives {', '.join(twice)} twice (positionally and by keyword)") if s)
        shown = [nm or f"#{j}" for j, nm in ((j, name_at(j)) for j in range(n))]
        raise ValueError(
            f"the model was compiled for {n} positional input(s) {shown} and keyword input(s) "
            f"{keys}; this call {what}. Call it with the arguments of the example inputs, "
            "or recompile")
    return tuple(out_args), {k: kw[k] for k in keys}


def _children(spec) -> list:
    """``spec``'s child TreeSpecs (``children()`` in torch >= 2.9, ``children_specs``
    before)."""
    kids = getattr(type(spec), "children", None)
    return list(spec.children()) if callable(kids) else list(spec.children_specs)


def _child_keys(spec) -> List[str]:
    """How each child of a pytree node is reached, as text: ``[0]`` (tuples, lists and
    any other container), ``['key']`` (dicts), ``.field`` (namedtuples)."""
    t, ctx, n = spec.type, spec.context, spec.num_children
    if isinstance(t, type) and issubclass(t, dict):
        keys = ctx[1] if t is collections.defaultdict else ctx
        return [f"[{k!r}]" for k in keys]
    if isinstance(ctx, type) and hasattr(ctx, "_fields"):           # namedtuple
        return [f".{f}" for f in ctx._fields]
    return [f"[{i}]" for i in range(n)]


def leaf_paths(in_spec) -> List[Tuple[Tuple[str, ...], Tuple[type, ...]]]:
    """Per leaf of ``in_spec`` (a TreeSpec), in flattening order: (the keys reaching it,
    as `_child_keys` spells them, the types of the containers on the way). Read from the
    spec itself, so leaves of any registered container (a transformers ``DynamicCache``)
    are named without rebuilding the container."""
    out: List[Tuple[Tuple[str, ...], Tuple[type, ...]]] = []

    def walk(spec, keys, types):
        if spec.is_leaf():
            out.append((keys, types))
            return
        for k, child in zip(_child_keys(spec), _children(spec)):
            walk(child, keys + (k,), types + (spec.type,))
    walk(in_spec, (), ())
    return out


def input_labels(in_spec, arg_names: Optional[Sequence[Optional[str]]]) -> List[str]:
    """A name per flattened input of the compile-time call (``in_spec``: the TreeSpec of
    ``(args, kwargs)``), for errors: ``mask (argument #3)``, ``'xs'[1] (argument #0)``,
    ``'scale' (keyword)``, ``'past_key_values'[2] (keyword)`` (a tensor inside a
    registered container)."""
    names = list(arg_names or [])
    labels = []
    for keys, _ in leaf_paths(in_spec):
        rest = "".join(keys[2:])
        if keys[0] == "[0]":
            j = int(keys[1][1:-1])
            nm = names[j] if j < len(names) else None
            labels.append(f"'{nm}'{rest} (argument #{j})" if nm else f"argument #{j}{rest}")
        else:
            labels.append(f"{keys[1][1:-1]}{rest} (keyword)")
    return labels
