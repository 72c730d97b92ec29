"""The steps of `opencann.tune`'s search (module docstring of `opencann.tools.tune`, steps
3-5): `_Builder` compiles the captured program with given options and times it per node
(`_charge`) or whole (`_race`); `_outputs_ok` re-checks the outputs against eager (the
gate's rules or the user's metric); `_Search` holds the choice and runs the gate, timing,
output-fix, end-to-end and result steps."""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.utils._pytree as pytree

from ..ir import traced_names
from . import tune_int8
from .compare import Session, check_judgeable, metrics
from .tune_gate import COSINE_FAIL
from .tune_result import Candidate, NodeChoice, TuneResult

#: the faster candidate must beat the slower one by this fraction to be kept
TIME_MARGIN = 0.05


def _charge(graph, names) -> Dict[str, Dict[str, float]]:
    """Final-graph node name -> {candidate node name: the share of its time charged to it}:
    a Cast's ``meta["precision_for"]`` (the node the ``precision`` pass inserted it for),
    else the candidate nodes among those it does the work of (`traced_names`: what a fused
    node records of the nodes it replaced, ``convolution_1`` for ConvAddAct
    ``convolution_1_1_add_relu``), in equal shares (Q, K and V merged into one GEMM). A node
    doing no candidate's work is left out."""
    names = set(names)
    out: Dict[str, Dict[str, float]] = {}
    for n in graph.nodes:
        target = n.meta.get("precision_for")
        mine = [target] if target in names else [s for s in traced_names(n) if s in names]
        if mine:
            out[n.name] = {c: 1.0 / len(mine) for c in mine}
    return out


class _Builder:
    """Compiles ``session``'s program with given options (no re-capture) and times it."""

    def __init__(self, session: Session, device: str, reps: int):
        self.session, self.device, self.reps = session, device, reps
        self.inputs = [t.contiguous() for t in session.flat if isinstance(t, torch.Tensor)]

    def executor(self, options: Dict[str, Any]):
        from ..engine import compile_graph
        from ..frontend.torch import from_exported_program
        from ..runtime import Executor
        g = from_exported_program(self.session.ep, name=type(self.session.model).__name__)
        g, plan, _ = compile_graph(g, self.device, dict(options))
        return Executor(g, plan)

    def race(self, a: Dict[str, Any], b: Dict[str, Any]) -> Tuple[float, float]:
        """Least call time (ms) of the graph compiled with options ``a`` and with ``b``,
        interleaved (`_race`), both called alike (`Executor.run` on the same inputs)."""
        ea, eb = self.executor(a), self.executor(b)
        return _race(lambda: ea.run(self.inputs), lambda: eb.run(self.inputs))

    def node_times(self, options: Dict[str, Any], names) -> Dict[str, Optional[float]]:
        """Candidate node name -> seconds charged to it under ``options`` (`_charge`); None
        when nothing was measured for it (no node of the compiled graph does its work, or
        those that do took no measured time)."""
        ex = self.executor(options)
        secs = ex.node_seconds(self.inputs, reps=self.reps)
        total = {n: 0.0 for n in names}
        for node, shares in _charge(ex.graph, names).items():
            for c, share in shares.items():
                total[c] += secs.get(node, 0.0) * share
        return {n: t if t > 0 else None for n, t in total.items()}


def _group_time(times: Dict[str, Optional[float]], group: List[str]) -> Optional[float]:
    """The sum of ``group``'s times (`_Builder.node_times`); None when one has none."""
    ts = [times.get(n) for n in group]
    return None if any(t is None for t in ts) else sum(ts)


def _metric_verdict(value, metric) -> bool:
    """The user metric's answer as a bool: a Python or NumPy bool, or a one-element bool
    tensor. Anything else (a float score, a many-element tensor, None) is a TypeError
    naming the metric: its truth would be an accident (any nonzero score passes)."""
    name = getattr(metric, "__name__", type(metric).__name__)
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.numel() == 1:
        return bool(value)
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    shape = f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""
    raise TypeError(f"tune: the budget metric {name!r} returned {type(value).__name__}{shape}; it "
                    f"must return a bool (True: the outputs are acceptable), e.g. "
                    f"`return cosine > 0.999`")


def _outputs_ok(model, data, budget, compiled, outs: List[Dict[str, Any]]) -> Tuple[bool, str]:
    """Run ``compiled`` and eager on each item of ``data``; (all pass, the first failure).
    msprobe: each float output by the gate's NaN/Inf and cosine rules; a callable:
    ``budget(actual_outputs, eager_outputs)`` must be truthy. ``outs`` gets the metrics.
    Raises `UnjudgeableInputs` for an item whose eager outputs have no finite value, under
    either gate (a metric would judge NaN against NaN)."""
    outs.clear()
    for k, item in enumerate(data):
        item = item if isinstance(item, tuple) else (item,)
        with torch.no_grad():
            ref = model(*item)
            got = compiled(*item)
        check_judgeable(ref, f"the model's eager outputs on data item {k}")   # a metric too
        if callable(budget):
            try:
                value = budget(got, ref)
            except Exception as e:   # the user's own error, as raised, with where it came from
                e.add_note(f"tune: raised by the budget metric "
                           f"{getattr(budget, '__name__', type(budget).__name__)!r} judging "
                           f"data item {k} (a candidate's outputs against eager's); fix the "
                           "metric or the data")
                raise
            ok = _metric_verdict(value, budget)
            outs.append({"data": k, "metric": ok})
            if not ok:
                return False, f"{getattr(budget, '__name__', 'metric')} rejected data item {k}"
            continue
        for j, (a, e) in enumerate(zip(pytree.tree_leaves(got), pytree.tree_leaves(ref))):
            if not (isinstance(e, torch.Tensor) and e.is_floating_point()):
                continue
            m = metrics(a, e)
            outs.append({"data": k, "output": j, **{x: m[x] for x in ("cosine", "max_abs", "rel_rmse")}})
            if m["note"] or m["cosine"] <= COSINE_FAIL:
                why = m["note"] or f"cosine {m['cosine']:.6f} <= {COSINE_FAIL}"
                return False, f"output {j} on data item {k}: {why}"
    return True, ""


class _Search:
    """The search's state: ``choice`` (node name -> candidate name) and its steps."""

    def __init__(self, model, args, nodes: Dict[str, NodeChoice], cands: List[Candidate], builder):
        self.model, self.args, self.nodes, self.cands, self.builder = model, args, nodes, cands, builder
        self.names = list(nodes)
        self.choice: Dict[str, str] = {n: "fp32" for n in self.names}
        self.compiled = None
        self.any_low = False

    def options_of(self, choice: Dict[str, str]) -> Dict[str, Any]:
        """Compile options running each node in its candidate (`Candidate.options`)."""
        opts: Dict[str, Any] = {}
        for c in self.cands[1:]:
            group = [n for n in self.names if choice[n] == c.name]
            if group:
                opts = c.options(opts, group)
        return opts

    def allowed(self, n: str, c: Candidate) -> bool:
        """Whether node ``n`` may run in ``c``: it can (``Candidate.applies``) and passes
        its own-error gate, or a user metric judges (`by_gate`'s ``any_low``)."""
        v = self.nodes[n].own.get(c.name)
        return v is None or v.passed or (self.any_low and v.rule != "applies")

    def by_gate(self, any_low: bool) -> None:
        """Each node: the lowest candidate whose own-error gate it passes (when ``any_low``,
        a user metric judges: the lowest candidate that can run it); ``why`` names the
        failed gates."""
        self.any_low = any_low
        for n, nc in self.nodes.items():
            fails = []
            for c in reversed(self.cands[1:]):
                if self.allowed(n, c):
                    self.choice[n] = c.name
                    break
                fails.append(f"{c.name} own error: {nc.own[c.name].detail}")
            nc.why = "; ".join(fails)

    def next_higher(self, n: str) -> str:
        """The candidate above node ``n``'s choice and below fp32 closest to it that ``n``
        may run in (`allowed`; int8 -> bf16), else "fp32"."""
        i = [c.name for c in self.cands].index(self.choice[n])
        return next((c.name for c in reversed(self.cands[1:i]) if self.allowed(n, c)), "fp32")

    def groups(self) -> List[List[str]]:
        """The candidate nodes decided together: lowered nodes of one op and one precision
        reading the same activation (attention's Q, K and V projections, which fusion
        merges into one GEMM whose time is charged to the first), else each alone."""
        by: Dict[tuple, List[str]] = {}
        for n in self.names:
            key = (self.nodes[n].reads, self.choice[n]) if self.nodes[n].reads else (n,)
            by.setdefault(key, []).append(n)
        return list(by.values())

    def drop_slow(self) -> None:
        """Time every node all-fp32, as chosen, and (where one exists) one candidate
        higher (`next_higher`: int8 -> bf16) (`_Builder.node_times`); each lowered group
        (`groups`) keeps the fastest of these, a lower one only when `TIME_MARGIN`
        faster (its casts and quantizations included) than the fastest higher one. Then
        the result is raced end to end against the gate's choice (`_Builder.race`); the
        gate's choice comes back, with its reasons, when it is `TIME_MARGIN` faster."""
        if not any(p != "fp32" for p in self.choice.values()):
            return
        gated = dict(self.choice)
        whys = {n: self.nodes[n].why for n in self.names}
        self._drop_slow_per_node()
        if self.choice == gated:
            return
        t_gated, t_timed = self.builder.race(self.options_of(gated), self.options_of(self.choice))
        if t_gated < t_timed * (1 - TIME_MARGIN):
            self.choice = gated
            for n in self.names:
                self.nodes[n].why = whys[n]

    def _drop_slow_per_node(self) -> None:
        """`drop_slow`'s per-node step (its docstring's first sentences)."""
        high = self.builder.node_times(self.options_of({n: "fp32" for n in self.names}), self.names)
        low = self.builder.node_times(self.options_of(self.choice), self.names)
        above = {n: self.next_higher(n) if self.choice[n] != "fp32" else "fp32" for n in self.names}
        mid = (self.builder.node_times(self.options_of(above), self.names)
               if any(p != "fp32" for p in above.values()) else {})
        for n in self.names:
            got = [("fp32", high[n])] + [(p, t) for p, t in ((self.choice[n], low[n]),
                                                             (above[n], mid.get(n))) if p != "fp32"]
            self.nodes[n].seconds.update({p: t for p, t in got if t is not None})
        for group in self.groups():
            if self.choice[group[0]] != "fp32":
                q = above[group[0]] if len({above[n] for n in group}) == 1 else "fp32"
                self._time_group(group, q, high, mid, low)

    def _time_group(self, group: List[str], q: str, high, mid, low) -> None:
        """One lowered group's verdict (`drop_slow`): of all-fp32's, one higher's (``q``,
        unless "fp32") and its choice's times (``high``, ``mid``, ``low``: `node_times`),
        the highest precision's is kept unless a lower one is `TIME_MARGIN` faster. A
        precision with no measured time for a member (None) is left out of the comparison
        and named in the members' ``why``; without its choice's own time the group keeps it."""
        p = self.choice[group[0]]
        tried = [("fp32", high), (q, mid), (p, low)] if q != "fp32" else [("fp32", high), (p, low)]
        tried = [(name, _group_time(times, group)) for name, times in tried]
        missing = [name for name, t in tried if t is None]
        what = f" (with {', '.join(group[1:])})" if len(group) > 1 else ""
        note = (f"no time measured for it in {' or '.join(missing)} (no node of that compiled "
                f"graph ran its work)" if missing else "")
        measured = [(name, t) for name, t in tried if t is not None] if p not in missing else []
        best, bt = measured[0] if measured else (p, 0.0)
        for name, t in measured[1:]:
            if t < bt * (1 - TIME_MARGIN):
                best, bt = name, t
        if best == p:
            if note:
                for n in group:
                    self.nodes[n].why = "; ".join(w for w in (self.nodes[n].why,
                                                              f"timing{what}: {note}; {p} kept") if w)
            return
        lo = tried[-1][1]
        for n in group:
            self.nodes[n].why = "; ".join(w for w in (f"timing{what}: {p} {lo * 1e6:.1f} us incl. casts, "
                                                      f"not {TIME_MARGIN:.0%} under {best}'s "
                                                      f"{bt * 1e6:.1f} us", note) if w)
            self.choice[n] = best

    def fix_outputs(self, data, budget, over) -> Tuple[bool, str, List[Dict[str, Any]]]:
        """Compile the choice and check the outputs (`_outputs_ok`); while they fail (and
        ``over()`` is False), the lowered node with the worst own error goes up one
        candidate (`next_higher`: int8 -> bf16 where its own error allows, else fp32).
        Returns (passed, why not, output metrics); ``self.compiled`` is the last compile."""
        from ..engine import compile_module
        outs: List[Dict[str, Any]] = []
        while True:
            self.compiled = compile_module(self.model, self.args, self.builder.device,
                                           self.options_of(self.choice))
            ok, why = _outputs_ok(self.model, data, budget, self.compiled, outs)
            lowered = [n for n in self.names if self.choice[n] != "fp32"]
            if ok or not lowered or over():
                return ok, why, outs

            def badness(n):
                v = self.nodes[n].own.get(self.choice[n])
                return (v.cosine, -v.max_abs) if v is not None else (1.0, 0.0)
            worst = min(lowered, key=badness)
            self.nodes[worst].why = f"outputs: {why} with it in {self.choice[worst]}"
            self.choice[worst] = self.next_higher(worst)

    def raise_lowest(self, data, budget, outs: List[Dict[str, Any]]) -> None:
        """End to end against one candidate higher: the nodes on the lowest candidate (int8,
        with three candidates) moved to `next_higher` (bf16; a node whose next higher is
        fp32 stays) and both whole graphs timed in turn (`_race`). Per-node times miss what a choice costs its neighbours (an int8
        Linear's norm writing uint8 instead of bf16); when the higher graph is `TIME_MARGIN`
        faster and its outputs pass (`_outputs_ok`), it is kept, each moved node saying so."""
        from ..engine import compile_module
        lowest = self.cands[-1].name
        if len(self.cands) < 3:
            return
        up = {n: self.next_higher(n) for n, p in self.choice.items() if p == lowest}
        alt = {n: up[n] if up.get(n, "fp32") != "fp32" else p for n, p in self.choice.items()}
        moved = [n for n in self.names if alt[n] != self.choice[n]]
        if not moved:
            return
        other = compile_module(self.model, self.args, self.builder.device, self.options_of(alt))
        low_ms, high_ms = race_models(self.compiled, other, self.args)
        if not high_ms < low_ms * (1 - TIME_MARGIN):
            return
        check: List[Dict[str, Any]] = []
        if not _outputs_ok(self.model, data, budget, other, check)[0]:
            return
        for n in moved:
            self.nodes[n].why = (f"end to end: {lowest} for {len(moved)} node(s) took {low_ms:.2f} ms a call, "
                                 f"{alt[n]} for them {high_ms:.2f} ms")
            self.choice[n] = alt[n]
        self.compiled = other
        outs[:] = check

    def result(self, budget, outs, timing: bool = True) -> TuneResult:
        """The `TuneResult` of the current choice, both call times measured the same way
        (`race_models`: each a `CompiledModel` call, interleaved, the least of the rounds);
        with ``timing``, a choice not faster than all-fp32 end to end is dropped for
        all-fp32, each node saying so."""
        from ..engine import compile_module
        fp32 = compile_module(self.model, self.args, self.builder.device,
                              self.options_of({n: "fp32" for n in self.names}))
        fp32_ms, tuned_ms = race_models(fp32, self.compiled, self.args)
        lowered = [n for n in self.names if self.choice[n] != "fp32"]
        if timing and lowered and tuned_ms >= fp32_ms:
            for n in lowered:
                self.nodes[n].why = (f"end to end: the tuned call took {tuned_ms:.2f} ms, "
                                     f"all-fp32 {fp32_ms:.2f} ms")
                self.choice[n] = "fp32"
            self.compiled = compile_module(self.model, self.args, self.builder.device,
                                           self.options_of(self.choice))
            tuned_ms = fp32_ms
        ran = tune_int8.int8_applied(self.compiled)
        not_ran = tune_int8.int8_skipped(self.compiled)
        low = (self.options_of(self.choice).get("node_precision") or {})
        for n in self.names:
            if self.choice[n] == "int8" and not ran.get(n):
                as_ = "bf16" if low.get(n) == "bf16" else "fp32"   # the int8 candidate's bf16 activations
                why = not_ran.get(self.nodes[n].module, "see the compile report")
                self.nodes[n].why = f"int8 chosen, but the quantize_int8 pass left it in {as_}: {why}"
                self.choice[n] = as_
            self.nodes[n].precision = self.choice[n]
        name = budget if isinstance(budget, str) else getattr(budget, "__name__", "metric")
        res = TuneResult(self.nodes, tuple(c.name for c in self.cands), name, outs,
                         options=self.options_of(self.choice), compiled=self.compiled)
        res.fp32_ms, res.tuned_ms = fp32_ms, tuned_ms
        return res


#: a race runs at least this many rounds ...
END_TO_END_ROUNDS = 5
#: ... and goes on until both sides' calls took this long together (seconds), at most
#: `END_TO_END_MAX_ROUNDS` rounds: 5 rounds of a 30 ms BERT-base call on a loaded 2-core
#: host flipped the tuner's choice between all-int8 and all-bf16 from one run to the next
#: (docs/performance.md, "int8 BERT-base at batch 1"); a second of rounds costs little
#: against the search's compiles
END_TO_END_SECONDS = 1.0
END_TO_END_MAX_ROUNDS = 40


def race_models(a, b, args: tuple) -> Tuple[float, float]:
    """Least call time (ms) of the compiled models ``a`` and ``b`` on ``args`` (`_race`):
    both called the same way (``model(*args)``, `CompiledModel.__call__` with its call-time
    checks) the same number of times, so a model raced against itself gets a ratio near 1."""
    return _race(lambda: a(*args), lambda: b(*args))


def _race(a: Callable, b: Callable) -> Tuple[float, float]:
    """Least call time (ms) of ``a`` and of ``b``, each round calling both in turn (a burst
    of load on a shared host hits both) after one warm-up call each: at least
    `END_TO_END_ROUNDS` rounds, more until the timed calls add up to `END_TO_END_SECONDS`,
    at most `END_TO_END_MAX_ROUNDS`."""
    best = [float("inf"), float("inf")]
    spent = 0.0
    with torch.no_grad():
        a(), b()
        for k in range(END_TO_END_MAX_ROUNDS):
            if k >= END_TO_END_ROUNDS and spent >= END_TO_END_SECONDS:
                break
            for i, fn in enumerate((a, b)):
                t = time.perf_counter()
                fn()
                dt = time.perf_counter() - t
                spent += dt
                best[i] = min(best[i], dt * 1e3)
    return best[0], best[1]


__all__ = ["END_TO_END_MAX_ROUNDS", "END_TO_END_ROUNDS", "END_TO_END_SECONDS", "TIME_MARGIN", "race_models"]
