"""Per-node precision search (``opencann.tune``): the fastest mix of precisions whose
results pass an accuracy gate, as AMCT / OpenVINO's accuracy-aware tuning do per layer.

    res = opencann.tune(model, (x,))               # candidates fp32 and bf16, msprobe's gate
    res.precision            # node name -> "fp32" / "bf16"
    res.kept                 # node name -> why it stays in higher precision (the gate it failed)
    res.speedup              # call time of all-fp32 / tuned, both compiled models raced alike
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
   includes the Casts inserted for it (``meta["precision_for"]``) and every compiled node
   that does its work (`opencann.ir.traced_names`, recorded by the fusion passes: a fused
   node, int8's quantizations), shared equally where one does several nodes' work. A
   lowered node keeps the fastest of the three, a lower precision only when 5% faster than
   the fastest higher one (reason: both times); a precision with no measured time for it
   is left out and named in the reason. Per-node times miss what a mix costs between nodes (a precision
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
   faster and its outputs pass. Then the choice against all-fp32 (`_Search.result`: both
   compiled models called alike, `race_models`).

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

import contextlib
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch

from ..devices import parse_device
from . import tune_int8
from .compare import Session
from .tune_gate import Verdict, msprobe_gate
from .tune_result import CANDIDATES, Candidate, NodeChoice, TuneResult
from .tune_search import TIME_MARGIN, _Builder, _Search


def check_candidates(candidates, what: str = "candidates") -> List[Candidate]:
    """The `Candidate` objects of ``candidates`` (names from `CANDIDATES` or `Candidate`
    objects, highest first); ValueError (one line, starting with ``what``) for a string or
    an empty sequence, an empty or unknown name (the line names it and lists the valid
    ones), a name given twice, a first one other than 'fp32' or no lower one after it."""
    valid = ", ".join(sorted(CANDIDATES))
    if not isinstance(candidates, (str, bytes, dict)) and isinstance(candidates, Iterable):
        candidates = list(candidates)
    if not isinstance(candidates, list) or not candidates:
        raise ValueError(f"{what} takes a list of precisions such as ('fp32', 'bf16') (valid: {valid}), "
                         f"got {candidates!r:.80}")
    out: List[Candidate] = []
    for k, c in enumerate(candidates):
        if isinstance(c, Candidate):
            out.append(c)
        elif isinstance(c, str) and c in CANDIDATES:
            out.append(CANDIDATES[c])
        else:
            name = "an empty candidate name" if c == "" else f"unknown candidate precision {c!r:.40}"
            raise ValueError(f"{what}: {name} at position {k + 1}; valid: {valid} "
                             f"(or a opencann.tools.tune.Candidate), e.g. fp32,bf16")
    names = [c.name for c in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{what}: {', '.join(map(repr, twice))} given twice in {names}; name each "
                         f"precision once, highest first, e.g. fp32,bf16,int8")
    if names[0] != "fp32":
        raise ValueError(f"{what} must start with 'fp32' (the precision a node falls back "
                         f"to), got {names}")
    if len(out) < 2:
        raise ValueError(f"{what} needs a lower precision after 'fp32' (valid: {valid}), e.g. fp32,bf16")
    return out


def _check_args(candidates, budget, data, time_budget_s) -> List[Candidate]:
    """The `Candidate` objects of ``candidates`` (`check_candidates`); ValueError (one
    line) for bad arguments."""
    out = check_candidates(candidates)
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
    instead (each node's own error is still measured and reported; an exception it
    raises comes through as raised, with a note naming it and the data item). ``data``: a list of
    input tuples the outputs are checked on (default: ``[example_inputs]``).
    ``candidates``: precision names from `CANDIDATES` or `Candidate` objects, highest
    first, starting with "fp32". ``time_budget_s``: the search stops lowering more
    (timing, output fixes) past it; None: no limit. ``timing``: False skips the timing
    step (keeps every node that passes the gate low). ``seed`` seeds torch's generator.
    ``reps``: timed runs per configuration (the least counts). ``calibration``: batches
    (input tuples of the example's shapes) calibrating the "int8" candidate's activations
    (default None: ``data``, else ``[example_inputs]``; an empty list is refused, as by
    ``opencann.quantize``); unused without "int8".

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
    with _eval_mode(model):
        return _search_and_compile(model, args, cands, budget, data, time_budget_s, device, timing,
                                   reps, calibration, t0)


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module):
    """``model`` in eval mode (eager's inference outputs are the reference) for the block,
    every submodule's ``training`` flag given back afterwards: tune leaves the caller's
    module as it found it (it used to leave it in eval mode)."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, was in flags:
            m.training = was


def _search_and_compile(model, args, cands, budget, data, time_budget_s, device, timing, reps,
                        calibration, t0) -> TuneResult:
    """`tune`'s steps on the eval-mode ``model`` (arguments checked), started at ``t0``."""
    session = Session(model, args)
    nodes = _candidate_nodes(session)
    has_bf16 = any(c.name == "bf16" for c in cands)     # int8 linears then read and write bf16
    bf16 = [n for n, c in nodes.items() if c.op.startswith("MatMul")] if has_bf16 else []
    cands = [_calibrate_int8(c, model, args, nodes, data if calibration is None else calibration, device, bf16)
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
    if isinstance(batches, (torch.Tensor, tuple)):    # one batch, as opencann.quantize takes it
        batches = [batches]
    batches = list(batches) if isinstance(batches, Iterable) and not isinstance(batches, (str, dict)) \
        else [args] if batches is None else []
    if not batches:
        raise ValueError("calibration takes a non-empty list of batches (each a tensor or a tuple like "
                         "example_inputs), e.g. [x1, x2]; None calibrates on data, else the example inputs")
    fp32 = compile_module(model, args, device, {})
    items = [b if isinstance(b, tuple) else (b,) for b in batches]
    records = calibrate(fp32, items)
    from ..ir import traced_names
    scopes = {n.name: n.scope for n in fp32.graph.nodes if n.op in TARGETS}
    traced = [s for n in fp32.graph.nodes if n.op in TARGETS and n.name in records for s in traced_names(n)]
    return tune_int8.calibrated(cand, records, scopes, {n: c.module for n, c in nodes.items()}, bf16_io,
                                traced)


__all__ = ["CANDIDATES", "TIME_MARGIN", "Candidate", "NodeChoice", "TuneResult", "check_candidates", "tune"]
