"""Where the time goes: per-op-type time of opencann (its Chrome-trace profiler,
`CompiledModel.profile`) next to ONNX Runtime's profiler (``enable_profiling``: its
JSON of per-node kernel times) and OpenVINO's per-layer performance counters
(``PERF_COUNT``, ``InferRequest.profiling_info``), on one model, same thread count.

    .venv/bin/python bench/breakdown.py resnet50 --runs 10
    .venv/bin/python bench/breakdown.py bert-base --runs 5

Rounds are interleaved (one profiled call of each backend per round). For each
backend: per op type, the median over runs of its summed time per run (ms),
its share and its count per run; the rows are printed as Markdown and written to
bench/results/breakdown_<model>_b<batch>.json. Backends whose packages are missing
(``pip install -e .[bench]``) are skipped with that message.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
from typing import Callable, Counter, Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402  (bench/peers.py: model building, ONNX export, sessions)

from opencann import zoo  # noqa: E402
import opencann  # noqa: E402


def _median_per_op(runs: List[Dict[str, float]], counts: Dict[str, int]) -> List[dict]:
    ops = sorted({k for r in runs for k in r})
    med = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in ops}
    total = sum(med.values()) or 1.0
    return [dict(op=k, ms=med[k], share=med[k] / total, count=counts.get(k, 0))
            for k in sorted(ops, key=lambda k: -med[k])]


def opencann_profiler(model, inputs) -> Callable[[], Tuple[Dict[str, float], Counter]]:
    cm = opencann.compile(model, inputs)
    for _ in range(2):
        cm(*inputs)

    def once():
        acc: Dict[str, float] = collections.defaultdict(float)
        ev = cm.profile(*inputs)
        for e in ev:
            acc[e["name"]] += e["dur"] / 1e3
        return acc, collections.Counter(e["name"] for e in ev)
    return once


def ort_profiler(onnx_path: str, inputs, threads: int, workdir: str):
    """One profiled call per ``once()``: ORT writes its profile only when the session
    ends, so each call runs in a fresh session (built once per call, not timed) and the
    second call of that session is read."""
    import onnxruntime as ort
    counter = [0]

    def once():
        counter[0] += 1
        sess = peers.ort_session(onnx_path, threads,
                                 profile_prefix=os.path.join(workdir, f"ort{counter[0]}"))
        run = peers.ort_runner(sess, inputs)
        run()
        run()
        with open(sess.end_profiling()) as f:
            events = json.load(f)
        # one "model_run" event per call; its kernel events ("Node", "<node>_kernel_time")
        # fall inside its time span
        c = [e for e in events if e.get("name") == "model_run"][-1]
        lo, hi = c["ts"], c["ts"] + c["dur"]
        acc: Dict[str, float] = collections.defaultdict(float)
        cnt = collections.Counter()
        for e in events:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and lo <= e["ts"] <= hi:
                op = e["args"].get("op_name", "?")
                acc[op] += e["dur"] / 1e3
                cnt[op] += 1
        return acc, cnt
    del ort
    return once


def ov_profiler(onnx_path: str, inputs, threads: int):
    compiled = peers.ov_compiled(onnx_path, threads, perf_counters=True)
    run, req = peers.ov_runner(compiled, inputs)
    for _ in range(2):
        run()

    def once():
        run()
        acc: Dict[str, float] = collections.defaultdict(float)
        cnt = collections.Counter()
        for p in req.profiling_info:
            if p.status.name != "EXECUTED":
                continue
            key = f"{p.node_type} [{p.exec_type}]"
            acc[key] += p.real_time.total_seconds() * 1e3
            cnt[key] += 1
        return acc, cnt
    return once


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=["resnet50", "bert-base", "minilm"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=12, help="rows printed per backend")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kw = {} if args.model == "resnet50" else {"seq": args.seq}
    zm = zoo.get(args.model, batch=args.batch, **kw)
    missing = peers.missing_peers()
    profilers = {"opencann": opencann_profiler(zm.model, zm.example_inputs)}
    with tempfile.TemporaryDirectory(prefix="opencann-breakdown-") as work:
        path = None
        for b in ("onnxruntime", "openvino"):
            if b in missing:
                print(f"{b}: skipped, {missing[b]}")
                continue
            if path is None:
                path = peers.export_onnx(zm.model, zm.example_inputs,
                                         os.path.join(work, "model.onnx"))
            profilers[b] = (ort_profiler(path, zm.example_inputs, args.threads, work)
                            if b == "onnxruntime" else
                            ov_profiler(path, zm.example_inputs, args.threads))
        # interleaved: one profiled call of each backend per round
        per_run = {b: [] for b in profilers}
        counts = {}
        for _ in range(args.runs):
            for b, once in profilers.items():
                acc, counts[b] = once()
                per_run[b].append(acc)
        out = {b: _median_per_op(per_run[b], counts[b]) for b in profilers}
    for b, rows in out.items():
        total = sum(r["ms"] for r in rows)
        print(f"\n{b}: {total:.1f} ms summed over ops (median per op type of {args.runs} runs)\n")
        print("| op | ms | share | count |\n|---|---|---|---|")
        for r in rows[:args.top]:
            print(f"| {r['op']} | {r['ms']:.2f} | {100 * r['share']:.1f}% | {r['count']} |")
        if len(rows) > args.top:
            rest = rows[args.top:]
            print(f"| ({len(rest)} more) | {sum(r['ms'] for r in rest):.2f} | "
                  f"{100 * sum(r['share'] for r in rest):.1f}% | {sum(r['count'] for r in rest)} |")
    res = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       f"breakdown_{args.model}_b{args.batch}.json")
    os.makedirs(os.path.dirname(res), exist_ok=True)
    with open(res, "w") as f:
        json.dump(dict(model=args.model, batch=args.batch, threads=args.threads,
                       runs=args.runs, backends=out), f, indent=2)
    print(f"\nwritten to {os.path.relpath(res)}")


if __name__ == "__main__":
    main()
