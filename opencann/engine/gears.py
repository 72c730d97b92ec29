"""ATC-style shape gears on top of the per-shape plans of `opencann.dynamic`.

``options={"dynamic_batch_size": [1, 2, 4, 8]}`` (ATC's ``--dynamic_batch_size``: dim 0
of every tensor input), ``"dynamic_image_size": [[224, 224], [448, 448]]`` (dims 2 and 3,
height and width, of every 4-D input; tensors inside dict, list and tuple inputs
count too) and ``"dynamic_dims": [[16, 16], [40, 40]]`` (one
value per dim named in ``dynamic_shapes``, in the order they are first named) compile
the model once with those dims dynamic and plan every gear at compile time, as ATC puts
every gear in its offline model. At most 100 gears (ATC's limit).

A call is served by the SMALLEST gear that holds it, as ATC does: a batch of 3 with
gears [1, 2, 4, 8] runs the batch-4 plan on the inputs padded to 4 and the outputs are
sliced back to 3. Padding a dim is only correct where no op lets a padded index reach
a real one; `opencann.passes.gear_padding` proves that per dim on the optimised graph
from each op's ``OpDef.per_index`` fact (elementwise ops, Linear, convolution,
pooling, LayerNorm, softmax over other dims, inference BatchNorm: yes; a reduction or
BatchNorm statistics over the batch, attention over padded keys, random or unknown
ops: no). A dim it does not prove is served exactly only, and the report
(``report.dynamic["padding"]``) and the log name the op that prevents padding, with
its source line. Padded entries replicate the last real index of the dim (not zeros:
a zero row can give Inf/NaN in a norm or a division; harmless for independence, but
a real row keeps every intermediate finite where the real ones are). A shape no gear
holds (above every gear, or between gears on a dim that is not padded) is one error
naming the gears. Source: CANN ATC documentation, "--dynamic_batch_size",
"--dynamic_image_size", "--dynamic_dims".
"""
from __future__ import annotations

import functools
import inspect
import os
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..ir import Graph
from ..ir.symbolic import bind
from ..log import logger
from ..passes.gear_padding import PaddingCheck, follow_padded_dim, padding_summary
from ..frontend.torch import CaptureError
from ..frontend.torch.dynamic import dim_names, spec_leaves, spec_places, tensor_entries
from ..report import CompileReport
from ..runtime import DEFAULT_CONCURRENT_CALLS
from .compiled_model import CompiledModel
from .dynamic import DynamicShapes, ShapeBinder, compile_dynamic
from .options import GEAR_OPTIONS

MAX_GEARS = 100
NO_PADDING = "no dim can be padded, so only exact gears are served"
PAD_FILL = ("padded entries replicate the last real index of the dim; outputs are sliced "
            "back to the call's sizes")


def _arg_values(model, args, kwargs) -> List[Tuple[str, Any]]:
    """(argument name, value) of the top-level arguments."""
    try:
        names = [p.name for p in inspect.signature(model.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        names = []
    names += [f"arg{i}" for i in range(len(names), len(args))]
    return list(zip(names, args)) + list((kwargs or {}).items())


#: the dims a gear option makes dynamic in a tensor input (None: none of its dims)
DEFAULT_DIMS = {
    "dynamic_batch_size": lambda t: {0: "batch"} if t.dim() >= 1 else None,
    "dynamic_image_size": lambda t: {2: "height", 3: "width"} if t.dim() == 4 else None,
}


def _default_spec(values: List[Tuple[str, Any]], pick) -> Dict[str, Any]:
    """The ``dynamic_shapes`` spec giving every tensor input, at any depth of a dict,
    list or tuple input, the dims ``pick(tensor)`` names; inputs without any left out."""
    entries = ((n, tensor_entries(v, pick)) for n, v in values)
    return {n: e for n, e in entries if e is not None}


def _values(name: str, gears: Any, width: int) -> List[Tuple[int, ...]]:
    """The gears of option ``name`` as tuples of ``width`` positive ints (ValueError)."""
    if isinstance(gears, str):
        try:
            gears = [[int(v) for v in g.split(",")] for g in gears.split(";")] if width > 1 \
                else [int(v) for v in gears.split(",")]
        except ValueError:
            eg = "'1,2,4,8'" if width == 1 else "'224,224;448,448'"
            raise ValueError(f"option {name!r} takes gears as a list, or a string such as {eg} "
                             f"(ATC's form: ints split by ',' and gears by ';'), got {gears!r}") from None
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


def _same_sizes(opt: str, spec: Dict[str, Any], values: List[Tuple[str, Any]]) -> Dict[str, Any]:
    """``spec`` (the option's default: the dims of every tensor input, nested ones too)
    when the example inputs agree on each dim's size; else ValueError naming two inputs
    that differ (``'extra'['a']`` for a tensor inside a dict) and the fix (name the
    inputs that carry the dim)."""
    seen: Dict[str, tuple] = {}
    for arg, value in values:
        for place, t, dims in spec_places(arg, spec.get(arg), value):
            for i, d in dims.items():
                first = seen.setdefault(d, (place, i, int(t.shape[i]), arg, value, t))
                if first[2] == int(t.shape[i]):
                    continue
                fix = {first[3]: tensor_entries(first[4], lambda x, f=first: {f[1]: d}
                                                if x is f[5] else None)}
                raise ValueError(
                    f"{opt} makes dim {i} of every tensor input the dim {d!r}, but input "
                    f"{place} has {int(t.shape[i])} there and {first[0]} has {first[2]}: name "
                    f"the inputs that carry it, e.g. dynamic_shapes={fix!r} with the option")
    return spec


def gear_spec(model, args, kwargs, options: Dict[str, Any], dynamic_shapes: Any
              ) -> Tuple[str, Any, List[str], List[Tuple[int, ...]]]:
    """(the gear option used, the ``dynamic_shapes`` spec, the dim names in gear order,
    the gears). ``dynamic_batch_size`` and ``dynamic_image_size`` without
    ``dynamic_shapes`` make their dims dynamic in every tensor input, those inside dict,
    list and tuple inputs too; with ``dynamic_shapes``, the dim(s) it names (any names,
    `_named_gear_dims`) are theirs. Raises ValueError for two gear options, a bad gear,
    > 100 gears, no 4-D tensor for ``dynamic_image_size``, a ``dynamic_shapes`` naming
    another number of dims than the option has, or ``dynamic_dims`` without
    ``dynamic_shapes`` naming the dims."""
    used = [k for k in GEAR_OPTIONS if k in options]
    if len(used) != 1:
        raise ValueError(f"give one of the gear options {list(GEAR_OPTIONS)}, got {used}")
    opt = used[0]
    values = _arg_values(model, args, kwargs)
    if opt in DEFAULT_DIMS:
        names = ["batch"] if opt == "dynamic_batch_size" else ["height", "width"]
        if dynamic_shapes:   # it names the gear dims, and which inputs carry them
            first = next((n for n, v in values if isinstance(v, torch.Tensor)), "x")
            return opt, dynamic_shapes, _named_gear_dims(opt, dynamic_shapes, names, first), \
                _values(opt, options[opt], len(names))
        spec = _same_sizes(opt, _default_spec(values, DEFAULT_DIMS[opt]), values)
        if not spec:
            raise ValueError(f"{opt} needs a tensor input with the dims it makes dynamic ("
                             f"{'a 4-D (N, C, H, W) one' if opt == 'dynamic_image_size' else 'dim 0'})")
        return opt, spec, names, _values(opt, options[opt], len(names))
    if not isinstance(dynamic_shapes, (dict, list, tuple)) or not dim_names(dynamic_shapes):
        raise ValueError("dynamic_dims gives values for the dims named in dynamic_shapes: pass "
                         "dynamic_shapes={'input_ids': {1: 'seq'}} with it")
    names = dim_names(dynamic_shapes)
    return opt, dynamic_shapes, names, _values(opt, options[opt], len(names))


def _named_gear_dims(opt: str, spec: Any, default: List[str], arg: str = "x") -> List[str]:
    """The dims ``dynamic_shapes`` (``spec``) names for gear option ``opt`` (any names, in
    the order first named: ``dynamic_batch_size`` takes one, the batch;
    ``dynamic_image_size`` two, height then width). With the option, ``dynamic_shapes``
    says which inputs carry those dims; inputs it leaves out or sets to None are static.
    Raises ValueError (one line: the rule and an example on input ``arg``) when it names
    another count."""
    named = dim_names(spec)
    if len(named) == len(default):
        return named
    eg = ({arg: {0: "batch"}} if len(default) == 1 else {arg: {2: "height", 3: "width"}})
    raise ValueError(
        f"{opt} with dynamic_shapes: dynamic_shapes names the inputs that carry the gear "
        f"dim{'s' if len(default) > 1 else ''} ({', '.join(default)}) and leaves the others out "
        f"or None, so it must name exactly {len(default)} dim{'s' if len(default) > 1 else ''} "
        f"by a string (any name), but it names {named}: e.g. dynamic_shapes={eg!r} (or leave "
        f"dynamic_shapes out: {opt} then uses {'dim 0' if len(default) == 1 else 'dims 2 and 3'} "
        f"of every {'tensor' if len(default) == 1 else '4-D'} input)")


def _example_values(spec: Any, values: List[Tuple[str, Any]]) -> Dict[str, List[int]]:
    """dim name -> the example's sizes for it (simple-form ``spec`` entries, inside
    dict, list and tuple inputs too; ``spec`` keyed by argument name or a tuple in
    argument order); ``values``: (argument name, value) pairs."""
    out: Dict[str, List[int]] = {}
    for k, (arg, value) in enumerate(values):
        entry = spec.get(arg) if isinstance(spec, dict) else spec[k] if \
            isinstance(spec, (list, tuple)) and k < len(spec) else None
        for _, t, dims in spec_leaves(arg, entry, value):
            for i, d in dims.items():
                if isinstance(d, str) and isinstance(t, torch.Tensor) and isinstance(i, int) \
                        and -t.dim() <= i < t.dim():
                    out.setdefault(d, []).append(int(t.shape[i]))
    return out


class GearPadder:
    """Serves a call with the smallest gear that holds it: pads the inputs' padded dims
    by replicating their last real index, and slices the outputs back
    (``Gears.padder``) for the symbolic ``graph`` and its ``binder``. ``checks``:
    symbol -> `PaddingCheck` of every gear dim; a dim not ``safe`` must match a gear
    exactly."""

    def __init__(self, graph: Graph, binder: ShapeBinder, names: Sequence[str],
                 gears: Sequence[Tuple[int, ...]], checks: Dict[str, PaddingCheck]):
        self.binder, self.checks = binder, checks
        self.graph = graph
        by_name = {d["name"]: s for s, d in binder.dims.items()}
        self.gears = [dict(zip((by_name[n] for n in names), g)) for g in gears]
        self.padded = [s for s, c in checks.items() if c.safe]
        self._memo: Dict[tuple, List[Tuple[int, int, int]]] = {}   # call shape -> cuts

    def choose(self, values: Dict[str, int]) -> Dict[str, int]:
        """The smallest gear (fewest elements, then lowest) holding ``values``; raises
        the gear error (ValueError) when none does."""
        fits = [g for g in self.gears   # a padded dim needs a real index to replicate
                if all(g[s] == values[s] or (s in self.padded and g[s] > values[s] >= 1)
                       for s in g)]
        if not fits:
            self.binder.bind_key(values)   # raises the error naming the gears
        return min(fits, key=lambda g: (math.prod(g.values()), sorted(g.items())))

    def _cuts(self, real: Dict[str, int], gear: Dict[str, int]) -> List[Tuple[int, int, int]]:
        """(output, axis, real size) of every slice back, bound once per call shape."""
        key = tuple(sorted(real.items()))
        cuts = self._memo.get(key)
        if cuts is None:
            cuts = [(j, axis, bind(self.graph.outputs[j].desc.shape[axis], real))
                    for s in self.padded if gear[s] != real[s]
                    for j, axis in self.checks[s].outputs.items()]
            if len(self._memo) < 1024:
                self._memo[key] = cuts
        return cuts

    def __call__(self, tensors: Sequence[torch.Tensor]):
        """(the inputs padded to the chosen gear, ``restore(outputs)``)."""
        real = self.binder.values(tensors)
        gear = self.choose(real)
        if gear == {s: real[s] for s in gear}:
            return list(tensors), lambda outs: outs
        ins = []
        for t, v in zip(tensors, self.graph.inputs):
            for i, d in enumerate(v.desc.shape):
                if d in self.padded and gear[d] > real[d]:
                    idx = torch.arange(gear[d]).clamp_(max=real[d] - 1)
                    t = t.index_select(i, idx)
            ins.append(t)

        cuts = self._cuts(real, gear)
        # padded copies laid out like the caller's tensor (the batch, outermost): a view
        # of one is re-based on the caller's tensor, as eager's output is a view of it
        rebase = {p.untyped_storage().data_ptr(): (p, t) for p, t in zip(ins, tensors)
                  if p is not t and p.stride() == t.stride()}

        def restore(outs):
            outs = list(outs)
            for j, axis, n in cuts:
                o = outs[j].narrow(axis, 0, n)
                outs[j] = o if o.is_contiguous() or not outs[j].is_contiguous() else o.contiguous()
            for j, o in enumerate(outs):
                hit = rebase.get(o.untyped_storage().data_ptr()) if rebase else None
                if hit is not None:
                    p, t = hit
                    outs[j] = t.as_strided(o.shape, o.stride(), o.storage_offset() -
                                           p.storage_offset() + t.storage_offset())
            return tuple(outs)
        return ins, restore


class Gears(DynamicShapes):
    """The shape policy of a model compiled with gears: `DynamicShapes` serving the
    ``gears`` of option ``option`` (values of the dims ``names``) only. The binder
    refuses other shapes, every gear is planned now (``plan``), each dim is checked for
    padding (`follow_padded_dim`) and a `GearPadder` (``padder``; None when no dim can
    be padded) serves the shapes between gears where padding applies; the report and the
    log say which dims are padded, and for the others which op prevents it.
    ``gear_spec``: {"option", "dims", "values"} (saved in the model file). Raises
    ValueError for a gear dim the captured model does not have dynamic."""

    name = "gears"

    def __init__(self, graph: Graph, report: CompileReport, binder: ShapeBinder,
                 options: Dict[str, Any], example_inputs: Sequence[torch.Tensor],
                 device: str = "cpu", *, option: str, names: Sequence[str],
                 gears: Sequence[Tuple[int, ...]], plan: bool = True):
        super().__init__(graph, report, binder, options, example_inputs, device)
        opt = option
        by_name = {d["name"]: s for s, d in binder.dims.items()}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise ValueError(f"{opt}: dims {missing} are not dynamic in the captured model")
        keys = []
        for g in gears:
            values = dict(zip((by_name[n] for n in names), g))
            keys.append(tuple(values[s] for s in binder.order))
        checks = {by_name[n]: follow_padded_dim(graph, by_name[n]) for n in names}
        safe = [n for n in names if checks[by_name[n]].safe]
        why = (f"padding applies to {', '.join(safe)} (a call is served by the smallest gear "
               "that holds it), and no gear holds this shape" if safe else NO_PADDING)
        binder.gears = (opt, list(names), list(gears), set(keys), why)
        if plan:
            ram = _host_memory_bytes()
            for g, k in zip(gears, keys):
                pool = self.plans.pool_for_key(k)
                g_k = pool.first.graph if pool.first is not None else None
                need = pool.plan.arena_bytes + (sum(v.desc.nbytes for v in (*g_k.inputs, *g_k.outputs))
                                                if g_k is not None else 0)
                if ram and need > ram:
                    raise ValueError(f"{option}: gear {list(g) if len(g) > 1 else g[0]} needs "
                                     f"{need / 2**30:.1f} GiB for its inputs, outputs and arena, more than this "
                                     f"machine's {ram / 2**30:.1f} GiB: drop that gear or make it "
                                     "smaller")
        self.gear_spec = {"option": opt, "dims": list(names), "values": [list(g) for g in gears]}
        self.padder = GearPadder(graph, binder, names, gears, checks) if safe else None
        report.dynamic.update({"gears": dict(self.gear_spec), "padding": {
            "applies": bool(safe), "fill": PAD_FILL if safe else None,
            "dims": padding_summary(checks, {s: n for n, s in by_name.items()})}})
        shown = [g[0] if len(g) == 1 else list(g) for g in gears]
        for n in names:
            c = checks[by_name[n]]
            line = (f"{opt}={shown}: {n} padded to the smallest gear holding a call ({PAD_FILL})"
                    if c.safe else f"{opt}={shown}: padding not applied to {n}, exact gears "
                    f"only: {c.why()}")
            if line not in report.notes:   # a loaded model's report has it already
                report.notes.append(line)
            logger.info("gears: %s", line)

    def run(self, inputs: Sequence[torch.Tensor]) -> tuple:
        """Flat outputs, the call padded to the smallest gear holding it (see `GearPadder`)."""
        if self.padder is None:
            return self.plans.run(inputs)
        ins, restore = self.padder(inputs)
        return restore(self.plans.run(ins))

    def profile(self, inputs: Sequence[torch.Tensor], path: Optional[str] = None
                ) -> List[Dict[str, Any]]:
        """Run once recording per-op times on the gear that serves the call (padded as
        `run` pads it), so a shape a call is served at can be profiled too."""
        if self.padder is not None:
            inputs, _ = self.padder(inputs)
        return self.plans.profile(inputs, path)

    def run_observed(self, inputs: Sequence[torch.Tensor], observe) -> tuple:
        """`ShapePolicy.run_observed` on the gear that serves the call, padded as `run`
        pads it (the observed outputs have the gear's shapes); the outputs returned are
        the call's."""
        if self.padder is None:
            return self.plans.run_observed(inputs, observe)
        ins, restore = self.padder(inputs)
        return restore(self.plans.run_observed(ins, observe))

    @classmethod
    def saved_args(cls, graph: Graph, report: CompileReport, dynamic: Dict[str, Any],
                   concurrent_calls: int = DEFAULT_CONCURRENT_CALLS,
                   gears: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """`DynamicShapes.saved_args` plus the model file's ``gears`` field
        ({"option", "dims", "values"})."""
        return {**super().saved_args(graph, report, dynamic, concurrent_calls),
                "option": gears["option"], "names": gears["dims"],
                "gears": [tuple(g) for g in gears["values"]]}


def _host_memory_bytes() -> int:
    """The host's physical memory in bytes (0 when the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _name_the_input(model, args, kwargs, opt: str, ranges) -> None:
    """``opt``'s default spec (the dims of EVERY tensor input, nested ones too) made a dim
    the model fixes: find the tensor that does not carry it (capturing without its
    entry, at most 4 tries) and raise ValueError naming it (``'extra'['a']`` inside a
    dict input), the rule and the fix; return when none alone is the cause (the caller
    re-raises the capture's error)."""
    from .dynamic import _capture   # the engine's own capture with dynamic dims
    values, pick = _arg_values(model, args, kwargs), DEFAULT_DIMS[opt]
    spec = _default_spec(values, pick)
    leaves = [(place, t) for n, v in values for place, t, _ in spec_places(n, spec.get(n), v)]
    if len(leaves) < 2 or len(leaves) > 4:
        return
    for place, t in leaves:
        rest = _default_spec(values, lambda x, t=t: None if x is t else pick(x))
        try:
            _capture(model, args, kwargs, rest, ranges)
        except (CaptureError, ValueError):
            continue
        shown = f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"
        rule = ("dim 0" if opt == "dynamic_batch_size" else "dims 2 and 3")
        raise ValueError(
            f"{opt} makes {rule} of every tensor input dynamic (ATC: the dims given -1 in "
            f"--input_shape), but input {place} {shown} does not carry them: the model uses that "
            f"size as a constant; name the inputs that do, e.g. dynamic_shapes={rest!r} with the "
            "option") from None


def compile_with_gears(model, example_inputs, options: Dict[str, Any], dynamic_shapes: Any = None,
                       device: str = "cpu", example_kwargs: Optional[Dict[str, Any]] = None
                       ) -> CompiledModel:
    """Compile with one gear option (see the module docstring): one capture, one
    optimisation, a plan per gear built now. Returns a `CompiledModel` with the `Gears`
    policy: calls are served by the smallest gear that holds them, padded where padding
    cannot change the results ( ValueError naming the gears when none holds a call);
    ``report.dynamic["gears"]`` lists them and ``["padding"]`` says, per dim, whether it
    is padded or which op prevents it."""
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    opt, spec, names, gears = gear_spec(model, args, example_kwargs, options, dynamic_shapes)
    rest = {k: v for k, v in options.items() if k not in GEAR_OPTIONS}
    rest["plan_cache_size"] = max(rest.get("plan_cache_size", 0), len(gears))
    seen = _example_values(spec, _arg_values(model, args, example_kwargs))
    # the example's own size may lie outside the gears: export needs it in range
    ranges = {n: (min([g[i] for g in gears] + seen.get(n, [])),
                  max([g[i] for g in gears] + seen.get(n, []))) for i, n in enumerate(names)}
    # a dim with one value in every gear and the example (one gear, [4, 4]) is still
    # captured dynamic, over [v, v + 1] (torch.export needs min < max); only v is planned
    ranges = {n: (lo, hi if hi > lo else lo + 1) for n, (lo, hi) in ranges.items()}
    try:
        return compile_dynamic(model, example_inputs, spec, device=device, options=rest,
                               example_kwargs=example_kwargs, dim_ranges=ranges,
                               policy=functools.partial(Gears, option=opt, names=names, gears=gears))
    except CaptureError as e:
        if dynamic_shapes is None and "cannot be dynamic" in str(e):
            _name_the_input(model, args, example_kwargs, opt, ranges)
        raise
