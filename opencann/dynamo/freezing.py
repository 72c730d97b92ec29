"""Freezing for ``torch.compile(model, backend="opencann")`` inference graphs: the model's
parameters and buffers become constants of the opencann graph, so the constant-only
rewrites of `opencann.compile` (BatchNorm folding, Conv+BN+ReLU fusion, weight
prepacking, QKV merging) apply to the torch.compile path too, guarded so that a weight
changed afterwards never gives a stale result.

When: every graph the backend compiles for inference (grad mode off, or no input that
requires grad), unless the option ``freezing`` is False. Inductor freezes only with
``torch._inductor.config.freezing`` and grad mode off (``torch._dynamo.utils.
is_parameter_freezing``); here a grad-mode graph whose tensors need no gradient is an
inference graph too, and a ``requires_grad_()`` later fails dynamo's tensor guard and
recompiles it as a training graph. Training graphs are never frozen.

What: the graph inputs dynamo took from an ``nn.Module`` (parameters, buffers, tensor
attributes: sources under ``L['self']``), found through each AOTAutograd placeholder's
``meta["desc"]`` (``PlainAOTInput(idx)``: the dynamo argument it is), minus what AOTAutograd's
``fw_metadata`` says the graph mutates (BatchNorm running statistics in train mode) or
returns an alias of, as Inductor's ``replace_params_with_constants``
(torch/_inductor/freezing.py) does, and minus inference tensors (no version counter)
and tensor subclasses. Constants are snapshots (copies) of the module's tensors, as
`opencann.compile`'s weights are.

Guard (per call, on the tensors dynamo passes for the frozen inputs anyway): the tuple of
their ``id``s, ``_version`` counters and ``data_ptr``s equals the one recorded at freezing,
none of them was freed (a weakref callback), and none was written in a way torch does not
count in ``_version`` (`opencann.runtime.weight_watch`: a global optimizer step post-hook
for fused optimizer steps, and per-call value probes — whole for tensors up to 16 KiB such
as BatchNorm's running statistics updated by an eager train-mode forward, the first and
last 32 elements of larger ones — for writes through ``.data`` or NumPy). An in-place
change torch records (``p.copy_`` under no_grad, ``load_state_dict``, an optimizer step,
``p.mul_``), one it does not (``Adam(..., fused=True)``, ``_fused_sgd_``, BatchNorm
statistics, ``p.data.copy_(t)``), a new Parameter object (``load_state_dict(assign=True)``,
``m.w = nn.Parameter(...)``) or a rebound storage (``p.data = t``) re-freezes the graph:
compiled again with the current tensors, logged at INFO with the reason and counted in
`opencann.dynamo.recompiles`. After ``torch._dynamo.config.recompile_limit`` re-freezes of
one graph, the tensors that changed again are kept as graph inputs (a WARNING says which).
The one write not seen: through ``.data`` (or NumPy) into a tensor over 16 KiB that leaves
its first and last 32 elements unchanged (``p.data[5:9] = t``): every output then keeps
the old weights' value (the snapshot, never a mix); write under ``torch.no_grad()``
(``p[5:9] = t``, which torch records) or compile with ``options={"freezing": False}``.
Cost of the value probes on ResNet-50's state: about 65 µs per call (bench/weight_watch.py).
"""
from __future__ import annotations

import operator
import re
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..log import logger
from ..report import fmt_bytes
from ..engine.guards import FrozenWeights, UnrecordedWrites
from ..runtime.weight_watch import WeightWatch
from .compile_fx import compile_fx
from .recompiles import Compile, note_refreeze
from .symbolic import graph_symbols

def module_name(source: Any) -> str:
    """A readable name for a dynamo source: ``L['self']._modules['c']._parameters['weight']``
    -> ``c.weight`` (the compiled module's own local, ``self`` or dynamo's ``fn``, dropped)."""
    name = getattr(source, "name", source)
    name = name() if callable(name) else str(name)
    name = re.sub(r"\._(?:modules|parameters|buffers)\['([^']+)'\]", r".\1", name)
    return re.sub(r"^L\['[^']+'\]\.", "", name) or name


def weight_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Dict[int, str]:
    """The dynamo graph's arguments that are module state: argument index -> readable name,
    for each placeholder whose dynamo source lies under an ``nn.Module`` (or that is an
    ``nn.Parameter``) and whose example is a plain strided CPU tensor with a version counter."""
    from torch._dynamo.source import (is_from_unspecialized_nn_module_source,
                                      is_from_unspecialized_param_buffer_source)
    out = {}
    for i, (node, t) in enumerate(zip(gm.graph.find_nodes(op="placeholder"), example_inputs)):
        src = getattr(node, "_dynamo_source", None)
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or src is None:
            continue
        if not (isinstance(t, torch.nn.Parameter) or is_from_unspecialized_param_buffer_source(src)
                or is_from_unspecialized_nn_module_source(src)):
            continue
        if t.layout == torch.strided and t.device.type == "cpu" and not t.is_inference():
            out[i] = module_name(src)
    return out


def _plan(g: torch.fx.GraphModule, weights: Dict[int, str]) -> Tuple[Dict[int, int], Dict[str, str]]:
    """(AOT placeholder position -> dynamo argument index, for the inputs to freeze;
    name -> why kept as an input) for the AOTAutograd graph ``g``."""
    from torch._guards import TracingContext
    ctx = TracingContext.try_get()
    meta = ctx.fw_metadata if ctx is not None else None
    holders = g.graph.find_nodes(op="placeholder")
    if meta is None or len(meta.input_info) != len(holders):
        return {}, {n: "AOTAutograd gave no input metadata for this graph" for n in weights.values()}
    aliased = {o.base_idx for o in meta.output_info if o.base_idx is not None}
    freeze, kept = {}, {}
    for pos, node in enumerate(holders):
        desc = node.meta.get("desc")
        idx = getattr(desc, "idx", None) if type(desc).__name__ == "PlainAOTInput" else None
        if idx not in weights:
            continue
        info = meta.input_info[pos]
        if info.mutates_data or info.mutates_metadata:
            kept[weights[idx]] = "the graph writes it (e.g. BatchNorm running statistics in train mode)"
        elif pos in aliased:
            kept[weights[idx]] = "an output is a view of it"
        else:
            freeze[pos] = idx
    return freeze, kept


class _Frozen:
    """One frozen compile: its runner and the guards on the tensors it froze
    (`opencann.engine.guards`: `FrozenWeights`, their ids, versions and data pointers
    at freezing, ``stale`` once one of them is freed; `UnrecordedWrites`, the writes
    torch does not count in ``_version``)."""

    def __init__(self, tensors: List[torch.Tensor], run: Callable, names: List[str]):
        self.run, self.report = run, run.report
        self.weights = FrozenWeights(list(zip(names, tensors)))
        # writes torch does not count in ``_version`` (fused optimizer steps, BatchNorm
        # statistics, ``.data``): an optimizer post-hook and per-call value probes
        self.writes = UnrecordedWrites(WeightWatch(tensors, names))
        self.watch = self.writes.watch
        self.ids = self.weights.ids

    @property
    def stale(self) -> bool:
        """Whether one of the frozen tensors was freed."""
        return self.weights.freed

    def holds(self, ws: Tuple[torch.Tensor, ...]) -> bool:
        """Whether ``ws`` (the tensors passed at the frozen positions) are the frozen ones,
        unchanged: the per-call guard."""
        return self.weights.holds(ws) and not self.writes.changed()


class FrozenGraph:
    """An inference graph compiled with module state as constants, re-frozen when that
    state changes (see the module docstring). Called by AOTAutograd like `compile_fx`'s
    result (``run(*args) -> list``); ``report`` is the current compile's report and
    ``refreezes`` the number of re-freezes. Compiles are kept per set of tensor objects
    (up to ``recompile_limit``), so two instances of one model class called in turn
    (one dynamo graph serves both) switch between their frozen compiles."""

    def __init__(self, g: torch.fx.GraphModule, inputs, options: Dict[str, Any],
                 freeze: Dict[int, int], names: Dict[int, str], kept: Dict[str, str],
                 example_inputs: Sequence[Any], entry: Optional[Compile]):
        self._g, self._inputs, self._options, self._entry = g, inputs, options, entry
        self._names = {pos: names[idx] for pos, idx in freeze.items()}
        self._kept = dict(kept)
        self._lock = threading.Lock()
        self._states: Dict[tuple, _Frozen] = {}
        self.refreezes = 0
        self._set_positions(list(freeze))
        self._cur = self._build([example_inputs[idx] for idx in freeze.values()])

    @property
    def report(self):
        """The compile report of the frozen compile in use."""
        return self._cur.report

    def _set_positions(self, positions: List[int]) -> None:
        """Freeze at AOT placeholder ``positions``; ``_pick(args)`` then gives their tensors."""
        self._positions = positions
        get = operator.itemgetter(*positions) if positions else (lambda args: ())
        self._pick = get if len(positions) != 1 else (lambda args: (get(args),))

    def _build(self, tensors: List[torch.Tensor]) -> _Frozen:
        """Compile with ``tensors`` frozen at ``self._positions``; cache and return it."""
        # snapshots, as `opencann.compile`'s weights: a write the guard cannot see (through
        # ``.data``) then leaves every output at the old weights' value, never a mix of
        # folded-stale and live-aliased weights
        snap = [t.detach().clone() for t in tensors]
        run = compile_fx(self._g, self._inputs, self._options or None,
                         constants=dict(zip(self._positions, snap)), entry=self._entry)
        state = _Frozen(tensors, run, [self._names[p] for p in self._positions])
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        run.report.torch_compile["frozen"] = {
            "tensors": len(tensors), "bytes": sum(seen.values()),
            "kept_as_inputs": dict(self._kept), "refreezes": self.refreezes}
        run.report.notes.append(
            f"freezing: {len(tensors)} module tensors ({fmt_bytes(sum(seen.values()))}) are "
            "constants, guarded per call" + (f"; kept as inputs: {', '.join(self._kept)}"
                                             if self._kept else ""))
        if len(self._states) >= torch._dynamo.config.recompile_limit:
            self._states.pop(next(iter(self._states))).watch.release()
        old = self._states.pop(state.ids, None)
        if old is not None:
            old.watch.release()
        self._states[state.ids] = state
        return state

    def __call__(self, *args):
        if len(args) == 1 and isinstance(args[0], list):
            args = tuple(args[0])
        cur = self._cur
        if not cur.holds(self._pick(args)):
            with self._lock:
                cur = self._switch(args)
        return cur.run(*args)

    def _switch(self, args) -> _Frozen:
        """The frozen compile for ``args``' tensors: a cached one that holds, else a new one."""
        ws = self._pick(args)
        if self._cur.holds(ws):
            return self._cur   # another thread switched meanwhile
        known = self._states.get(tuple(map(id, ws)))
        if known is not None and known.holds(ws):
            self._cur = known
            return known
        changed = _changes(known or self._cur, ws, self._positions)
        self.refreezes += 1
        limit = torch._dynamo.config.recompile_limit
        if self.refreezes > limit and changed:
            for pos in changed:
                self._kept[self._names[pos]] = f"changed after {limit} re-freezes"
            logger.warning("opencann: %s changed again after %d re-freezes of %s: kept as graph "
                           "inputs from now on", ", ".join(self._names[p] for p in changed),
                           limit, self._cur.report.model)
            self._set_positions([p for p in self._positions if p not in changed])
            for old in self._states.values():
                old.watch.release()
            self._states.clear()
        reason = "; ".join(f"frozen {self._names[p]} {why}" for p, why in changed.items()) \
            or "a frozen tensor was freed"
        self._cur = self._build(list(self._pick(args)))
        self._cur.report.torch_compile["frozen"]["refreezes"] = self.refreezes
        note_refreeze(self._entry, reason, [self._cur.report])
        return self._cur


def _changes(state: _Frozen, ws: Tuple[torch.Tensor, ...], positions: List[int]) -> Dict[int, str]:
    """AOT position -> how the tensor there differs from the one ``state`` froze."""
    unseen = state.watch.changes() if not state.stale else {}
    seen = state.weights.changes(ws)
    out = {}
    for k, pos in enumerate(positions[:len(ws)]):
        why = seen.get(k) or unseen.get(k)
        if why:
            out[pos] = why
    return out


def freezing_compiler(weights: Dict[int, str], example_inputs: Sequence[Any],
                      options: Dict[str, Any], entry: Optional[Compile]) -> Callable:
    """The AOTAutograd inference compiler that freezes ``weights`` (dynamo argument index
    -> name, `weight_inputs`) of ``example_inputs`` (the real tensors dynamo passed the
    backend); without any to freeze, or for a graph that runs eagerly (a data-dependent
    size), it is plain `compile_fx`."""
    def fw(g, inputs):
        freeze, kept = _plan(g, weights)
        if not freeze or graph_symbols(g, inputs).data_dependent:   # runs eagerly: no snapshots
            run = compile_fx(g, inputs, options or None, entry=entry)
            if kept:
                run.report.torch_compile["frozen"] = {"tensors": 0, "bytes": 0,
                                                      "kept_as_inputs": kept, "refreezes": 0}
            return run
        frozen = FrozenGraph(g, inputs, options, freeze, weights, kept, example_inputs, entry)
        frozen._boxed_call = False
        return frozen
    return fw
