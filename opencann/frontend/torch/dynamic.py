"""Dynamic-shape specs for `opencann.compile`: the user's ``dynamic_shapes`` to
torch.export's, and the exported program's symbols to named, ranged dynamic dims.

Two forms are accepted (both keyed like torch.export's ``dynamic_shapes``: by
``forward``'s argument names, or a tuple in argument order):

* torch.export's own: ``{"x": {0: torch.export.Dim("batch", min=1, max=64)}}`` (also
  ``Dim.AUTO``/``Dim.DYNAMIC``), passed on as it is;
* a simple form: ``{"input_ids": {0: "batch", 1: "seq"}}`` where a name stands for
  one ``Dim`` shared by every input naming it, with a range from ``dim_ranges``
  (``{"seq": (16, 512)}``) or written in place (``{1: ("seq", 16, 512)}``); the
  default range is ``[1, unbounded)``.

An input that is a dict, list or tuple of tensors (a namedtuple, a dataclass registered
with torch's pytree too) takes an entry of the same structure (``{"extra": {"a": {0:
"batch"}, "b": None}}``, ``{"pair": [{0: "batch"}, None]}``), in either form, names at
any depth converted (`_one_input`). None, a dict's keys left out and inputs left out are
static at any depth (expanded into the input's structure, as torch.export needs). Every
entry is checked against its input before torch.export sees it: one that does not fit
is one line naming its place (``dynamic_shapes['extra']['a']``) and the fix.

torch.export turns each dynamic dim into a shape-environment symbol (``s43``) whose
value range (``ep.range_constraints``) is the declared range narrowed by what the model
itself requires (a position table of 512 entries bounds ``seq``). `dynamic_dims` maps
those symbols back to the user's names, ranges and the inputs they come from.
Source: PyTorch "torch.export" documentation, "Expressing Dynamism".
"""
from __future__ import annotations

import ast
import collections
import inspect
import math
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.utils._pytree as pytree

from ...ir.symbolic import linear_in

DEFAULT_MIN = 1


def _is_dim(x: Any) -> bool:
    """A torch.export ``Dim`` (or a derived dim / ``Dim.AUTO`` hint)."""
    return hasattr(x, "__name__") and hasattr(x, "min") or type(x).__name__ in ("_DimHint",
                                                                                  "_DimHintType")


def _range_of(name: str, entry: Any, ranges: Mapping[str, Tuple[int, int]]):
    """(min, max) of the simple-form dim ``name`` (``max`` None: unbounded)."""
    lo, hi = DEFAULT_MIN, None
    if isinstance(entry, tuple):
        if len(entry) != 3 or not all(isinstance(v, int) for v in entry[1:]):
            raise ValueError(f"dynamic dim {entry!r}: write a name, or (name, min, max) such as "
                             "('seq', 16, 512)")
        lo, hi = entry[1], entry[2]
    if name in ranges:
        r = ranges[name]
        if not (isinstance(r, (tuple, list)) and len(r) == 2 and isinstance(r[0], int)
                and (r[1] is None or isinstance(r[1], int))):
            raise ValueError(f"dim_ranges[{name!r}] is {r!r}; give (min, max) ints, e.g. (16, 512) "
                             "(max None: unbounded)")
        lo, hi = r
    if lo < 0 or (hi is not None and hi < lo):
        raise ValueError(f"dynamic dim {name!r} has range [{lo}, {hi}]; give 0 <= min <= max")
    if hi == lo:   # torch.export's Dim asserts min < max: one size is a static dim
        raise ValueError(f"dynamic dim {name!r} has the one size {lo} (range [{lo}, {hi}]): "
                         f"give min < max, or leave the dim static")
    return lo, hi


class _Dims:
    """One torch.export ``Dim`` per simple-form name (a name names one size everywhere)."""

    def __init__(self, ranges: Mapping[str, Tuple[int, int]]):
        self.ranges, self.dims = dict(ranges), {}
        self.free: set = set()   # names given no range (the default one)

    def get(self, entry: Any):
        if entry is None or _is_dim(entry):
            return entry
        name = entry[0] if isinstance(entry, tuple) and entry else entry
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"dynamic dim {entry!r}: name it with an identifier such as 'batch', "
                             "or give a torch.export.Dim")
        if name not in self.dims:
            if not isinstance(entry, tuple) and name not in self.ranges:
                self.free.add(name)
            lo, hi = _range_of(name, entry, self.ranges)
            self.dims[name] = torch.export.Dim(name, min=lo, max=hi) if hi is not None else \
                torch.export.Dim(name, min=lo)
        return self.dims[name]


def _key_name(key: Any, i: int) -> str:
    """torch.export's name part for a pytree key (a field, a dict key, an index)."""
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(i)


def _node(value: Any) -> Optional[Tuple[str, List[Tuple[Any, str, Any]]]]:
    """A container input as torch.export flattens it: (kind, [(key, name part, child)])
    with kind ``"dict"`` (a dict, OrderedDict or defaultdict), ``"seq"`` (a list or
    tuple), ``"named"`` (a namedtuple) or ``"node"`` (another class registered with
    torch's pytree, such as a dataclass: torch.export takes its flattened values), and
    the name part torch.export gives the child's tensors (``extra_a``, ``pair_0``); None
    for a leaf (a tensor, a number, None, an object pytree does not know)."""
    if isinstance(value, (torch.Tensor, torch.Size)):
        return None
    if type(value) in (dict, collections.OrderedDict, collections.defaultdict):
        return "dict", [(k, str(k), v) for k, v in value.items()]
    fields = getattr(type(value), "_fields", None) if isinstance(value, tuple) else None
    if fields is not None:
        return "named", [(i, str(f), v) for i, (f, v) in enumerate(zip(fields, value))]
    if isinstance(value, (list, tuple)):
        return "seq", [(i, str(i), v) for i, v in enumerate(value)]
    node = pytree.SUPPORTED_NODES.get(type(value))
    if node is None:
        return None
    if node.flatten_with_keys_fn is not None:
        pairs = node.flatten_with_keys_fn(value)[0]
        return "node", [(i, _key_name(k, i), v) for i, (k, v) in enumerate(pairs)]
    return "node", [(i, str(i), v) for i, v in enumerate(node.flatten_fn(value)[0])]


def _child_entries(spec: Any, node: Tuple[str, list]) -> Optional[List[Any]]:
    """The entries of a container input's children read from its entry ``spec``: None
    (all static), a dict (for a dict: keyed like it, keys left out static; for a
    namedtuple or a pytree class: keyed by field), a list or tuple of one entry per
    child (not for a dict). None when ``spec`` does not fit the input."""
    kind, kids = node
    if spec is None:
        return [None] * len(kids)
    if isinstance(spec, Mapping) and kind != "seq":
        keys = [k if kind == "dict" else name for k, name, _ in kids]
        if any(k not in keys for k in spec):
            return None
        return [spec.get(k) for k in keys]
    if isinstance(spec, (list, tuple)) and kind != "dict" and len(spec) == len(kids):
        return list(spec)
    return None


def _shown(spec: Any) -> str:
    """An entry as an error message names it: ``a list``, or its repr for a scalar."""
    if isinstance(spec, (Mapping, list, tuple)):
        return f"a {type(spec).__name__}"
    text = repr(spec)
    return text if len(text) <= 60 else text[:57] + "..."


def _mismatch(spec: Any, value: Any, node: Tuple[str, list], what: str) -> str:
    """One line: the entry at ``what`` does not fit the container input ``value``, and
    how to write it."""
    kind, kids = node
    keyed = isinstance(spec, Mapping) and kind != "seq"
    names = [k if kind == "dict" else n for k, n, _ in kids]
    bad = (f"has key(s) {[k for k in spec if k not in names]}" if keyed else
           f"has {len(spec)} entries" if isinstance(spec, (list, tuple)) and kind != "dict"
           else f"is {_shown(spec)}")
    first = repr(names[0]) if names else "'key'"
    if kind == "dict":
        return (f"dynamic_shapes{what} {bad}, but that input is a dict with keys {names}: key "
                f"its entry like the input, e.g. {{{first}: {{0: 'batch'}}}} (keys left out "
                "are static)")
    if kind == "seq":
        return (f"dynamic_shapes{what} {bad}, but that input is a {type(value).__name__} of "
                f"{len(kids)}: give a list with one entry per element (None: static), e.g. "
                "[{0: 'batch'}, None]")
    return (f"dynamic_shapes{what} {bad}, but that input is a {type(value).__name__} of "
            f"{len(kids)} values {names} (as torch.export flattens it): give a list with one "
            f"entry per value, or a dict keyed by those names, e.g. {{{first}: {{0: 'batch'}}}} "
            "(None: static)")


def _one_input(spec: Any, value: Any, dims: _Dims, what: str) -> Any:
    """One input's entry for torch.export, checked against the input's structure: for a
    tensor, {dim index: name/Dim} or a per-dim list (`_tensor_entry`); for a dict, list,
    tuple, namedtuple or pytree class (`_node`), the same structure of entries,
    recursively, rebuilt as torch.export matches it (a list entry for a tuple input made
    a tuple); None, or a dict's keys left out, static at any depth. ``what``: the
    entry's place (``"['extra']['a']"``) for error messages. Raises ValueError (one
    line naming the place and the fix) for an entry that does not fit its input."""
    node = _node(value)
    if node is None:
        return _leaf_entry(spec, value, dims, what)
    entries = _child_entries(spec, node)
    if entries is None:
        raise ValueError(_mismatch(spec, value, node, what))
    kind, kids = node
    out = [_one_input(e, v, dims, f"{what}[{k!r}]") for e, (k, _, v) in zip(entries, kids)]
    if kind == "dict":
        return dict(zip((k for k, _, _ in kids), out))
    if kind == "named":
        return type(value)(*out)
    return type(value)(out) if kind == "seq" else out


def _leaf_entry(spec: Any, value: Any, dims: _Dims, what: str) -> Any:
    """The entry of an input that is not a container: a tensor's (`_tensor_entry`);
    None for a number, a string or None (an int may take torch.export's Dim.AUTO /
    Dim.DYNAMIC hint); an object pytree does not know yet (a cache class registered at
    capture) keeps its entry, torch.export's own form. ValueError (one line) otherwise."""
    if spec is None:
        return None
    if isinstance(value, torch.Tensor):
        return _tensor_entry(spec, value, dims, what)
    if isinstance(value, int) and not isinstance(value, bool) and \
            type(spec).__name__ in ("_DimHint", "_DimHintType"):
        return spec
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes,
                                           torch.dtype, torch.device, torch.Size)):
        return _not_a_tensor(spec, value, what)
    return spec


def _not_a_tensor(spec: Any, value: Any, what: str):
    """Raise the one-line error for an entry given to an input that is not a tensor."""
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    raise ValueError(f"dynamic_shapes{what} is {_shown(spec)}, but that input is "
                     f"{type(value).__name__} {shown}, not a tensor: give None there (only "
                     "a tensor's dims can be dynamic)")


def _tensor_entry(spec: Any, t: torch.Tensor, dims: _Dims, what: str) -> Any:
    """A tensor input's entry: {dim index: name/Dim} (a negative index counted from the
    end of ``t``'s dims) or a list/tuple of one entry per dim, names made the shared
    Dims. ValueError (one line naming the place and the fix) for a key that is not a dim
    index of ``t``, a list of another length, or an entry of another kind (a name or a
    Dim for the whole tensor, a nested structure)."""
    name = next(iter(dim_names(spec)), "batch")
    if isinstance(spec, Mapping):
        out = {}
        for k, v in spec.items():
            if not isinstance(k, int) or isinstance(k, bool):
                raise ValueError(f"dynamic_shapes{what} has key {k!r}; key its dims by index, "
                                 "e.g. {0: 'batch', 1: 'seq'}")
            if not -t.dim() <= k < t.dim():
                raise ValueError(f"dynamic_shapes{what} names dim {k}, but that input has "
                                 f"{t.dim()} dims (shape {list(t.shape)}): index its dims "
                                 f"0..{t.dim() - 1}")
            out[k % t.dim()] = _dim_at(dims, v, what, k)
        return out
    per_dim = [name] + [None] * (t.dim() - 1)
    if isinstance(spec, (list, tuple)) and len(spec) == t.dim() and \
            not any(isinstance(v, (Mapping, list)) for v in spec):
        return type(spec)(_dim_at(dims, v, what, i) for i, v in enumerate(spec))
    shown = f"{_shown(spec)} of {len(spec)}" if isinstance(spec, (list, tuple)) else _shown(spec)
    raise ValueError(f"dynamic_shapes{what} is {shown}, but that input is a tensor of shape "
                     f"{list(t.shape)}: give its dynamic dims by index, e.g. {{0: {name!r}}}, "
                     f"or one entry per dim, e.g. {per_dim} (None: static)")


def _dim_at(dims: _Dims, entry: Any, what: str, index: Any):
    """``dims.get(entry)`` for dim ``index`` of the tensor at ``what``; its ValueError
    is prefixed with that place."""
    try:
        return dims.get(entry)
    except ValueError as e:
        raise ValueError(f"dynamic_shapes{what} dim {index}: {e}") from None


def _leaves(name: str, place: str, spec: Any, value: Any):
    """(torch.export's name, the user's place such as ``'extra'['a']``, tensor, its
    {dim index: entry}) for every tensor ``spec`` gives an entry (see `spec_leaves`)."""
    node = _node(value)
    if node is not None:
        entries = _child_entries(spec, node) or [None] * len(node[1])
        for e, (k, part, v) in zip(entries, node[1]):
            yield from _leaves(f"{name}_{part}", f"{place}[{k!r}]", e, v)
    elif isinstance(spec, (Mapping, list, tuple)):
        items = spec.items() if isinstance(spec, Mapping) else enumerate(spec)
        yield name, place, value, {i: d for i, d in items if d is not None}


def spec_leaves(name: str, spec: Any, value: Any):
    """Yield (torch.export's name for a tensor of input ``name``, that tensor, its
    {dim index: entry}) for every tensor ``spec`` gives an entry, through nested dicts,
    lists, tuples, namedtuples and pytree classes as torch.export names their tensors
    (``extra_a`` for key ``a`` of input ``extra``, ``pair_0`` for element 0 of ``pair``,
    ``p_a`` for field ``a``). Entries are as ``spec`` has them (names or Dims); None
    entries, and entries that do not fit the input, are left out."""
    for leaf, _, t, entry in _leaves(name, "", spec, value):
        yield leaf, t, entry


def spec_places(name: str, spec: Any, value: Any):
    """Yield (the place of a tensor of input ``name`` as the user writes it,
    ``'extra'['a']``, that tensor, its {dim index: entry}) for every tensor ``spec``
    gives an entry, as `spec_leaves` walks them."""
    for _, place, t, entry in _leaves(name, repr(name), spec, value):
        yield place, t, entry


def tensor_entries(value: Any, pick) -> Any:
    """The entry of input ``value`` that gives each of its tensors ``pick(tensor)`` (a
    {dim index: name} dict, or None: static), following its structure at any depth (a
    dict for a dict, a list for a list, tuple, namedtuple or pytree class); None when
    no tensor is picked (the whole input static)."""
    node = _node(value)
    if node is None:
        return pick(value) if isinstance(value, torch.Tensor) else None
    kind, kids = node
    out = [tensor_entries(v, pick) for _, _, v in kids]
    if all(e is None for e in out):
        return None
    return dict(zip((k for k, _, _ in kids), out)) if kind == "dict" else out


def dim_names(spec: Any) -> List[str]:
    """The simple-form dim names of a ``dynamic_shapes`` spec, in the order first named,
    through nested dicts, lists and tuples (a ``(name, min, max)`` entry gives its name;
    torch.export ``Dim`` objects are not names)."""
    if isinstance(spec, str):
        return [spec]
    if isinstance(spec, tuple) and len(spec) == 3 and isinstance(spec[0], str) \
            and all(isinstance(v, int) for v in spec[1:]):
        return [spec[0]]
    items = spec.values() if isinstance(spec, Mapping) else spec if isinstance(
        spec, (list, tuple)) else ()
    return list(dict.fromkeys(n for e in items for n in dim_names(e)))


def export_dynamic_shapes(model: torch.nn.Module, args: Tuple[Any, ...],
                          kwargs: Optional[Dict[str, Any]], spec: Any,
                          ranges: Optional[Mapping[str, Tuple[int, int]]] = None
                          ) -> Tuple[Any, Dict[Tuple[str, int], str], set]:
    """torch.export's ``dynamic_shapes`` for ``spec``, the user's dim names by
    (argument name, dim index) and the names given no range (default ``[1, inf)``). ``spec``: a dict keyed by ``forward``'s argument names
    or a tuple in argument order (see the module docstring); arguments it leaves out
    are static; a dict, list or tuple input takes an entry of its own structure, checked
    against the input and expanded (None: every tensor there static) to the structure
    torch.export matches (`_one_input`). Labels
    are keyed by torch.export's input names (``extra_a`` for key ``a`` of ``extra``).
    Raises ValueError naming an unknown argument, a bad key or range, or the place of an
    entry that does not match its input's structure."""
    dims = _Dims(ranges or {})
    names = _arg_names(model, args, kwargs)
    values = dict(zip(names, list(args) + [kwargs[k] for k in (kwargs or {})]))
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - set(names))
        if unknown:
            raise ValueError(f"dynamic_shapes names {unknown}, which are not arguments of "
                             f"{type(model).__name__}.forward ({', '.join(names)}); key it by "
                             "those names, e.g. {" + repr(names[0] if names else 'x') +
                             ": {0: 'batch'}}")
        by_name = {n: _one_input(spec.get(n), values[n], dims, f"[{n!r}]") for n in names}
    elif isinstance(spec, (tuple, list)):
        if len(spec) != len(names):
            raise ValueError(f"dynamic_shapes has {len(spec)} entries for {len(names)} arguments "
                             f"({', '.join(names)}); give one per argument (None: static)")
        by_name = {n: _one_input(s, values[n], dims, f"[{i}]")
                   for i, (n, s) in enumerate(zip(names, spec))}
    else:
        raise ValueError(f"dynamic_shapes must be a dict such as {{'input_ids': {{0: 'batch', 1: "
                         f"'seq'}}}} or a tuple per argument, got {type(spec).__name__}")
    leaves = [leaf for n in names for leaf in spec_leaves(n, by_name[n], values[n])]
    labels = {(leaf, i): getattr(d, "__name__", f"{leaf}.shape[{i}]")
              for leaf, _, entry in leaves for i, d in entry.items()}
    unknown = sorted(set(ranges or {}) - set(dims.dims))
    if unknown:
        raise ValueError(f"dim_ranges names {unknown}, which dynamic_shapes does not declare "
                         f"(declared: {sorted(dims.dims)}): name the dims as dynamic_shapes does")
    _check_example_sizes({leaf: t for leaf, t, _ in leaves}, labels, dims.dims)
    fixed, star = _varargs(model)
    n_pos = len(args)
    if star is not None and n_pos > fixed:   # forward(self, x, *rest): torch.export takes
        pos = names[:n_pos]                  # the extra arguments as one tuple, ``rest``'s
        grouped = [by_name[n] for n in pos[:fixed]] + [tuple(by_name[n] for n in pos[fixed:])]
        place = {n: f"{star}_{k}" for k, n in enumerate(pos[fixed:])}   # export's input names
        labels = {(place.get(n, n), i): v for (n, i), v in labels.items()}
        if kwargs:
            out = dict(zip(pos[:fixed] + [star], grouped))
            out.update({n: by_name[n] for n in names[n_pos:]})
            return out, labels, dims.free
        return tuple(grouped), labels, dims.free
    if kwargs:   # keyed by name, as torch.export takes it with keyword inputs
        return {n: by_name[n] for n in names}, labels, dims.free
    return tuple(by_name[n] for n in names), labels, dims.free


def _check_example_sizes(by_name: Mapping[str, Any], labels: Mapping[Tuple[str, int], str],
                         declared: Optional[Mapping[str, Any]] = None) -> None:
    """Raise ValueError (one line) when a dim declared dynamic has size 0 or 1 in the
    example (torch.export specialises those sizes to constants, "0/1 specialization" in
    torch.export's docs, so the dim cannot be captured dynamic from that example), or a
    size outside the range ``declared`` (name -> torch.export Dim) gives it. ``by_name``:
    the tensors by torch.export's input names (`spec_leaves`)."""
    for (n, i), label in labels.items():
        t = by_name.get(n)
        d = (declared or {}).get(label)
        if isinstance(t, torch.Tensor) and isinstance(i, int) and i < t.dim() and d is not None:
            lo, hi = int(d.min), getattr(d, "max", None)
            hi = int(hi) if isinstance(hi, int) and hi < 2 ** 62 else None
            if t.shape[i] < lo or (hi is not None and t.shape[i] > hi):
                raise ValueError(
                    f"input {n!r} dim {i} ({label}) is {t.shape[i]} in the example, outside its "
                    f"range [{lo}, {hi if hi is not None else 'inf'}]: give an example inside the "
                    f"range, or a range that holds {t.shape[i]}")
        if isinstance(t, torch.Tensor) and isinstance(i, int) and i < t.dim() and t.shape[i] < 2:
            raise ValueError(
                f"input {n!r} dim {i} ({label}) is {t.shape[i]} in the example, and torch.export "
                f"specialises a size of 0 or 1 to a constant, so that dim cannot be dynamic: give "
                f"an example whose {label} is at least 2 (calls with {label} = 1 are still served "
                "when its range includes 1)")


def _varargs(model: torch.nn.Module) -> Tuple[int, Optional[str]]:
    """(the number of ``forward``'s positional parameters before ``*args``, the name of
    ``*args`` or None)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return 0, None
    fixed = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    star = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), None)
    return fixed, star


def _arg_names(model: torch.nn.Module, args, kwargs) -> List[str]:
    """The names of the arguments passed: ``forward``'s parameters bound to ``args``,
    then the keywords."""
    try:
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        pos = [p.name for p in params[:len(args)]]
    except (TypeError, ValueError):
        pos = []
    if len(pos) < len(args):
        pos += [f"arg{i}" for i in range(len(pos), len(args))]
    return pos + list(kwargs or {})


def dynamic_dims(ep: torch.export.ExportedProgram, labels: Mapping[Tuple[str, int], str]
                 ) -> Dict[str, Dict[str, Any]]:
    """symbol -> {"name", "min", "max" (None: unbounded), "sources" (``input.shape[i]``
    where it appears)} for every symbol of the exported program's user inputs. Names
    come from ``labels`` ((argument, dim) -> name), else the first source."""
    from torch.export.graph_signature import InputKind
    user = {s.arg.name for s in ep.graph_signature.input_specs
            if s.kind == InputKind.USER_INPUT and hasattr(s.arg, "name")}
    out: Dict[str, Dict[str, Any]] = {}
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        if node.op != "placeholder" or node.name not in user or not isinstance(val, torch.Tensor):
            continue
        for i, d in enumerate(val.shape):
            if not isinstance(d, torch.SymInt):
                continue
            expr = d.node.expr
            # a derived dim (torch.export's 2 * Dim("_seq")): its root symbol, which the
            # size determines (`ShapeBinder`), named after the dim it derives
            roots = [expr] if expr.is_Symbol else [
                f for f in expr.free_symbols if linear_in(str(expr), str(f)) is not None]
            for root in roots:
                e = out.setdefault(str(root), {"name": None, "sources": [], **_vr(ep, root)})
                e["sources"].append(f"{node.name}.shape[{i}]" + ("" if root is expr else f" = {expr}"))
                e["name"] = e["name"] or _root_name(labels.get((node.name, i)), root is expr)
    for sym, e in out.items():
        e["name"] = e["name"] or e["sources"][0]
    return out


def _root_name(label: Optional[str], plain: bool) -> Optional[str]:
    """The user's name of a dim's symbol: ``label`` for a plain dim; for a derived one
    (label ``2*_seq``, a derived torch.export Dim's name) the root's (``_seq``)."""
    if plain or label is None:
        return label
    names = set(re.findall(r"[A-Za-z_]\w*", label))
    return names.pop() if len(names) == 1 else label


def _vr(ep, expr) -> Dict[str, Optional[int]]:
    r = ep.range_constraints.get(expr)
    if r is None:
        return {"min": DEFAULT_MIN, "max": None}
    hi = r.upper
    return {"min": int(r.lower), "max": int(hi) if getattr(hi, "is_finite", True) and
            str(hi) not in ("oo", "int_oo") else None}


_VIOLATION = re.compile(r"Not all values of (\w+) = .*? satisfy the generated guard (.*)")
_SPECIALIZED = re.compile(r"You marked (\w+) as dynamic but your code specialized it to be a "
                          r"constant \((\d+)\)")
_SIZE = re.compile(r"L\['[^']+'\]\.size\(\)\[\d+\]")


#: names torch's guard strings may call (sympy's printing of its size functions)
_GUARD_NAMESPACE = {"__builtins__": {}, "Max": max, "Min": min, "Abs": abs,
                    "Mod": lambda a, b: a % b, "FloorDiv": lambda a, b: a // b,
                    "floor": math.floor, "ceiling": math.ceil, "Eq": lambda a, b: a == b,
                    "Ne": lambda a, b: a != b, "True": True, "False": False}
#: how many sizes above a dim's minimum a guard is evaluated at
_GUARD_WINDOW = 4096


def _failing(guard: str, name: str, lo: int, hi: Optional[int]) -> Optional[List[int]]:
    """The sizes of dim ``name`` in [lo, hi] (at most `_GUARD_WINDOW` of them) at which
    ``guard`` (a Python expression over ``name``) is false; None when it cannot be
    evaluated (another dim in it, a function not in `_GUARD_NAMESPACE`)."""
    top = lo + _GUARD_WINDOW if hi is None else min(hi, lo + _GUARD_WINDOW)
    try:
        code = compile(guard, "<guard>", "eval")
        return [v for v in range(lo, top + 1) if not eval(code, _GUARD_NAMESPACE, {name: v})]
    except Exception:  # noqa: BLE001 - an expression this evaluator does not know
        return None


def _fixed_range(failing: List[int], lo: int, hi: Optional[int]) -> Optional[Tuple[int, Optional[int]]]:
    """The widest run of sizes in [lo, hi] without a failing one (its top open when it
    reaches the end of the evaluated window), or None when passing sizes are scattered
    (more than 4 runs: a parity or divisibility guard, which no range fixes)."""
    top = lo + _GUARD_WINDOW if hi is None else min(hi, lo + _GUARD_WINDOW)
    edges = [lo - 1] + sorted(set(failing)) + [top + 1]
    runs = [(a + 1, b - 1) for a, b in zip(edges, edges[1:]) if b - a > 1]
    if not runs or len(runs) > 4:
        return None
    start, end = max(runs, key=lambda r: (r[1] - r[0], r[0]))
    return start, (hi if end == top else end)


def _weigh_guards(found, ranges) -> Tuple[List[str], Dict[str, tuple], List[str]]:
    """For `constraint_violation`: (each guard that fails somewhere in its dim's range,
    with the sizes that break it; the widest range per dim where all hold; the dims no
    range fixes)."""
    needs, fixes, unfixable = [], {}, []
    for name, guard in found:
        guard = _SIZE.sub(name, guard.strip()).rstrip(".").strip()
        lo, hi = ranges.get(name, (DEFAULT_MIN, None))
        failing = _failing(guard, name, lo, hi)
        if failing is None:   # not evaluable: the guard as torch states it, bounds by pattern
            needs.append(guard.replace(" and ", ", "))
            lo_m = re.search(rf"(\d+) <= {name}\b", guard)
            hi_m = re.search(rf"\b{name} <= (\d+)", guard)
            if lo_m or hi_m:
                fixes[name] = (int(lo_m.group(1)) if lo_m else lo, int(hi_m.group(1)) if hi_m else hi)
            continue
        if not failing:
            continue          # true for every size in the range
        shown = ", ".join(map(str, failing[:4])) + (", ..." if len(failing) > 4 else "")
        needs.append(f"{guard} (false at {name} = {shown})")
        fixed = _fixed_range(failing, lo, hi)
        if fixed is None:
            unfixable.append(name)
            continue
        old = fixes.get(name, (lo, hi))
        fixes[name] = (max(old[0], fixed[0]),
                       fixed[1] if old[1] is None else old[1] if fixed[1] is None else min(old[1], fixed[1]))
    return needs, fixes, unfixable


def constraint_violation(message: str, ranges: Optional[Mapping[str, Tuple[int, Optional[int]]]] = None
                         ) -> Optional[str]:
    """One line for torch.export's "Constraints violated" error (a dynamic dim whose
    declared range holds sizes the model rejects): what the model requires of each dim
    and the fix, ``dim_ranges={'seq': (2, 512)}`` when a range fixes it; None for any
    other message. Each guard is evaluated over the dim's declared range (``ranges``:
    name -> (min, max or None); default [1, inf)): guards true throughout the range are
    left out, the others are shown with the sizes that break them, and the fix is the
    widest range where every guard holds. A guard no range satisfies (the sizes must be
    even) is said so, with torch.export's own suggested fix."""
    fixed_to = dict(_SPECIALIZED.findall(message))
    if "Constraints violated" in message and fixed_to:
        shown = ", ".join(f"{n} to {v}" for n, v in fixed_to.items())
        return (f"the model fixes the dynamic dim {shown} (its code uses that size as a constant, "
                f"e.g. against a fixed-size weight or input), so it cannot be dynamic; fix: leave "
                f"{'that dim' if len(fixed_to) == 1 else 'those dims'} out of dynamic_shapes "
                "(a static size)")
    found = _VIOLATION.findall(message)
    if "Constraints violated" not in message or not found:
        return None
    needs, fixes, unfixable = _weigh_guards(found, dict(ranges or {}))
    names = ", ".join(dict.fromkeys(n for n, _ in found))
    hint = re.search(r"Suggested fixes:\s*\n(.*?)(?:\n\s*\n|$)", message, re.S)
    sugg = "; ".join(x.strip() for x in hint.group(1).splitlines() if x.strip()) if hint else ""
    instead = (f"declare the dim as torch.export suggests ({sugg}; only those sizes are then "
               "served), or " if sugg else "") + ("compile with torch.compile(model, "
                                                   "backend='opencann'), which specialises per shape")
    if not needs:
        shown = "; ".join(dict.fromkeys(_SIZE.sub(n, g.strip()).rstrip(".").strip() for n, g in found))
        return (f"torch.export cannot prove guards that hold for every size of {names} in the "
                f"declared range ({shown}), so no range fixes it; fix: {instead}")
    if unfixable:
        fix = f"no range of {', '.join(unfixable)} satisfies it; {instead}"
    elif fixes:
        fix = f"dim_ranges={fixes!r}"
    else:
        fix = "narrow the dims' ranges to what the model accepts"
    return (f"the model does not accept every size in the declared range of {names}: it "
            f"requires {'; '.join(needs)} (torch.export's guards); fix: {fix}")


def declared_ranges(dynamic_shapes: Any) -> Dict[str, Tuple[int, Optional[int]]]:
    """name -> (min, max or None) of the torch.export ``Dim`` objects in
    ``dynamic_shapes`` (a max of torch's "infinity" is None)."""
    out = {}
    for d in torch.utils._pytree.tree_leaves(dynamic_shapes, is_leaf=_is_dim):
        if _is_dim(d) and hasattr(d, "min"):
            hi = getattr(d, "max", None)
            out[d.__name__] = (int(d.min), int(hi) if isinstance(hi, int) and hi < 2 ** 62 else None)
    return out


def required_ranges(message: str) -> Dict[str, Tuple[int, int]]:
    """The ``dim_ranges`` fix a `constraint_violation` line proposes ({} if none)."""
    m = re.search(r"fix: dim_ranges=(\{.*\})$", message)
    return ast.literal_eval(m.group(1)) if m else {}
