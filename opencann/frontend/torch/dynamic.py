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

An input that is a dict, list or tuple of tensors takes an entry of the same structure
(``{"extra": {"a": {0: "batch"}, "b": None}}``, ``{"pair": [{0: "batch"}, None]}``), in
either form, names at any depth converted (`_one_input`); a dict's keys left out are static.

torch.export turns each dynamic dim into a shape-environment symbol (``s43``) whose
value range (``ep.range_constraints``) is the declared range narrowed by what the model
itself requires (a position table of 512 entries bounds ``seq``). `dynamic_dims` maps
those symbols back to the user's names, ranges and the inputs they come from.
Source: PyTorch "torch.export" documentation, "Expressing Dynamism".
"""
from __future__ import annotations

import ast
import inspect
import math
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

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


def _one_input(spec: Any, value: Any, dims: _Dims, what: str) -> Any:
    """One input's entry for torch.export, matched to the input's structure: for a tensor,
    {dim index: name/Dim} or a per-dim list (`_tensor_entry`); for a dict, list or tuple
    input, the same structure of entries, recursively (dict keys left out are static);
    a ``Dim`` or anything else (a custom structure in torch.export's own form) passed on.
    ``what``: the entry's place (``"['extra']['a']"``) for error messages. Raises
    ValueError (one line) for a key, type or length that does not match the input."""
    if spec is None or _is_dim(spec):
        return spec
    if isinstance(value, Mapping):
        first = repr(next(iter(value), "key"))
        if not isinstance(spec, Mapping) or any(k not in value for k in spec):
            bad = (f"has key(s) {[k for k in spec if k not in value]}" if isinstance(spec, Mapping)
                   else f"is a {type(spec).__name__}")
            raise ValueError(f"dynamic_shapes{what} {bad}, but that input is a dict with keys "
                             f"{list(value)}: key its entry like the input, e.g. {{{first}: "
                             "{0: 'batch'}} (keys left out are static)")
        return {k: _one_input(spec.get(k), v, dims, f"{what}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if not isinstance(spec, (list, tuple)) or len(spec) != len(value):
            shown = f"has {len(spec)} entries" if isinstance(spec, (list, tuple)) else \
                f"is a {type(spec).__name__}"
            raise ValueError(f"dynamic_shapes{what} {shown}, but that input is a "
                             f"{type(value).__name__} of {len(value)}: give a list with one entry "
                             "per element (None: static), e.g. [{0: 'batch'}, None]")
        return type(spec)(_one_input(e, v, dims, f"{what}[{i}]")
                          for i, (e, v) in enumerate(zip(spec, value)))
    return _tensor_entry(spec, value, dims, what)


def _tensor_entry(spec: Any, t: Any, dims: _Dims, what: str) -> Any:
    """A tensor input's entry: {dim index: name/Dim} (a negative index counted from the
    end of ``t``'s dims) or a per-dim list, names made the shared Dims; anything else is
    passed on. ValueError (one line) for a key that is not a dim index of ``t``."""
    if isinstance(spec, Mapping):
        out = {}
        for k, v in spec.items():
            if not isinstance(k, int) or isinstance(k, bool):
                raise ValueError(f"dynamic_shapes{what} has key {k!r}; key its dims by index, "
                                 "e.g. {0: 'batch', 1: 'seq'}")
            if isinstance(t, torch.Tensor):
                if not -t.dim() <= k < t.dim():
                    raise ValueError(f"dynamic_shapes{what} names dim {k}, but that input has "
                                     f"{t.dim()} dims (shape {list(t.shape)}): index its dims "
                                     f"0..{t.dim() - 1}")
                k = k % t.dim()
            out[k] = dims.get(v)
        return out
    if isinstance(spec, (list, tuple)) and all(v is None or isinstance(v, (str, tuple)) or _is_dim(v)
                                               for v in spec):
        return type(spec)(dims.get(v) for v in spec)
    return spec


def spec_leaves(name: str, spec: Any, value: Any):
    """Yield (torch.export's name for a tensor of input ``name``, that tensor, its
    {dim index: entry}) for every tensor ``spec`` gives an entry, through nested dicts,
    lists and tuples as torch.export names their tensors (``extra_a`` for key ``a`` of
    input ``extra``, ``pair_0`` for element 0 of ``pair``). Entries are as ``spec`` has
    them (names or Dims); None entries are left out."""
    if isinstance(value, Mapping) and isinstance(spec, Mapping):
        for k, v in value.items():
            yield from spec_leaves(f"{name}_{k}", spec.get(k), v)
    elif isinstance(value, (list, tuple)) and isinstance(spec, (list, tuple)) \
            and not isinstance(value, torch.Size) and len(spec) == len(value):
        for i, (e, v) in enumerate(zip(spec, value)):
            yield from spec_leaves(f"{name}_{i}", e, v)
    elif isinstance(spec, (Mapping, list, tuple)):
        items = spec.items() if isinstance(spec, Mapping) else enumerate(spec)
        yield name, value, {i: d for i, d in items if d is not None}


def dim_names(spec: Any) -> List[str]:
    """The simple-form dim names of a ``dynamic_shapes`` spec, in the order first named,
    through nested dicts, lists and tuples (a ``(name, min, max)`` entry gives its name;
    torch.export ``Dim`` objects are not names)."""
    if isinstance(spec, str):
        return [spec]
    if isinstance(spec, tuple) and len(spec) == 3 and isinstance(spec[0], str):
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
    are static; a dict, list or tuple input takes an entry of its own structure. Labels
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
