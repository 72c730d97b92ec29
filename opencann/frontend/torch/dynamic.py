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

torch.export turns each dynamic dim into a shape-environment symbol (``s43``) whose
value range (``ep.range_constraints``) is the declared range narrowed by what the model
itself requires (a position table of 512 entries bounds ``seq``). `dynamic_dims` maps
those symbols back to the user's names, ranges and the inputs they come from.
Source: PyTorch "torch.export" documentation, "Expressing Dynamism".
"""
from __future__ import annotations

import ast
import inspect
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

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
        if not (isinstance(r, (tuple, list)) and len(r) == 2 and all(isinstance(v, int) for v in r)):
            raise ValueError(f"dim_ranges[{name!r}] is {r!r}; give (min, max) ints, e.g. (16, 512)")
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


def _one_input(spec: Any, dims: _Dims, what: str) -> Any:
    """One input's entry: {dim index: name/Dim}, a per-dim list, or None."""
    if spec is None:
        return None
    if isinstance(spec, Mapping):
        for k in spec:
            if not isinstance(k, int):
                raise ValueError(f"dynamic_shapes[{what}] has key {k!r}; key its dims by index, "
                                 "e.g. {0: 'batch', 1: 'seq'}")
        return {k: dims.get(v) for k, v in spec.items()}
    if isinstance(spec, (list, tuple)) and all(v is None or isinstance(v, (str, tuple)) or _is_dim(v)
                                               for v in spec):
        return type(spec)(dims.get(v) for v in spec)
    return spec   # a nested structure of torch.export's own form: passed on


def export_dynamic_shapes(model: torch.nn.Module, args: Tuple[Any, ...],
                          kwargs: Optional[Dict[str, Any]], spec: Any,
                          ranges: Optional[Mapping[str, Tuple[int, int]]] = None
                          ) -> Tuple[Any, Dict[Tuple[str, int], str], set]:
    """torch.export's ``dynamic_shapes`` for ``spec``, the user's dim names by
    (argument name, dim index) and the names given no range (default ``[1, inf)``). ``spec``: a dict keyed by ``forward``'s argument names
    or a tuple in argument order (see the module docstring); arguments it leaves out
    are static. Raises ValueError naming an unknown argument, a bad key or range."""
    dims = _Dims(ranges or {})
    names = _arg_names(model, args, kwargs)
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - set(names))
        if unknown:
            raise ValueError(f"dynamic_shapes names {unknown}, which are not arguments of "
                             f"{type(model).__name__}.forward ({', '.join(names)}); key it by "
                             "those names, e.g. {" + repr(names[0] if names else 'x') +
                             ": {0: 'batch'}}")
        by_name = {n: _one_input(spec.get(n), dims, repr(n)) for n in names}
    elif isinstance(spec, (tuple, list)):
        if len(spec) != len(names):
            raise ValueError(f"dynamic_shapes has {len(spec)} entries for {len(names)} arguments "
                             f"({', '.join(names)}); give one per argument (None: static)")
        by_name = {n: _one_input(s, dims, str(i)) for i, (n, s) in enumerate(zip(names, spec))}
    else:
        raise ValueError(f"dynamic_shapes must be a dict such as {{'input_ids': {{0: 'batch', 1: "
                         f"'seq'}}}} or a tuple per argument, got {type(spec).__name__}")
    labels = {(n, i): getattr(d, "__name__", f"{n}.shape[{i}]")
              for n, s in by_name.items() if isinstance(s, Mapping) for i, d in s.items() if d is not None}
    labels.update({(n, i): getattr(d, "__name__", f"{n}.shape[{i}]")
                   for n, s in by_name.items() if isinstance(s, (list, tuple))
                   for i, d in enumerate(s) if d is not None and not isinstance(d, (list, tuple, dict))})
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
            if not isinstance(d, torch.SymInt) or not d.node.expr.is_Symbol:
                continue
            sym = str(d.node.expr)
            e = out.setdefault(sym, {"name": None, "sources": [], **_vr(ep, d.node.expr)})
            e["sources"].append(f"{node.name}.shape[{i}]")
            e["name"] = e["name"] or labels.get((node.name, i))
    for sym, e in out.items():
        e["name"] = e["name"] or e["sources"][0]
    return out


def _vr(ep, expr) -> Dict[str, Optional[int]]:
    r = ep.range_constraints.get(expr)
    if r is None:
        return {"min": DEFAULT_MIN, "max": None}
    hi = r.upper
    return {"min": int(r.lower), "max": int(hi) if getattr(hi, "is_finite", True) and
            str(hi) not in ("oo", "int_oo") else None}


_VIOLATION = re.compile(r"Not all values of (\w+) = .*? satisfy the generated guard (.*)")
_SIZE = re.compile(r"L\['[^']+'\]\.size\(\)\[\d+\]")


def constraint_violation(message: str) -> Optional[str]:
    """One line for torch.export's "Constraints violated" error (a dynamic dim whose
    declared range holds sizes the model rejects): what the model requires of each dim
    and the fix, ``dim_ranges={'seq': (2, 512)}`` when the requirement is a range; None
    for any other message."""
    found = _VIOLATION.findall(message)
    if "Constraints violated" not in message or not found:
        return None
    needs, fixes = [], {}
    for name, guard in found:
        guard = _SIZE.sub(name, guard.strip())
        needs.append(guard.replace(" and ", ", "))
        lo = re.search(rf"(\d+) <= {name}\b", guard)
        hi = re.search(rf"\b{name} <= (\d+)", guard)
        if lo or hi:
            fixes[name] = (int(lo.group(1)) if lo else DEFAULT_MIN, int(hi.group(1)) if hi else None)
    fix = (f"dim_ranges={fixes!r}" if fixes and all(h is not None for _, h in fixes.values())
           else "narrow the dims' ranges to what the model accepts")
    return (f"the model does not accept every size in the declared range of "
            f"{', '.join(n for n, _ in found)}: it requires {'; '.join(needs)} (torch.export's "
            f"guards); fix: {fix}")


def required_ranges(message: str) -> Dict[str, Tuple[int, int]]:
    """The ``dim_ranges`` fix a `constraint_violation` line proposes ({} if none)."""
    m = re.search(r"fix: dim_ranges=(\{.*\})$", message)
    return ast.literal_eval(m.group(1)) if m else {}
