"""What the first call at a new sequence length costs over a steady-state call (#12):
one dynamic compile of BERT-base (seeded weights, example 2x16), then per new length
the first call through the model (plan build + first run), the plan build alone
(``report.dynamic["plans"]``) and the steady state (median of ``--reps`` later calls).
Wall time and process CPU time (all threads); with ``--threads 1`` (default) the CPU
times are steady even on a loaded machine, which is why they are reported.

``--phases`` adds the plan build's phases in thread CPU time (specialise, schedule
stage, memory plan, kernel binding), timed by wrapping those functions.

Usage: python bench/dynamic_first_call.py [--lengths 41 78 ...] [--reps 5] [--threads 1]
       [--phases]
"""
import argparse
import os
import statistics
import time

import torch

import opencann
from opencann import zoo
from opencann.engine import dynamic
from opencann.engine import BindKernels
from opencann.passes import MemoryPlanning, SingleStreamSchedule

PHASES = {}


def _wrap_phases():
    """Time the plan build's phases (thread CPU ms, summed into ``PHASES``)."""
    def wrap(owner, name, label):
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                PHASES[label] = PHASES.get(label, 0.0) + (time.thread_time() - t) * 1e3
        setattr(owner, name, timed)
    wrap(dynamic, "specialise", "specialise")
    wrap(SingleStreamSchedule, "run", "schedule")
    wrap(MemoryPlanning, "run", "memory plan")
    wrap(BindKernels, "run", "binding")


def _timed(fn):
    w, c = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - w) * 1e3, (time.process_time() - c) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", nargs="+", type=int, default=[41, 78, 57, 99, 23, 66, 35, 88])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--phases", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.phases:
        _wrap_phases()
    zm = zoo.bert_base(batch=2, seq=16)
    cm = opencann.compile(zm.model, zm.example_inputs,
                          dynamic_shapes={"input_ids": {0: "batch", 1: "seq"}})
    cm(torch.randint(1000, 20000, (1, 20)))     # a first new shape: the kernel choices pinned
    print(f"{'length':>6s} {'first wall':>10s} {'first cpu':>9s} {'steady wall':>11s} "
          f"{'steady cpu':>10s} {'over: wall':>10s} {'over: cpu':>9s} {'plan build':>10s} {'load':>5s}")
    over, phases = [], []
    for n in a.lengths:
        ids = torch.randint(1000, 20000, (1, n))
        PHASES.clear()
        fw, fc = _timed(lambda: cm(ids))
        phases.append(dict(PHASES))
        build = cm.report.dynamic["plans"][-1]["build_ms"]
        st = [_timed(lambda: cm(ids)) for _ in range(a.reps)]
        sw, sc = statistics.median(s[0] for s in st), statistics.median(s[1] for s in st)
        over.append((fw - sw, fc - sc, build))
        print(f"{n:6d} {fw:10.1f} {fc:9.1f} {sw:11.1f} {sc:10.1f} {fw - sw:+10.1f} {fc - sc:+9.1f} "
              f"{build:10.1f} {os.getloadavg()[0]:5.1f}", flush=True)
    if a.phases:
        print("plan build phases, thread CPU ms (median): " + ", ".join(
            f"{k} {statistics.median(p.get(k, 0.0) for p in phases):.1f}"
            for k in ("specialise", "schedule", "memory plan", "binding")))
    med = [statistics.median(c) for c in zip(*over)]
    print(f"median over steady: wall {med[0]:+.1f} ms, cpu {med[1]:+.1f} ms; plan build "
          f"{med[2]:.1f} ms (wall); {a.threads} torch thread(s)")


if __name__ == "__main__":
    main()
