"""Writes through views whose functionalization inverse is not a scatter: ``unfold``
(made right here) and ``expand`` (refused here).

Functionalization (torch.export's decomposition, AOTAutograd under torch.compile) turns a
write through a view into a write of the whole base: ``base = inverse(base, new_view)``.
For ``unfold`` torch's inverse is ``unfold_backward`` (the autograd formula: zeros, then
the windows summed in), not a scatter into the base: every element no window covers
(``x.unfold(1, 2, 3)``: the gaps; a tail shorter than a window) becomes 0 and a -0.0
inside a window becomes +0.0, where eager leaves them alone (pytorch/pytorch#198102).

`rewrite_written_unfolds` replaces, before functionalization, each ``unfold`` that is
written through (an in-place op or ``out=`` on it or on a view of it) by `unfold_as_views`:
the same view (values, shape, strides, storage offset) spelled with views whose inverses
are scatters into the base (narrow → slice_scatter, unflatten, movedim), or, where the
windows do not tile a prefix of the dim (``x.unfold(0, 2, 3)`` on 5 elements: no views
but ``as_strided`` give strides (3, 1) there) or its length is symbolic, ``as_strided`` on
the root of the view chain (inverse: ``as_strided_scatter``). Overlapping windows (``size > step``) are left alone:
torch refuses writes through them with its own error ("functionalization encountered a
tensor being mutated that has internal overlap").

``expand`` is inverted by summing the copies' changes (``base + sum_to(new_view - view)``):
a write that eager allows through a view that repeats elements
(``x[:, :1].expand(4, 3).fill_(2)``, ``zero_``, ``masked_fill_``) adds each copy's change,
so 2.0 becomes ``4 * 2 - 3 * x``; even without repeats ``x + (new - x)`` turns an inf into
NaN and -0.0 into +0.0. A written expand that repeats nothing (new size-1 dims only) is
respelled as ``view`` (`expand_as_view`); no view spells a repeat with a scatter inverse,
so `written_expand` finds those writes for the callers to refuse (``opencann.compile``) or
run eagerly (torch.compile).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

_ATEN_UNFOLD = torch.ops.aten.unfold.default
_EXPANDS = (torch.ops.aten.expand.default, torch.ops.aten.expand_as.default,
            torch.ops.aten.broadcast_to.default, torch.Tensor.expand, torch.Tensor.expand_as,
            torch.broadcast_to, torch.Tensor.broadcast_to)
_EXPAND_METHODS = ("expand", "expand_as", "broadcast_to")
# torch-level (dynamo) view functions/methods through which a write reaches the unfold
_VIEW_METHODS = {"view", "view_as", "reshape", "reshape_as", "select", "narrow", "t", "transpose",
                 "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "unflatten", "flatten",
                 "squeeze", "unsqueeze", "expand", "expand_as", "diagonal", "unfold", "as_strided",
                 "unbind", "split", "chunk", "tensor_split", "real", "imag", "view_as_real",
                 "detach", "__getitem__", "contiguous", "mT", "T", "H", "mH"}


def unfold_as_views(x: torch.Tensor, dimension: int, size: int, step: int) -> torch.Tensor:
    """``x.unfold(dimension, size, step)`` (same values, shape, strides and storage offset)
    as views whose functionalization inverses write into ``x``: for ``size <= step``,
    ``narrow → unflatten → narrow → movedim`` when the windows tile a prefix of the dim
    (``n * step <= length``, or one window), else ``as_strided`` on the root of ``x``'s view
    chain (the only place functionalization accepts it); ``x.unfold`` itself for
    overlapping windows, a 0-d ``x`` or ``size == 0``. Raises what ``x.unfold`` raises."""
    if x.dim() == 0 or not (0 < size <= step):
        return x.unfold(dimension, size, step)
    d = dimension % x.dim()
    length = x.shape[d]
    if not isinstance(length, int) or length < size:
        if isinstance(length, int):
            return x.unfold(dimension, size, step)   # torch's own error
        return _as_strided_unfold(x, d, size, step)
    n = (length - size) // step + 1
    period = size if n == 1 else step
    if n * period > length:
        return _as_strided_unfold(x, d, size, step)
    y = x.narrow(d, 0, n * period).unflatten(d, (n, period)).narrow(d + 1, 0, size)
    return y.movedim(d + 1, -1)


def _as_strided_unfold(x: torch.Tensor, d: int, size: int, step: int) -> torch.Tensor:
    n = (x.shape[d] - size) // step + 1
    shape = list(x.shape)
    shape[d] = n
    stride = list(x.stride())
    stride[d] = x.stride(d) * step
    # on the root of x's view chain: functionalization replays as_strided only there
    root = x if x._base is None else x._base
    return root.as_strided(shape + [size], stride + [x.stride(d)], x.storage_offset())


def _is_unfold(n: fx.Node) -> bool:
    return ((n.op == "call_function" and n.target in (_ATEN_UNFOLD, torch.Tensor.unfold))
            or (n.op == "call_method" and n.target == "unfold"))


def _view_of(user: fx.Node, src: fx.Node) -> bool:
    """Whether ``user``'s result may alias ``src`` (a view of it, or a tuple of views)."""
    if user.op == "call_method":
        return user.target in _VIEW_METHODS and user.args[:1] == (src,)
    if user.op != "call_function":
        return False
    t = user.target
    if t is operator.getitem or t is unfold_as_views:
        return user.args[0] is src
    if t is expand_as_view:
        return user.args[1] is src
    if isinstance(t, torch._ops.OpOverload):
        rets = t._schema.returns
        return any(r.alias_info is not None and not r.alias_info.is_write for r in rets) \
            and user.args[:1] == (src,)
    name = getattr(t, "__name__", "")
    return name in _VIEW_METHODS and user.args[:1] == (src,)


def _writes(user: fx.Node, src: fx.Node) -> bool:
    """Whether ``user`` writes into ``src`` (an in-place op, ``out=``, ``x[i] = v``)."""
    out = user.kwargs.get("out")
    if out is src or (isinstance(out, (tuple, list)) and any(o is src for o in out)):
        return True
    if user.op == "call_method":
        name = user.target
        return user.args[:1] == (src,) and name.endswith("_") and not name.startswith("_")
    if user.op != "call_function":
        return False
    t = user.target
    if t is operator.setitem:
        return user.args[0] is src
    if isinstance(t, torch._ops.OpOverload):
        args = t._schema.arguments
        return any(a.alias_info is not None and a.alias_info.is_write and i < len(user.args)
                   and user.args[i] is src for i, a in enumerate(args))
    name = getattr(t, "__name__", "")
    return user.args[:1] == (src,) and name.endswith("_") and not name.startswith("_")


def _written_through(node: fx.Node) -> bool:
    todo, seen = [node], set()
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        for u in v.users:
            if _writes(u, v):
                return True
            if _view_of(u, v):
                todo.append(u)
    return False


def expand_as_view(expand, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``expand(x, *args, **kwargs)`` (``Tensor.expand``, ``expand_as``, ``broadcast_to``)
    spelled as ``x.view`` of its shape, for an expand that repeats no element (its inverse
    is then ``view``, not a sum)."""
    return x.view(expand(x, *args, **kwargs).shape)


def _is_expand(n: fx.Node) -> bool:
    return (n.op == "call_function" and n.target in _EXPANDS) or \
        (n.op == "call_method" and n.target in _EXPAND_METHODS)


def rewrite_written_unfolds(gm: fx.GraphModule) -> int:
    """Replace each ``unfold`` in ``gm`` (an ATen graph before functionalization, or a
    dynamo graph) that is written through by a call of `unfold_as_views` with the same
    arguments, and each written-through expand that repeats no element by
    `expand_as_view`; recompiles ``gm`` when one changed. Returns how many were replaced."""
    hits = 0
    for n in list(gm.graph.nodes):
        if _is_unfold(n) and _written_through(n):
            n.op, n.target = "call_function", unfold_as_views
            hits += 1
        elif _is_expand(n) and not _repeats(n) and _written_through(n):
            fn = getattr(torch.Tensor, n.target) if n.op == "call_method" else n.target
            n.op, n.target, n.args = "call_function", expand_as_view, (fn,) + tuple(n.args)
            hits += 1
    if hits:
        gm.recompile()
    return hits


def _val(n) -> object:
    return n.meta.get("val", n.meta.get("example_value")) if isinstance(n, fx.Node) else None


def _repeats(n: fx.Node) -> bool:
    """Whether expand node ``n`` repeats elements (unknown sizes: assumed to)."""
    out, src = _val(n), _val(n.args[0] if n.args else None)
    if not isinstance(out, torch.Tensor) or not isinstance(src, torch.Tensor):
        return True
    return str(out.numel()) != str(src.numel())


def written_expand(gm: fx.GraphModule) -> str | None:
    """Where (``file:line`` of the model's code, or the node's name) ``gm`` writes through an
    ``expand`` (``expand_as``, ``broadcast_to``) view that repeats elements; None if it does
    not. Functionalization would add up the copies' changes (module docstring)."""
    from .convert import source_of
    for n in gm.graph.nodes:
        if _is_expand(n) and _repeats(n) and _written_through(n):
            return source_of(n)[0] or n.name
    return None
