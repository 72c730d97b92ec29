"""Per-node precision search (``opencann.tune``): the fastest mix of precisions whose
results pass an accuracy gate, as AMCT / OpenVINO's accuracy-aware tuning do per layer.

    res = opencann.tune(model, (x,))               # candidates fp32 and bf16, msprobe's gate
    res.precision            # node name -> "fp32" / "bf16"
    res.kept                 # node name -> why it stays in higher precision (the gate it failed)
    res.speedup              # measured call time of all-fp32 / tuned, same process
    y = res.compiled(x)      # the compiled model with the choice applied (saved by opencann.save)

The search (deterministic given ``seed``, but for the timing step, which compares
minima of repeated timings with a 5% margin):

1. Candidate nodes: the nodes mixed precision lowers (``OpKind`` MATMUL, CONV,
   ATTENTION; `opencann.passes.prepare.precision.LOW_KINDS`), named as the captured
   program names them (stable across compiles; before fusion).
2. Each node's own error per low candidate: the op run by torch on eager's exact inputs
   rounded to the candidate (`Candidate.emulate`), judged against eager by the gate
   (`opencann.tools.tune_gate.msprobe_gate`); a node failing it keeps the next higher
   candidate (reason: the rule and figures).
3. Timing: the all-fp32 graph, the candidate graph and (with three or more candidates)
   the graph with each lowered node one candidate higher (int8 -> bf16) compiled and
   timed per node (`Executor.node_seconds`: the least of a few runs); a node's time
   includes the Casts (and int8's quantizations) inserted for it (``meta["precision_for"]``)
   and, for a fused node, its fused partners. A lowered node keeps the fastest of the
   three, a lower precision only when 5% faster than the fastest higher one (reason:
   both times). Per-node times miss what a mix costs between nodes (a precision
   boundary's casts and quantizations charged to one side, the layouts and caches a
   uniform chain keeps), so the timed choice is raced end to end against the choice
   the gate gave (`_Builder.race`), and the gate's choice comes back when it is 5% faster
   (ResNet-50 at batch 1 on a loaded host, `bench/peers.py --precision`: the timed mix
   29.9 ms a call where ``opencann.quantize``'s all-int8 took 16.5).
4. Outputs re-checked on ``data`` (default: the example inputs) against eager: by the
   gate's rules 1-2 (NaN/Inf positions, cosine; the error-ratio rule judges ops, see
   `tune_gate`) or by the user's ``budget`` callable. While they fail, the lowered node
   with the worst own error goes up one candidate (int8 -> bf16 -> fp32; reason: "outputs").
5. End to end (timing on): the graph with every lowest-candidate node one higher (int8 ->
   bf16) raced against the choice (`_Search.raise_lowest`); it is kept when `TIME_MARGIN`
   faster and its outputs pass. Then the choice against all-fp32 (`_Search.result`).

Candidates are a name plus how to apply them to a set of nodes (`Candidate`);
`CANDIDATES` holds fp32, bf16, fp16 and int8. int8 (`opencann.tools.tune_int8`) is static
post-training quantization: the convolutions and linears with constant weights only (any
other node's int8 verdict fails with the reason), calibrated on ``calibration`` (default:
``data``, else the example inputs) through the all-fp32 compile; its own error is the op
on eager's inputs with uint8 x and per-channel int8 weights. A node the search gives
int8 that the ``quantize_int8`` pass then leaves in fp32 is reported in fp32 with the
reason.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.utils._pytree as pytree

from ..devices import parse_device
from . import tune_int8
from .compare import Session, check_judgeable, metrics
from .tune_gate import COSINE_FAIL, Verdict, msprobe_gate

#: the faster candidate must beat the slower one by this fraction to be kept
TIME_MARGIN = 0.05


def _cast_emulate(dtype: torch.dtype):
    """An `Candidate.emulate` that runs ``target`` on its float tensor arguments cast to
    ``dtype`` (what the engine's Cast nodes do) and returns (result as fp32, the same op
    in fp32 on the rounded inputs)."""
    def run(target, args, kwargs):
        def low(x):
            return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        def up(x):
            return low(x).float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        a, k = pytree.tree_map(low, (args, kwargs))
        out = target(*a, **k)
        a, k = pytree.tree_map(up, (args, kwargs))
        same = target(*a, **k)
        first = (lambda r: r[0] if isinstance(r, (tuple, list)) else r)
        return first(out).float(), first(same).float()
    return run


@dataclass(frozen=True)
class Candidate:
    """A precision the search may give a node: ``name`` (what `TuneResult.precision`
    and the options say), ``dtype`` (the gate's error-ratio bounds), ``apply(options,
    nodes) -> options`` (compile options that run ``nodes`` in it; default:
    ``node_precision``), ``emulate(target, args, kwargs) -> (result, same-input fp32
    result)`` (one op on eager's inputs, for its own error; None: judged only through the
    outputs) and ``applies(fx_node, exported_program) -> str`` (why the candidate cannot
    run a node, "" when it can; None: it runs every candidate node)."""

    name: str
    dtype: torch.dtype
    apply: Optional[Callable[[Dict[str, Any], Sequence[str]], Dict[str, Any]]] = None
    emulate: Optional[Callable] = None
    applies: Optional[Callable] = None

    def options(self, options: Dict[str, Any], nodes: Sequence[str]) -> Dict[str, Any]:
        """``options`` with ``nodes`` run in this precision (a new dict)."""
        if self.apply is not None:
            return self.apply(dict(options), list(nodes))
        out = dict(options)
        out["node_precision"] = {**(out.get("node_precision") or {}), **{n: self.name for n in nodes}}
        return out


CANDIDATES: Dict[str, Candidate] = {
    "fp32": Candidate("fp32", torch.float32),
    "bf16": Candidate("bf16", torch.bfloat16, emulate=_cast_emulate(torch.bfloat16)),
    "fp16": Candidate("fp16", torch.float16, emulate=_cast_emulate(torch.float16)),
    "int8": Candidate("int8", torch.int8, emulate=tune_int8.emulate, applies=tune_int8.applies),
}


@dataclass
class NodeChoice:
    """One candidate node: its ``name``, ``op`` (IR op type), ``module`` and ``source``,
    the chosen ``precision``, ``own`` (candidate name -> the gate's `Verdict` on its own
    error), ``seconds`` (candidate name -> its measured time incl. its casts, s) and, when
    kept higher than the lowest candidate, ``why`` (the gate or step that kept it)."""

    name: str
    op: str
    module: str = ""
    source: str = ""
    reads: str = ""   # the FX node of its activation input: siblings reading one x merge (QKV)
    precision: str = "fp32"
    own: Dict[str, Verdict] = field(default_factory=dict)
    seconds: Dict[str, float] = field(default_factory=dict)
    why: str = ""


@dataclass
class TuneResult:
    """What `tune` chose: ``nodes`` (name -> `NodeChoice`), ``outputs`` (per output: the
    metrics against eager on each data item), ``fp32_ms`` / ``tuned_ms`` (median call
    time, ms), ``compiled`` (the `CompiledModel` with the choice applied), ``candidates``,
    ``budget`` ("msprobe" or the metric's name), ``seconds`` (search time)."""

    nodes: Dict[str, NodeChoice]
    candidates: Tuple[str, ...]
    budget: str
    outputs: List[Dict[str, Any]] = field(default_factory=list)
    fp32_ms: float = 0.0
    tuned_ms: float = 0.0
    seconds: float = 0.0
    options: Dict[str, Any] = field(default_factory=dict)
    compiled: Any = None

    @property
    def precision(self) -> Dict[str, str]:
        """Node name -> chosen candidate name."""
        return {n: c.precision for n, c in self.nodes.items()}

    @property
    def kept(self) -> Dict[str, str]:
        """Node name -> why it runs above the lowest candidate (the failed gate, timing
        or the output check), for the nodes that do."""
        return {n: c.why for n, c in self.nodes.items() if c.why}

    @property
    def speedup(self) -> float:
        """All-fp32 compiled call time / tuned call time (same process, medians)."""
        return self.fp32_ms / self.tuned_ms if self.tuned_ms > 0 else 0.0

    def keep_dtype(self) -> List[str]:
        """The nodes run in fp32 (CANN ``--keep_dtype`` file lines), in graph order."""
        return [n for n, c in self.nodes.items() if c.precision == "fp32"]

    def mixlist(self) -> Tuple[List[str], List[str]]:
        """(op types whose every candidate node runs in fp32, op types whose every one is
        lowered): the per-op-type approximation of the choice that CANN's
        ``--modify_mixlist`` black and white lists can say."""
        by_op: Dict[str, set] = {}
        for c in self.nodes.values():
            by_op.setdefault(c.op, set()).add(c.precision == "fp32")
        keep = sorted(op for op, s in by_op.items() if s == {True})
        lower = sorted(op for op, s in by_op.items() if s == {False})
        return keep, lower

    def export(self, keep_dtype: Optional[str] = None, modify_mixlist: Optional[str] = None) -> None:
        """Write CANN's ``--keep_dtype`` file (`keep_dtype`, one node name per line) and / or
        ``--modify_mixlist`` JSON (`mixlist`); ``opencann atc --keep_dtype F --modify_mixlist
        M --precision_mode allow_mix_precision_bf16`` reads them back. OSError when a path
        cannot be written."""
        from .precision_files import write_keep_dtype, write_mixlist
        if keep_dtype:
            write_keep_dtype(keep_dtype, self.keep_dtype())
        if modify_mixlist:
            write_mixlist(modify_mixlist, *self.mixlist())

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able summary (what the model file's report keeps under ``precision``)."""
        return {"candidates": list(self.candidates), "budget": self.budget,
                "speedup": round(self.speedup, 4), "fp32_ms": round(self.fp32_ms, 4),
                "tuned_ms": round(self.tuned_ms, 4), "search_seconds": round(self.seconds, 2),
                "options": self.options, "outputs": self.outputs,
                "nodes": {n: {"op": c.op, "module": c.module, "source": c.source,
                              "precision": c.precision, "why": c.why,
                              "seconds": {k: round(v, 9) for k, v in c.seconds.items()},
                              "own": {k: {"passed": v.passed, "rule": v.rule, "detail": v.detail,
                                          "cosine": v.cosine, "max_abs": v.max_abs}
                                      for k, v in c.own.items()}}
                          for n, c in self.nodes.items()}}

    def summary(self) -> str:
        """A few lines: speed-up, counts per precision, the kept nodes and why."""
        counts: Dict[str, int] = {}
        for c in self.nodes.values():
            counts[c.precision] = counts.get(c.precision, 0) + 1
        lines = [f"tuned ({self.budget} gate, candidates {', '.join(self.candidates)}): "
                 f"{', '.join(f'{v} {k}' for k, v in counts.items()) or 'no candidate nodes'}; "
                 f"{self.speedup:.2f}x over fp32 ({self.fp32_ms:.3g} -> {self.tuned_ms:.3g} ms)"]
        lines += [f"  kept {n} ({self.nodes[n].op}) in {self.nodes[n].precision}: {w}"
                  for n, w in self.kept.items()]
        return "\n".join(lines)


def _check_args(candidates, budget, data, time_budget_s) -> List[Candidate]:
    """The `Candidate` objects of ``candidates``; ValueError (one line) for bad arguments."""
    if isinstance(candidates, str) or not candidates:
        raise ValueError(f"candidates takes a list of precisions such as ('fp32', 'bf16'), "
                         f"got {candidates!r}")
    out = []
    for c in candidates:
        if isinstance(c, Candidate):
            out.append(c)
        elif c in CANDIDATES:
            out.append(CANDIDATES[c])
        else:
            raise ValueError(f"unknown candidate precision {c!r}; use {sorted(CANDIDATES)} or "
                             "a opencann.tools.tune.Candidate")
    if out[0].name != "fp32":
        raise ValueError(f"candidates must start with 'fp32' (the precision a node falls back "
                         f"to), got {[c.name for c in out]}")
    if len(out) < 2:
        raise ValueError("candidates needs a lower precision after 'fp32', e.g. ('fp32', 'bf16')")
    if budget != "msprobe" and not callable(budget):
        raise ValueError(f"budget takes 'msprobe' or a callable metric(actual, expected) -> "
                         f"bool, got {budget!r}")
    if data is not None and (isinstance(data, torch.Tensor) or not isinstance(data, (list, tuple))
                             or not data):
        raise ValueError("data takes a non-empty list of input tuples (each like example_inputs)")
    if time_budget_s is not None and not time_budget_s > 0:
        raise ValueError(f"time_budget_s takes a positive number of seconds, got {time_budget_s!r}")
    return out


def _signature(item) -> List[str]:
    item = item if isinstance(item, tuple) else (item,)
    return [f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}" if isinstance(t, torch.Tensor)
            else type(t).__name__ for t in item]


def _check_data_shapes(data, args: tuple) -> None:
    """ValueError (one line) for a ``data`` item whose tensors' shapes or dtypes differ
    from ``example_inputs``' (the compiled shapes)."""
    want = _signature(args)
    for k, item in enumerate(data or ()):
        if _signature(item) != want:
            raise ValueError(f"data item {k} is ({', '.join(_signature(item))}) but example_inputs "
                             f"are ({', '.join(want)}): every data item must have the compiled "
                             f"shapes and dtypes; give data of example_inputs' shapes")


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default,
          torch.ops.aten._unsafe_view.default)


def _candidate_nodes(session: Session) -> Dict[str, NodeChoice]:
    """The FX nodes of ``session``'s program whose OpDef kind mixed precision lowers
    (`LOW_KINDS`) and that compute in fp32, by name (graph order)."""
    from ..frontend.torch.convert import source_of
    from ..ops.opdef import lookup_aten
    from ..passes.prepare.precision import LOW_KINDS
    out: Dict[str, NodeChoice] = {}
    for n in session.ep.graph.nodes:
        if n.op != "call_function":
            continue
        op = lookup_aten(n.target)
        val = n.meta.get("val")
        val = val[0] if isinstance(val, (tuple, list)) and val else val
        if op is None or op.kind not in LOW_KINDS or getattr(val, "dtype", None) != torch.float32:
            continue
        src, scope = source_of(n)
        x = next((a for a in n.args if isinstance(a, torch.fx.Node)
                  and not str(a.name).startswith(("p_", "b_", "c_"))), None)
        while x is not None and x.target in _VIEWS:   # each Linear views the hidden state itself
            x = x.args[0]
        out[n.name] = NodeChoice(n.name, op.name, scope or "", src or "",
                                 reads=f"{op.name}:{x.name}" if x is not None else "")
    return out


def _own_errors(session: Session, nodes: Dict[str, NodeChoice], cands: List[Candidate]) -> None:
    """Fill each node's ``own`` verdicts: its op run by each candidate's ``emulate`` on
    eager's values of its inputs, judged against eager's value."""
    env: Dict[str, Any] = {}
    from torch.export.graph_signature import InputKind
    user = iter(session.flat)
    ep = session.ep
    for spec, ph in zip(ep.graph_signature.input_specs,
                        [n for n in ep.graph.nodes if n.op == "placeholder"]):
        if spec.kind == InputKind.USER_INPUT:
            env[ph.name] = next(user)
        elif spec.target in ep.state_dict:
            env[ph.name] = ep.state_dict[spec.target]
        elif spec.target in ep.constants:
            env[ph.name] = ep.constants[spec.target]
    env.update(session.eager)
    for n in ep.graph.nodes:
        if n.name not in nodes:
            continue
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: env[a.name])
        ref = session.eager[n.name]
        for c in cands[1:]:
            why = c.applies(n, ep) if c.applies is not None else ""
            if why:
                nodes[n.name].own[c.name] = Verdict(False, "applies", why)
                continue
            if c.emulate is None:
                continue
            with torch.no_grad():
                got = c.emulate(n.target, args, kwargs)
            if got is None:
                nodes[n.name].own[c.name] = Verdict(False, "applies", f"{c.name} cannot run these operands")
                continue
            nodes[n.name].own[c.name] = msprobe_gate(got[0], ref, c.dtype, got[1])


def _charge(graph, names) -> Dict[str, str]:
    """Final-graph node name -> the candidate node it is charged to: a Cast's
    ``meta["precision_for"]``, else the longest candidate name that the node's name
    starts with (fusion names a fused node after its root: ``addmm_1_relu``)."""
    by_len = sorted(names, key=len, reverse=True)
    out = {}
    for n in graph.nodes:
        target = n.meta.get("precision_for")
        if target in names:
            out[n.name] = target
            continue
        for c in by_len:
            if n.name == c or n.name.startswith(c + "_") and not n.name[len(c) + 1:][:1].isdigit():
                out[n.name] = c
                break
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
        interleaved (`_race`)."""
        ea, eb = self.executor(a), self.executor(b)
        return _race(lambda: ea.run(self.inputs), lambda: eb.run(self.inputs))

    def node_times(self, options: Dict[str, Any], names) -> Dict[str, float]:
        """Candidate node name -> seconds charged to it under ``options`` (`_charge`)."""
        ex = self.executor(options)
        secs = ex.node_seconds(self.inputs, reps=self.reps)
        charge = _charge(ex.graph, names)
        out = {n: 0.0 for n in names}
        for node, s in secs.items():
            if node in charge:
                out[charge[node]] += s
        return out


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
            ok = _metric_verdict(budget(got, ref), budget)
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


def tune(model: torch.nn.Module, example_inputs, *, budget: Union[str, Callable] = "msprobe",
         data: Optional[Sequence[Any]] = None, candidates: Sequence[Any] = ("fp32", "bf16"),
         time_budget_s: Optional[float] = 120.0, device: str = "cpu", seed: int = 0,
         timing: bool = True, reps: int = 3, calibration: Optional[Sequence[Any]] = None) -> TuneResult:
    """Search the precision of each matmul / conv / attention node of ``model`` (an
    ``nn.Module``) on ``example_inputs`` (a tensor or tuple; the shapes compiled and
    timed) and compile the result.

    ``budget``: "msprobe" (the gate of `opencann.tools.tune_gate` on each node's own
    error, and on the outputs its NaN/Inf and cosine <= 0.99 rules) or a callable
    ``metric(actual_outputs, eager_outputs) -> bool`` judging the outputs on ``data``
    instead (each node's own error is still measured and reported). ``data``: a list of
    input tuples the outputs are checked on (default: ``[example_inputs]``).
    ``candidates``: precision names from `CANDIDATES` or `Candidate` objects, highest
    first, starting with "fp32". ``time_budget_s``: the search stops lowering more
    (timing, output fixes) past it; None: no limit. ``timing``: False skips the timing
    step (keeps every node that passes the gate low). ``seed`` seeds torch's generator.
    ``reps``: timed runs per configuration (the least counts). ``calibration``: batches
    (input tuples of the example's shapes) calibrating the "int8" candidate's activations
    (default: ``data``, else ``[example_inputs]``); unused without "int8".

    Returns a `TuneResult` whose ``compiled`` is the `CompiledModel` with the choice
    applied (its report's ``precision`` holds `TuneResult.to_dict`; saved by
    ``opencann.save``). Raises ValueError (one line) for bad arguments (a ``data`` item of
    other shapes than ``example_inputs`` included), TypeError for a model that is no
    ``nn.Module``, CaptureError /
    ConversionError like ``opencann.compile``."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tune takes a torch.nn.Module, got {type(model).__name__}; wrap a "
                        f"function in an nn.Module whose forward calls it")
    cands = _check_args(candidates, budget, data, time_budget_s)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    _check_data_shapes(data, args)
    model = model.eval()
    session = Session(model, args)
    nodes = _candidate_nodes(session)
    has_bf16 = any(c.name == "bf16" for c in cands)     # int8 linears then read and write bf16
    bf16 = [n for n, c in nodes.items() if c.op.startswith("MatMul")] if has_bf16 else []
    cands = [_calibrate_int8(c, model, args, nodes, calibration or data, device, bf16)
             if c.name == "int8" and c.apply is None else c for c in cands]
    _own_errors(session, nodes, cands)
    search = _Search(model, args, nodes, cands, _Builder(session, device, reps))
    search.by_gate(callable(budget))
    if timing:
        search.drop_slow()
    over = (lambda: time_budget_s is not None and time.perf_counter() - t0 > time_budget_s)
    checks = list(data) if data is not None else [args]
    ok, why, outs = search.fix_outputs(checks, budget, over)
    if timing and ok:
        search.raise_lowest(checks, budget, outs)
    res = search.result(budget, outs, timing)
    res.seconds = time.perf_counter() - t0
    if not ok:
        res.outputs.append({"failed": why})
    res.compiled.report.precision = res.to_dict()
    return res


def _calibrate_int8(cand: Candidate, model, args, nodes: Dict[str, NodeChoice], batches, device,
                    bf16_io: Sequence[str] = ()) -> Candidate:
    """The int8 candidate with its calibration: the all-fp32 compile of ``model`` run on
    ``batches`` (default ``[args]``; `opencann.engine.quantize.calibrate`). ``bf16_io``:
    the linear nodes whose activations int8 keeps in bf16 (`tune_int8.calibrated`)."""
    from ..engine import compile_module
    from ..engine.quantize import TARGETS, calibrate
    if parse_device(device).kind == "vnpu":     # its int8 layers are the unfused Cube ops: no records here
        raise ValueError(f"the int8 candidate of tune is not searched on {device} (its calibration reads the "
                         f"CPU's fused layers). Fix: drop 'int8' from candidates, or quantize the whole model "
                         f"with opencann.quantize(model, batches, device={device!r})")
    fp32 = compile_module(model, args, device, {})
    items = [b if isinstance(b, tuple) else (b,) for b in (batches or [args])]
    records = calibrate(fp32, items)
    scopes = {n.name: n.scope for n in fp32.graph.nodes if n.op in TARGETS}
    return tune_int8.calibrated(cand, records, scopes, {n: c.module for n, c in nodes.items()}, bf16_io)


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
            self.nodes[n].seconds["fp32"] = high[n]
            if self.choice[n] != "fp32":
                self.nodes[n].seconds[self.choice[n]] = low[n]
            if above[n] != "fp32":
                self.nodes[n].seconds[above[n]] = mid[n]
        for group in self.groups():
            p = self.choice[group[0]]
            if p == "fp32":
                continue
            q = above[group[0]] if len({above[n] for n in group}) == 1 else "fp32"
            tried = [("fp32", sum(high[n] for n in group))]
            if q != "fp32":
                tried.append((q, sum(mid[n] for n in group)))
            tried.append((p, sum(low[n] for n in group)))
            best, bt = tried[0]
            for name, t in tried[1:]:
                if t > 0 and bt > 0 and t < bt * (1 - TIME_MARGIN):
                    best, bt = name, t
            if best == p:
                continue
            what = f" (with {', '.join(group[1:])})" if len(group) > 1 else ""
            lo = tried[-1][1]
            for n in group:
                self.nodes[n].why = (f"timing{what}: {p} {lo * 1e6:.1f} us incl. casts, not "
                                     f"{TIME_MARGIN:.0%} under {best}'s {bt * 1e6:.1f} us")
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
        low_ms, high_ms = _race(lambda: self.compiled(*self.args), lambda: other(*self.args))
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
        """The `TuneResult` of the current choice, both call times measured (interleaved,
        the least of `END_TO_END_ROUNDS`); with ``timing``, a choice not faster than
        all-fp32 end to end is dropped for all-fp32, each node saying so."""
        from ..engine import compile_module
        fp32 = self.builder.executor(self.options_of({n: "fp32" for n in self.names}))
        fp32_ms, tuned_ms = _race(lambda: fp32.run(self.builder.inputs),
                                  lambda: self.compiled(*self.args))
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
            if self.choice[n] == "int8" and not ran.get(self.nodes[n].module):
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


END_TO_END_ROUNDS = 5


def _race(a: Callable, b: Callable) -> Tuple[float, float]:
    """Least call time (ms) of ``a`` and of ``b`` over `END_TO_END_ROUNDS` rounds, each
    round calling both in turn (a burst of load on a shared host hits both) after one
    warm-up call each."""
    best = [float("inf"), float("inf")]
    with torch.no_grad():
        a(), b()
        for _ in range(END_TO_END_ROUNDS):
            for i, fn in enumerate((a, b)):
                t = time.perf_counter()
                fn()
                best[i] = min(best[i], (time.perf_counter() - t) * 1e3)
    return best[0], best[1]


__all__ = ["CANDIDATES", "Candidate", "NodeChoice", "TuneResult", "tune"]
