"""Where a compiled CNN's call goes, convolution by convolution: the step each
convolution node takes in the call (`Executor.node_seconds`) split into oneDNN's own
execution of the primitive (``ONEDNN_VERBOSE``'s exec time, in the call), torch's fixed
cost per ``mkldnn._convolution_pointwise`` call (the op alone in a loop minus oneDNN's
execution in that loop: primitive-cache lookup, descriptors, scratchpad and output
allocation), the separate ReLU passes (the call against the same executor with its
convolutions bound without them, interleaved; and each ``torch.relu_`` alone), and what
is left in the call (the bound kernel's and the generated code's Python, caches, OpenMP
wake-ups between kernels); then the other nodes, the call's own cost (guards, outputs),
the reorders in the call (``ONEDNN_VERBOSE``: there should be none) and the page faults a
call takes (``ru_minflt``: kernel-allocated outputs malloc maps afresh).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/conv_account.py --batch 1 --rounds 15
    .venv/bin/python bench/conv_account.py --peer      # + OpenVINO's per-layer times
    .venv/bin/python bench/conv_account.py --relu-post-ops   # why ReLU is not a post-op
    .venv/bin/python bench/conv_account.py --fixed-cost --threads 1
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/conv_account.py --precision int8 --batch 1

``--precision bf16`` / ``int8`` accounts for the reduced-precision call instead (bf16:
``allow_mix_precision_bf16``; int8: ``opencann.quantize`` calibrated as
``bench/precision.py`` does): the sum of oneDNN's convolution primitives in the call
against each alone and hot (the ideal: every convolution at oneDNN's AMX rate), each
bound convolution kernel alone less its primitive (torch's fixed cost per op call and
the kernel's Python), the ReLU passes (bf16), the other nodes by op, the executor and
the call's own cost; then what ``ONEDNN_VERBOSE`` shows: the implementations (AMX or
not), reorders, and the layouts and dtypes each convolution reads and writes.

``--peer`` adds OpenVINO f32 (``PERF_COUNT``: per-layer real time) in the same rounds,
its convolutions (with their fused ReLU / Add) against ours. ``--relu-post-ops`` prints
what each oneDNN ReLU post-op variant torch can reach gives for NaN, +inf and -inf
against eager's ``relu``.

Every figure is the least over ``--rounds`` interleaved rounds (each round: one timed
call per node, then each convolution's pieces in turn), so on a loaded host they are
the least disturbed times, not typical ones. Prints a Markdown table (ms per call).
"""
from __future__ import annotations

import argparse
import collections
import os
import resource
import sys
import tempfile
import time
import types
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import opencann  # noqa: E402
from opencann import zoo  # noqa: E402
from opencann.ir import TensorDesc  # noqa: E402
from opencann.ops.kernels.cpu import ConvWeightPacks, make_conv_kernel  # noqa: E402

CONVS = ("ConvBiasAct", "ConvAddAct")
QCONVS = CONVS + ("QuantConvBiasAct", "QuantConvAddAct")


def _ns(f: Callable[[], object]) -> int:
    t0 = time.perf_counter_ns()
    f()
    return time.perf_counter_ns() - t0


def _verbose_exec_ms(run: Callable[[], object], calls: int) -> List[List[tuple]]:
    """oneDNN's verbose exec lines of ``calls`` runs of ``run``: per run, (primitive kind,
    implementation, shape, ms, memory descriptors) in execution order (stdout captured at
    the descriptor)."""
    fd, path = tempfile.mkstemp()
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(fd, 1)
    try:
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
            for _ in range(calls):
                run()
                print("=====", flush=True)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(fd)
    with open(path) as f:
        text = f.read()
    os.unlink(path)
    runs = []
    for chunk in text.split("=====")[:calls]:
        ex = [ln.split(",") for ln in chunk.splitlines() if ",exec," in ln]
        runs.append([(e[5], e[6], e[-2], float(e[-1]), e[8]) for e in ex])
    return runs


def _conv_pieces(node, vals: Dict[int, torch.Tensor]) -> Dict[str, Callable]:
    """The callables timed per convolution node: the torch op alone (no activation) and
    the ReLU pass alone, on copies of the node's real inputs."""
    a = node.attrs
    x = vals[node.inputs[0].id]
    w = node.inputs[1].const
    bias = node.inputs[2].const if len(node.inputs) > 2 and node.inputs[2].is_const else None
    wp = ConvWeightPacks(node, node.inputs[0].desc, w).get()
    cv = (a["padding"], a["stride"], a["dilation"], a["groups"])
    if node.op == "ConvBiasAct":
        def op():
            return torch.ops.mkldnn._convolution_pointwise(x, wp, bias, *cv, "none", [], "")
    else:
        other = vals[node.inputs[-1].id].clone(memory_format=torch.preserve_format)

        def op():
            return torch.ops.mkldnn._convolution_pointwise_.binary(
                other, x, wp, bias, *cv, "add", None, None, [], "")
    y = op().clone(memory_format=torch.preserve_format)
    pieces = {"op": op}
    if a["act"] == "relu":
        pieces["relu"] = lambda: torch.relu_(y)
    return pieces


def _without_relu(node) -> Callable:
    """The kernel of a ConvBiasAct / ConvAddAct node with ``act`` relu, bound without its
    ReLU pass (timing only: the values differ)."""
    bare = types.SimpleNamespace(op=node.op, attrs={**node.attrs, "act": "none"}, meta=dict(node.meta))
    return make_conv_kernel(bare, [v.desc for v in node.inputs], [v.const for v in node.inputs])


def relu_post_ops() -> List[str]:
    """One line per oneDNN ReLU post-op variant reachable through torch
    (``mkldnn._convolution_pointwise`` unary ``relu``, ``leaky_relu(0)``, ``hardtanh(0,
    inf)``; ``.binary`` add + ``relu`` in and out of place): its result for a
    pre-activation of NaN, +inf, -inf, -1 and 1 (a depthwise identity 1x1 convolution,
    addend 0) next to eager's ``relu``."""
    c = 16
    x = torch.zeros(1, c, 1, 5)
    x[0, :, 0] = torch.tensor([float("nan"), float("inf"), float("-inf"), -1.0, 1.0])
    x = x.contiguous(memory_format=torch.channels_last)
    w = torch.ones(c, 1, 1, 1)
    cv = ([0, 0], [1, 1], [1, 1], c)
    zero = torch.zeros_like(x)
    conv = torch.ops.mkldnn._convolution_pointwise
    variants = {
        "eager relu": lambda: torch.relu(x),
        "relu post-op": lambda: conv(x, w, None, *cv, "relu", [], ""),
        "leaky_relu(0) post-op": lambda: conv(x, w, None, *cv, "leaky_relu", [0.0], ""),
        "hardtanh(0, inf) post-op": lambda: conv(x, w, None, *cv, "hardtanh", [0.0, float("inf")], ""),
        "sum + relu post-ops (in place)": lambda: torch.ops.mkldnn._convolution_pointwise_.binary(
            zero.clone(), x, w, None, *cv, "add", None, "relu", [], ""),
    }
    return [f"{k}: {[float(v) for v in f()[0, 0, 0]]}" for k, f in variants.items()]


def fixed_cost(calls: int = 3000) -> Dict[str, float]:
    """µs per call (least of ``calls``, interleaved) of a 64→64 1×1 convolution at 2×2,
    channels-last: ``op`` (``mkldnn._convolution_pointwise`` on the packed weight),
    ``oneDNN exec`` (its primitive, ``ONEDNN_VERBOSE``), ``bound kernel`` (our
    ConvBiasAct kernel with ReLU) and ``op + relu_`` (the same two calls made directly)."""
    x = torch.randn(1, 64, 2, 2).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(64, 64, 1, 1), torch.randn(64)
    attrs = dict(padding=[0, 0], stride=[1, 1], dilation=[1, 1], groups=1, act="relu")
    node = types.SimpleNamespace(op="ConvBiasAct", attrs=attrs, meta={})
    descs = [TensorDesc.of(x), TensorDesc.of(w), TensorDesc.of(b)]
    kernel = make_conv_kernel(node, descs, [None, w, b])
    wp = ConvWeightPacks(node, descs[0], w).get()
    conv = torch.ops.mkldnn._convolution_pointwise
    fs = {"op": lambda: conv(x, wp, b, [0, 0], [1, 1], [1, 1], 1, "none", [], ""),
          "bound kernel": lambda: kernel(x, w, b),
          "op + relu_": lambda: torch.relu_(conv(x, wp, b, [0, 0], [1, 1], [1, 1], 1, "none", [], ""))}
    best = {k: float("inf") for k in fs}
    for _ in range(calls):
        for k, f in fs.items():
            best[k] = min(best[k], _ns(f) / 1e3)
    runs = _verbose_exec_ms(fs["op"], min(calls, 200))
    best["oneDNN exec"] = min(r[-1][3] for r in runs) * 1e3
    return best


def _openvino(model, inputs, threads: int):
    """(run, per-layer times) of OpenVINO f32 on ``model`` (bench/peers.py's settings);
    ``times()`` -> [(layer type, exec type, ms)] of the last run, executed layers only."""
    import tempfile as tf
    import peers
    work = tf.mkdtemp(prefix="opencann-conv-account-")
    path = peers.export_onnx(model, inputs, os.path.join(work, "model.onnx"))
    run, req = peers.ov_runner(peers.ov_compiled(path, threads, perf_counters=True), inputs)

    def times():
        return [(p.node_type, p.exec_type, p.real_time.total_seconds() * 1e3)
                for p in req.profiling_info if p.status.name == "EXECUTED"]
    return run, times


def _node_values(cm, x: torch.Tensor) -> tuple:
    """(executor, graph, {value id: a copy of it}) of one call of ``cm`` on ``x``: every
    node's output as the call made it (layout kept), the input included."""
    ex = cm.shapes.executor
    g = ex.graph
    vals: Dict[int, torch.Tensor] = {}

    def keep(node, outs):
        for v, t in zip(node.outputs, outs):
            if isinstance(t, torch.Tensor):
                vals[v.id] = t.clone(memory_format=torch.preserve_format)
    with torch.no_grad():
        ex.run_observed([x], keep)
    vals[g.inputs[0].id] = x
    return ex, g, vals


def _timers(ex, relus: List[tuple]) -> tuple:
    """(a clone of executor ``ex`` whose nodes ``relus`` ((index, node) pairs) skip their
    ReLU pass: wrong values, right timing; ``best``: key -> least ms seen; ``least(key,
    f)``: time ``f`` once into ``best``) shared by both accounts."""
    no_relu = ex.clone()
    for i, n in relus:
        no_relu._glb[f"K{i}"] = _without_relu(n)
    best: Dict[tuple, float] = collections.defaultdict(lambda: float("inf"))

    def least(key, f):
        best[key] = min(best[key], _ns(f) / 1e6)
    return no_relu, best, least


def account(batch: int, rounds: int, peer: bool = False) -> Dict[str, float]:
    """ms per call of each item (module docstring) for zoo ResNet-50 at ``batch``; with
    ``peer``, OpenVINO f32's call and per-layer-type sums too (``OpenVINO ...`` keys)."""
    z = zoo.resnet50(batch=batch)
    x = z.example_inputs[0]
    cm = opencann.compile(z.model, z.example_inputs)
    ov = _openvino(z.model, z.example_inputs, torch.get_num_threads()) if peer else None
    ov_best: Dict[int, tuple] = {}
    ex, g, vals = _node_values(cm, x)
    convs = [(i, n) for i, n in enumerate(g.nodes) if n.op in CONVS and n.meta.get("kernel") != "aten"]
    pieces = {i: _conv_pieces(n, vals) for i, n in convs}
    # the same executor without the ReLU passes (wrong values, right timing): its call
    # against the real one, interleaved, is the ReLU passes' cost in the call
    no_relu, best, least = _timers(ex, [(i, n) for i, n in convs if n.attrs["act"] == "relu"])
    prim_call: List[float] = []
    prim_alone: Dict[int, float] = {}
    kinds: collections.Counter = collections.Counter()
    faults: List[int] = []
    with torch.no_grad():
        for _ in range(3):
            cm(x)
        for _ in range(rounds):   # every item once per round: minima over like loads
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            least("call", lambda: cm(x))
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            least("run", lambda: ex.run([x]))
            least("run without ReLU", lambda: no_relu.run([x]))
            if ov is not None:
                least("OpenVINO call", ov[0])
                for k, (kind, impl, ms) in enumerate(ov[1]()):
                    if k not in ov_best or ms < ov_best[k][2]:
                        ov_best[k] = (kind, impl, ms)
            for name, s in ex.node_seconds([x], reps=1).items():
                best[("node", name)] = min(best[("node", name)], s * 1e3)
            run = _verbose_exec_ms(lambda: ex.run([x]), 1)[0]
            kinds = collections.Counter(k for k, *_ in run)
            ms = [t for k, _, _, t, _ in run if k == "convolution"]
            prim_call = [min(a, b) for a, b in zip(prim_call, ms)] if prim_call else ms
            for i, p in pieces.items():   # each piece alone, hot: the third of 3 calls
                for k, f in p.items():
                    f(), f()
                    least((k, i), f)
                p["op"](), p["op"]()
                t = _verbose_exec_ms(p["op"], 1)[0][-1][3]
                prim_alone[i] = min(prim_alone.get(i, t), t)
    conv_prim = sum(prim_call)
    prim_alone_sum = sum(prim_alone.values())
    S = lambda key: sum(best[(key, i)] for i, _ in convs if (key, i) in best)  # noqa: E731
    node_conv = sum(best[("node", n.name)] for _, n in convs)
    node_all = sum(best[("node", n.name)] for n in g.nodes)
    relu_call = best["run"] - best["run without ReLU"]
    fixed = S("op") - prim_alone_sum
    out = {
        "call": best["call"], "executor run": best["run"],
        "call less executor run (guards, outputs)": best["call"] - best["run"],
        "nodes (sum of each node's least step)": node_all, "conv nodes": node_conv,
        "oneDNN convolution primitives (in the call)": conv_prim,
        "oneDNN convolution primitives (each alone, hot)": prim_alone_sum,
        "torch op fixed cost (alone, hot)": fixed,
        "ReLU passes (in the call)": relu_call,
        "ReLU passes (each alone, hot)": S("relu"),
        "conv nodes less the above (Python, caches, thread wake-ups)": node_conv - conv_prim - fixed - relu_call,
        "reorders in the call": float(kinds.get("reorder", 0)),
        "n page faults per call (median; opencann.keep_freed_memory)": float(sorted(faults)[len(faults) // 2]),
        "other oneDNN primitives in the call": float(sum(v for k, v in kinds.items() if k not in ("convolution", "reorder"))),
        "n convolutions": float(len(convs)), "n ReLU passes": float(sum("relu" in p for p in pieces.values())),
    }
    if ov is not None:
        out["OpenVINO call"] = best["OpenVINO call"]
        for kind, impl, ms in ov_best.values():
            key = f"OpenVINO {kind} ({impl})"
            out[key] = out.get(key, 0.0) + ms
    for n in g.nodes:
        if n.op not in CONVS:
            out[f"node {n.op}"] = out.get(f"node {n.op}", 0.0) + best[("node", n.name)]
    return out


def reduced_model(zm, precision: str):
    """zoo ResNet-50 ``zm`` compiled in ``precision``: "bf16" (``allow_mix_precision_bf16``)
    or "int8" (``opencann.quantize``, calibrated on `bench/precision.py`'s batches)."""
    from precision import BF16, calibration_for
    if precision == "bf16":
        return opencann.compile(zm.model, zm.example_inputs, options={"precision_mode": BF16})
    from opencann.tools.quantize import create_quant_config
    return opencann.quantize(zm.model, calibration_for(zm), config=create_quant_config())


def _layouts(run: List[tuple]) -> List[str]:
    """One line per distinct (kind, implementation, src / dst / accumulator descriptors)
    of a verbose run, with its count: which dtypes and layouts pass between the
    primitives."""
    c: collections.Counter = collections.Counter()
    for kind, impl, _, _, mds in run:
        md = " ".join(m for m in mds.split() if m.split(":")[0] in ("src", "dst"))
        c[f"{kind} {impl} {md}"] += 1
    return [f"{n} x {k}" for k, n in c.most_common()]


def account_reduced(batch: int, rounds: int, precision: str) -> tuple:
    """(items, layout lines) of the ``precision`` ResNet-50 call at ``batch`` (module
    docstring): items in ms per call, least over ``rounds`` interleaved rounds."""
    from precision import inputs_for
    zm = inputs_for("resnet50", batch)
    x = zm.example_inputs[0]
    cm = reduced_model(zm, precision)
    ex, g, vals = _node_values(cm, x)
    convs = [(i, n) for i, n in enumerate(g.nodes) if n.op in QCONVS and n.meta.get("kernel") != "aten"]
    alone = {}
    for i, n in convs:    # each bound kernel on (copies of) its real inputs; an addend written
        ins = [v.const if v.is_const else vals[v.id].clone(memory_format=torch.preserve_format)
               for v in n.inputs]
        alone[i] = (lambda k, a: lambda: k(*a))(ex._glb[f"K{i}"], ins)   # in place stays a copy
    relus = [(i, n) for i, n in convs if n.op in CONVS and n.attrs["act"] == "relu"]
    no_relu, best, least = _timers(ex, relus)
    prim_call: List[float] = []
    prim_alone: Dict[int, float] = {}
    run: List[tuple] = []
    with torch.no_grad():
        for _ in range(3):
            cm(x)
        for _ in range(rounds):
            least("call", lambda: cm(x))
            least("run", lambda: ex.run([x]))
            if relus:
                least("run without ReLU", lambda: no_relu.run([x]))
            for name, s in ex.node_seconds([x], reps=1).items():
                best[("node", name)] = min(best[("node", name)], s * 1e3)
            run = _verbose_exec_ms(lambda: ex.run([x]), 1)[0]
            ms = [t for k, _, _, t, _ in run if k == "convolution"]
            prim_call = [min(a, b) for a, b in zip(prim_call, ms)] if prim_call else ms
            for i, f in alone.items():
                f(), f()
                least(("alone", i), f)
                t = _verbose_exec_ms(f, 1)[0][-1][3]
                prim_alone[i] = min(prim_alone.get(i, t), t)
    kinds = collections.Counter(k for k, *_ in run)
    conv_prim, ideal = sum(prim_call), sum(prim_alone.values())
    kern_alone = sum(best[("alone", i)] for i, _ in convs)
    node_conv = sum(best[("node", n.name)] for _, n in convs)
    node_all = sum(best[("node", n.name)] for n in g.nodes)
    relu_call = best["run"] - best["run without ReLU"] if relus else 0.0
    fixed = kern_alone - ideal
    out = {
        "call": best["call"], "executor run": best["run"],
        "call less executor run (guards, outputs)": best["call"] - best["run"],
        "executor run less the sum of its nodes' least steps": best["run"] - node_all,
        "conv nodes (sum of least steps)": node_conv,
        "oneDNN convolution primitives (in the call)": conv_prim,
        "oneDNN convolution primitives (each alone, hot: the ideal)": ideal,
        "bound conv kernel less its primitive (alone, hot: torch's fixed cost + Python)": fixed,
        "ReLU passes (in the call)": relu_call,
        "conv nodes less the above (caches, thread wake-ups)": node_conv - conv_prim - fixed - relu_call,
    }
    for n in g.nodes:
        if n.op not in QCONVS:
            out[f"node {n.op}"] = out.get(f"node {n.op}", 0.0) + best[("node", n.name)]
    worst = sorted(((best[("alone", i)] - prim_alone[i], n) for i, n in convs), key=lambda t: -t[0])[:3]
    for ms, n in worst:
        out[f"largest kernel-less-primitive: {n.name} ({n.op}, inplace={n.attrs.get('inplace')})"] = ms
    out.update({"n convolutions": float(len(convs)), "n ReLU passes": float(len(relus)),
                "n AMX convolutions": float(sum(1 for k, impl, *_ in run if k == "convolution" and "amx" in impl)),
                "reorders in the call": float(kinds.get("reorder", 0)),
                "n other oneDNN primitives in the call": float(sum(v for k, v in kinds.items()
                                                                   if k not in ("convolution", "reorder")))})
    return out, _layouts(run)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peer", action="store_true", help="OpenVINO f32's per-layer times too")
    ap.add_argument("--precision", choices=("fp32", "bf16", "int8"), default="fp32",
                    help="the compiled model's precision (bf16: allow_mix_precision_bf16; "
                         "int8: opencann.quantize)")
    ap.add_argument("--relu-post-ops", action="store_true",
                    help="only print the oneDNN ReLU post-ops' NaN/Inf results against eager")
    ap.add_argument("--fixed-cost", action="store_true",
                    help="only time the per-call costs on one tiny convolution (µs)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.relu_post_ops:
        print("\n".join(relu_post_ops()))
        return
    if args.fixed_cost:
        r = fixed_cost()
        print(f"64->64 1x1 conv at 2x2, {args.threads} thread(s), load {os.getloadavg()[0]:.2f}, "
              "least of 3000 calls, us: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()))
        return
    load0 = os.getloadavg()[0]
    layouts: List[str] = []
    if args.precision == "fp32":
        r = account(args.batch, args.rounds, args.peer)
    else:
        r, layouts = account_reduced(args.batch, args.rounds, args.precision)
    print(f"ResNet-50 {args.precision} batch {args.batch}, {args.threads} threads, {args.rounds} rounds, "
          f"load {load0:.2f} -> {os.getloadavg()[0]:.2f}; least per item, ms per call")
    print("| item | ms |\n|---|---|")
    for k, v in r.items():
        print(f"| {k} | {v:.0f} |" if k.startswith("n ") or k.startswith("reorders") else f"| {k} | {v:.2f} |")
    if layouts:
        print("\noneDNN primitives in one call (count x kind, implementation, src / dst):")
        print("\n".join("  " + ln for ln in layouts))


if __name__ == "__main__":
    main()
