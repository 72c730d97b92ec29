"""ATC-style shape gears on top of the per-shape plans of `opencann.dynamic`.

``options={"dynamic_batch_size": [1, 2, 4, 8]}`` (ATC's ``--dynamic_batch_size``: dim 0
of every tensor input), ``"dynamic_image_size": [[224, 224], [448, 448]]`` (dims 2 and 3,
height and width, of every 4-D input) and ``"dynamic_dims": [[16, 16], [40, 40]]`` (one
value per dim named in ``dynamic_shapes``, in the order they are first named) compile
the model once with those dims dynamic and plan every gear at compile time, as ATC puts
every gear in its offline model. At most 100 gears (ATC's limit).

A call is served by the gear equal to its shape. Padding a smaller batch up to the next
gear (and slicing the outputs back) is only correct where every op treats samples
independently; opencann does not prove that yet, so only exact gears are served and the
report says so; any other shape (between gears, above every gear) is one error naming the
gears. Source: CANN ATC documentation, "--dynamic_batch_size", "--dynamic_image_size",
"--dynamic_dims".
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .dynamic import DynamicCompiledModel, compile_dynamic

GEAR_OPTIONS = ("dynamic_batch_size", "dynamic_image_size", "dynamic_dims")
MAX_GEARS = 100
NO_PADDING = ("padding to the next gear is not applied: opencann does not yet prove that "
              "every op treats samples independently, so only exact gears are served")


def _tensor_args(model, args, kwargs) -> List[Tuple[str, torch.Tensor]]:
    """(argument name, tensor) of the top-level tensor arguments."""
    try:
        names = [p.name for p in inspect.signature(model.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        names = []
    names += [f"arg{i}" for i in range(len(names), len(args))]
    pairs = list(zip(names, args)) + list((kwargs or {}).items())
    return [(n, t) for n, t in pairs if isinstance(t, torch.Tensor)]


def _values(name: str, gears: Any, width: int) -> List[Tuple[int, ...]]:
    """The gears of option ``name`` as tuples of ``width`` positive ints (ValueError)."""
    if isinstance(gears, str):
        gears = [[int(v) for v in g.split(",")] for g in gears.split(";")] if width > 1 \
            else [int(v) for v in gears.split(",")]
    if not isinstance(gears, (list, tuple)) or not gears:
        raise ValueError(f"option {name!r} takes a list of gears, e.g. [1, 2, 4, 8], got {gears!r}")
    out = []
    for g in gears:
        g = tuple(g) if isinstance(g, (list, tuple)) else (g,)
        if len(g) != width or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                                      for v in g):
            raise ValueError(f"option {name!r}: gear {g!r} must be {width} positive int(s)")
        out.append(g)
    if len(out) > MAX_GEARS:
        raise ValueError(f"option {name!r} has {len(out)} gears; at most {MAX_GEARS} (ATC's "
                         "limit): use dynamic_shapes with a range instead")
    return sorted(set(out))


def gear_spec(model, args, kwargs, options: Dict[str, Any], dynamic_shapes: Any
              ) -> Tuple[str, Any, List[str], List[Tuple[int, ...]]]:
    """(the gear option used, the ``dynamic_shapes`` spec, the dim names in gear order,
    the gears). Raises ValueError for two gear options, a bad gear, > 100 gears, or
    ``dynamic_dims`` without ``dynamic_shapes`` naming the dims."""
    used = [k for k in GEAR_OPTIONS if k in options]
    if len(used) != 1:
        raise ValueError(f"give one of the gear options {list(GEAR_OPTIONS)}, got {used}")
    opt = used[0]
    tensors = _tensor_args(model, args, kwargs)
    if opt == "dynamic_batch_size":
        spec = dynamic_shapes or {n: {0: "batch"} for n, _ in tensors}
        return opt, spec, ["batch"], _values(opt, options[opt], 1)
    if opt == "dynamic_image_size":
        spec = dynamic_shapes or {n: {2: "height", 3: "width"} for n, t in tensors if t.dim() == 4}
        if not spec:
            raise ValueError("dynamic_image_size needs a 4-D (N, C, H, W) tensor input")
        return opt, spec, ["height", "width"], _values(opt, options[opt], 2)
    if not isinstance(dynamic_shapes, dict):
        raise ValueError("dynamic_dims gives values for the dims named in dynamic_shapes: pass "
                         "dynamic_shapes={'input_ids': {1: 'seq'}} with it")
    names = list(dict.fromkeys(v for s in dynamic_shapes.values() if isinstance(s, dict)
                               for v in s.values() if isinstance(v, str)))
    return opt, dynamic_shapes, names, _values(opt, options[opt], len(names))


def _example_values(spec: Any, tensors: List[Tuple[str, torch.Tensor]]) -> Dict[str, List[int]]:
    """dim name -> the example's sizes for it (simple-form ``spec`` entries only)."""
    out: Dict[str, List[int]] = {}
    by_name = dict(tensors)
    for arg, dims in (spec.items() if isinstance(spec, dict) else ()):
        t = by_name.get(arg)
        if t is None or not isinstance(dims, dict):
            continue
        for i, d in dims.items():
            if isinstance(d, str) and isinstance(i, int) and i < t.dim():
                out.setdefault(d, []).append(int(t.shape[i]))
    return out


def compile_with_gears(model, example_inputs, options: Dict[str, Any], dynamic_shapes: Any = None,
                       device: str = "cpu", example_kwargs: Optional[Dict[str, Any]] = None
                       ) -> DynamicCompiledModel:
    """Compile with one gear option (see the module docstring): one capture, one
    optimisation, a plan per gear built now. Returns a `DynamicCompiledModel` whose calls
    must match a gear (ValueError naming the gears otherwise); ``report.dynamic["gears"]``
    lists them and ``["padding"]`` says why padding is not applied."""
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    opt, spec, names, gears = gear_spec(model, args, example_kwargs, options, dynamic_shapes)
    rest = {k: v for k, v in options.items() if k not in GEAR_OPTIONS}
    rest["plan_cache_size"] = max(rest.get("plan_cache_size", 0), len(gears))
    seen = _example_values(spec, _tensor_args(model, args, example_kwargs))
    # the example's own size may lie outside the gears: export needs it in range
    ranges = {n: (min([g[i] for g in gears] + seen.get(n, [])),
                  max([g[i] for g in gears] + seen.get(n, []))) for i, n in enumerate(names)}
    cm = compile_dynamic(model, example_inputs, spec, device=device, options=rest,
                         example_kwargs=example_kwargs, dim_ranges=ranges)
    by_name = {d["name"]: s for s, d in cm.binder.dims.items()}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ValueError(f"{opt}: dims {missing} are not dynamic in the captured model")
    keys = []
    for g in gears:
        values = dict(zip((by_name[n] for n in names), g))
        keys.append(tuple(values[s] for s in cm.binder.order))
    cm.binder.gears = (opt, names, gears, set(keys), NO_PADDING)
    for k in keys:
        cm.plans.pool_for_key(k)
    cm.report.dynamic.update({"gears": {"option": opt, "dims": names,
                                        "values": [list(g) for g in gears]},
                              "padding": NO_PADDING})
    cm.report.notes.append(f"{opt}: {len(gears)} gears planned; {NO_PADDING}")
    return cm
