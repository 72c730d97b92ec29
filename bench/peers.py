"""opencann side by side with its CPU peers, in one process, rounds interleaved.

Backends, all at the same thread count, fp32:
  eager          the PyTorch module itself (``torch.no_grad``)
  opencann       ``opencann.compile(model, example_inputs)``
  torch.compile  ``torch.compile(model, backend="opencann")`` under ``torch.no_grad``:
                 weights frozen into constants (the option ``freezing``, on by default;
                 the JSON records how many tensors and bytes were frozen and the rewrites
                 applied); ``--no-dynamo`` skips it
  torch.compile-nofreeze  the same with ``options={"freezing": False}`` (not in the
                 default set: ``--backends eager torch.compile torch.compile-nofreeze``)
  onnxruntime    the model exported with ``torch.onnx.export``, ``ORT_ENABLE_ALL``,
                 ``intra_op_num_threads`` = threads
  openvino       the same ONNX file, ``INFERENCE_PRECISION_HINT=f32``,
                 ``PERFORMANCE_HINT=LATENCY``, ``INFERENCE_NUM_THREADS`` = threads

Rows: ResNet-50 batch 1 and 8, BERT-base seq 128 batch 1 and 8, MiniLM seq 128 batch 1
(transformers models; ResNet-50 and BERT-base with seeded random weights, MiniLM with
its packaged real weights; nothing is downloaded). Each round times every backend
``--runs`` times, the backends' order rotating from round to round, so that a busy
machine slows all of them alike; a backend's figure is the median of all its calls.
Speed-up = eager ms / backend ms. Each backend's first output is checked against
eager's (max |a - b| / max |b|, in the JSON).

    .venv/bin/python bench/peers.py                       # all rows (several minutes)
    .venv/bin/python bench/peers.py --models resnet50 --batches 1 --rounds 3 --runs 5
    .venv/bin/python bench/peers.py --precision ...     # fp32/bf16/int8 rows, one gate
                                                        # (bench/peers_precision.py)

The peers are the optional extra ``bench`` (``pip install -e .[bench]``: onnxruntime,
openvino, onnx, onnxscript); a missing one is reported with that command and the other
backends still run. Prints a Markdown table and writes bench/results/peers.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import opencann  # noqa: E402
from opencann import zoo  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = [("resnet50", 1, None), ("resnet50", 8, None), ("bert-base", 1, 128),
        ("bert-base", 8, 128), ("minilm", 1, 128)]
BACKENDS = ("eager", "opencann", "torch.compile", "onnxruntime", "openvino")
EXTRA_BACKENDS = ("torch.compile-nofreeze",)
INSTALL = "pip install -e .[bench]"


def missing_peers() -> Dict[str, str]:
    """Peer backend -> why it cannot run (a package is missing), with the install command."""
    out = {}
    for name, mods in (("onnxruntime", ("onnxruntime", "onnx", "onnxscript")),
                       ("openvino", ("openvino", "onnx", "onnxscript"))):
        for m in mods:
            try:
                __import__(m)
            except ImportError:
                out[name] = f"{m} is not installed ({INSTALL} installs the peers)"
                break
    return out


def first_tensor(out) -> torch.Tensor:
    """The first tensor of a model's output (a transformers ModelOutput, tuple or tensor)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return first_tensor(next(iter(out.values())))
    if isinstance(out, (list, tuple)):
        return first_tensor(out[0])
    if hasattr(out, "to_tuple"):
        return first_tensor(out.to_tuple())
    raise TypeError(f"no tensor in {type(out).__name__}")


def export_onnx(model: torch.nn.Module, inputs: Tuple[torch.Tensor, ...], path: str) -> str:
    """``model`` exported with ``torch.onnx.export`` (static shapes) to ``path``."""
    import logging
    import warnings
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # torchvision-op notices
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, inputs, path, dynamo=True, external_data=False,
                          verbose=False, optimize=True)
    return path


def ort_session(path: str, threads: int, profile_prefix: Optional[str] = None):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def ort_runner(sess, inputs) -> Callable:
    names = [i.name for i in sess.get_inputs()]
    feed = {n: t.numpy() for n, t in zip(names, inputs)}
    return lambda: sess.run(None, feed)


def ov_compiled(path: str, threads: int, perf_counters: bool = False):
    import openvino as ov
    core = ov.Core()
    cfg = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY",
           "INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1}
    if perf_counters:
        cfg["PERF_COUNT"] = True
    return core.compile_model(core.read_model(path), "CPU", cfg)


def ov_runner(compiled, inputs) -> Tuple[Callable, object]:
    req = compiled.create_infer_request()
    feed = [t.numpy() for t in inputs]
    return (lambda: req.infer(feed)), req


def build(name: str, batch: int, seq: Optional[int], threads: int, backends: List[str],
          workdir: str, log=print) -> Tuple[Dict[str, Callable], Dict[str, dict], torch.Tensor]:
    """Runners (zero-argument callables) for ``backends`` on one row, with what each
    costs to build and its first output's relative error vs eager."""
    zm = zoo.get(name, batch=batch, **({"seq": seq} if seq else {}))
    model, inputs = zm.model, zm.example_inputs
    with torch.no_grad():
        ref = first_tensor(model(*inputs)).clone()
    runners: Dict[str, Callable] = {}
    info: Dict[str, dict] = {}
    onnx_path = None

    def note(b, t0, out_fn, **extra):
        out = out_fn()
        err = float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        info[b] = dict(build_s=time.perf_counter() - t0, max_rel_err=err, **extra)
        log(f"  {b}: built in {info[b]['build_s']:.1f} s, max rel err {err:.1e}")

    for b in backends:
        t0 = time.perf_counter()
        try:
            if b == "eager":
                def run_eager(m=model, x=inputs):
                    with torch.no_grad():
                        return m(*x)
                runners[b] = run_eager
                note(b, t0, lambda: first_tensor(run_eager()))
            elif b == "opencann":
                cm = opencann.compile(model, inputs)
                runners[b] = lambda cm=cm, x=inputs: cm(*x)
                note(b, t0, lambda: first_tensor(cm(*inputs)),
                     opencann_s=cm.report.opencann_seconds, rewrites_applied=len(cm.report.applied))
            elif b.startswith("torch.compile"):
                torch._dynamo.reset()
                n0 = len(opencann.dynamo.COMPILED_GRAPHS)
                cmod = torch.compile(model, backend="opencann",
                                     options={"freezing": b == "torch.compile"})

                def run_tc(m=cmod, x=inputs):
                    with torch.no_grad():
                        return m(*x)
                runners[b] = run_tc
                note(b, t0, lambda: first_tensor(run_tc()))
                info[b].update(dynamo_graphs(opencann.dynamo.COMPILED_GRAPHS[n0:]))
            elif b in ("onnxruntime", "openvino"):
                if onnx_path is None:
                    onnx_path = os.path.join(workdir, f"{name}_b{batch}.onnx")
                    if not os.path.exists(onnx_path):
                        export_onnx(model, inputs, onnx_path)
                if b == "onnxruntime":
                    sess = ort_session(onnx_path, threads)
                    runners[b] = ort_runner(sess, inputs)
                    note(b, t0, lambda: torch.from_numpy(runners[b]()[0]))
                else:
                    compiled = ov_compiled(onnx_path, threads)
                    fn, req = ov_runner(compiled, inputs)
                    runners[b] = fn
                    note(b, t0, lambda: (fn(), torch.from_numpy(
                        req.get_output_tensor(0).data.copy()))[1])
        except Exception as e:  # noqa: BLE001 - one backend failing must not stop the row
            info[b] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            runners.pop(b, None)
            log(f"  {b}: FAILED ({info[b]['error']})")
    return runners, info, ref


def dynamo_graphs(reports) -> dict:
    """What the torch.compile row compiled: graphs, frozen tensors and bytes, rewrites applied."""
    frozen = [r.torch_compile.get("frozen", {}) for r in reports]
    return dict(graphs=len(reports), frozen_tensors=sum(f.get("tensors", 0) for f in frozen),
                frozen_bytes=sum(f.get("bytes", 0) for f in frozen),
                rewrites_applied=sum(len(r.applied) for r in reports))


def interleaved(runners: Dict[str, Callable], rounds: int, runs: int, warmup: int = 2
                ) -> Dict[str, List[float]]:
    """Per backend, the wall time (ms) of each of ``rounds * runs`` calls; in each round
    every backend runs ``runs`` times in a row, the order rotating by one per round."""
    names = list(runners)
    for n in names:
        for _ in range(warmup):
            runners[n]()
    times: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            fn = runners[n]
            for _ in range(runs):
                t0 = time.perf_counter()
                fn()
                times[n].append((time.perf_counter() - t0) * 1e3)
    return times


def label(name: str, seq: Optional[int]) -> str:
    pretty = {"resnet50": "ResNet-50", "bert-base": "BERT-base", "minilm": "MiniLM"}[name]
    return f"{pretty}{f', seq {seq}' if seq else ''}"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--precision" in argv:   # every precision, one gate: bench/peers_precision.py
        import peers_precision
        return peers_precision.main([a for a in argv if a != "--precision"])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", choices=sorted({r[0] for r in ROWS}),
                    help="rows of these models only (default: all)")
    ap.add_argument("--batches", nargs="*", type=int, help="rows of these batch sizes only")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--runs", type=int, default=4,
                    help="calls per backend per round (default 4; halved, at least 1, for batch 8)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backends", nargs="*", choices=BACKENDS + EXTRA_BACKENDS,
                    default=list(BACKENDS))
    ap.add_argument("--no-dynamo", action="store_true", help="skip the torch.compile row")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "peers.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    backends = [b for b in args.backends if not (args.no_dynamo and b == "torch.compile")]
    missing = missing_peers()
    for b, why in missing.items():
        if b in backends:
            print(f"{b}: skipped, {why}")
            backends.remove(b)
    vers = {"torch": torch.__version__, "opencann": opencann.__version__}
    for m in ("onnxruntime", "openvino"):
        if m not in missing:
            vers[m] = __import__(m).__version__
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{args.threads} threads; " + ", ".join(f"{k} {v}" for k, v in vers.items()))
    rows = [r for r in ROWS if (not args.models or r[0] in args.models)
            and (not args.batches or r[1] in args.batches)]
    results = []
    with tempfile.TemporaryDirectory(prefix="opencann-peers-") as work:
        for name, batch, seq in rows:
            print(f"{label(name, seq)}, batch {batch}:", flush=True)
            runners, info, _ = build(name, batch, seq, args.threads, backends, work)
            runs = max(1, args.runs // 2) if batch > 1 else args.runs
            times = interleaved(runners, args.rounds, runs)
            med = {b: float(np.median(t)) for b, t in times.items()}
            results.append(dict(model=name, batch=batch, seq=seq, median_ms=med,
                                min_ms={b: float(min(t)) for b, t in times.items()},
                                calls=len(next(iter(times.values()), [])), backends=info))
            del runners
    print_table(results, backends)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    doc = dict(date=datetime.date.today().isoformat(), threads=args.threads,
               rounds=args.rounds, runs=args.runs, versions=vers, cpu_count=os.cpu_count(),
               command="bench/peers.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               missing=missing, rows=results)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"\nwritten to {os.path.relpath(args.out)}")


def print_table(results: List[dict], backends: List[str]) -> None:
    others = [b for b in backends if b != "eager"]
    print("\n| model | batch | eager ms | " + " | ".join(others) + " |")
    print("|---|---|---|" + "---|" * len(others))
    for r in results:
        med = r["median_ms"]
        e = med.get("eager")
        cells = []
        for b in others:
            if b not in med:
                cells.append("failed" if "error" in r["backends"].get(b, {}) else "-")
            else:
                cells.append(f"{med[b]:.1f} ({e / med[b]:.2f}×)" if e else f"{med[b]:.1f}")
        eager = f"{e:.1f}" if e else "-"
        print(f"| {label(r['model'], r['seq'])} | {r['batch']} | {eager} | "
              + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
