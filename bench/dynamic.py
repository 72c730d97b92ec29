"""Dynamic shapes (#12, item 5, small version): one compile with dynamic batch and
sequence length, called at new shapes.

For each model (MiniLM with its real weights, BERT-base with seeded weights) and each
(batch, seq) cell: the first call at that shape (which specialises the optimised graph,
plans its memory and binds its kernels), the steady state of the same dynamic model,
a static compile of exactly that shape, and eager PyTorch. Steady-state times are the
median of ``--reps`` calls, the three runs interleaved call by call so machine load
hits them alike. ``plan ms`` is the plan build alone (``report.dynamic["plans"]``);
``err vs eager`` is the dynamic model's largest error relative to the output's magnitude.
``static 1st`` is the static compile's first call (torch's kernels meet a new shape
there too: oneDNN/MKL set up per shape).

``--cpu`` times process CPU (all threads) instead of wall time: with ``--threads 1`` it is
steady on a loaded machine, where wall times vary by ±50%.

Usage: python bench/dynamic.py [--models minilm bert] [--cells 1x128 4x40] [--reps 15]
       [--threads 2] [--cpu]
"""
import argparse
import statistics
import time

import torch

import opencann
from opencann import zoo

SPEC = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}


def _inputs(name, batch, seq):
    ids = torch.randint(1000, 20000, (batch, seq), generator=torch.Generator().manual_seed(seq))
    return (ids, torch.ones(batch, seq, dtype=torch.int64)) if name == "minilm" else (ids,)


def _model(name):
    zm = zoo.minilm(batch=2, seq=16) if name == "minilm" else zoo.bert_base(batch=2, seq=16)
    spec = SPEC if name == "minilm" else {"input_ids": SPEC["input_ids"]}
    return zm.model, zm.example_inputs, spec


CLOCK = time.perf_counter   # --cpu: time.process_time (all threads; steadier under load)


def _timed(fn, *args):
    t0 = CLOCK()
    fn(*args)
    return (CLOCK() - t0) * 1e3


def cell(model, dyn, name, batch, seq, reps):
    """One row: first call, steady state (dynamic, static, eager), plan build."""
    x = _inputs(name, batch, seq)
    t0 = CLOCK()
    out = dyn(*x)
    first = (CLOCK() - t0) * 1e3
    with torch.no_grad():
        ref = model(*x).last_hidden_state
    err = ((out.last_hidden_state - ref).abs().max() / ref.abs().max()).item()
    plan_ms = dyn.report.dynamic["plans"][-1]["build_ms"]
    static = opencann.compile(model, x)
    static_first = _timed(static, *x)
    runs = {"dynamic": [], "static": [], "eager": []}
    with torch.no_grad():
        model(*x)
        for _ in range(reps):
            runs["dynamic"].append(_timed(dyn, *x))
            runs["static"].append(_timed(static, *x))
            runs["eager"].append(_timed(model, *x))
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"model": name, "batch": batch, "seq": seq, "first_ms": first, "plan_ms": plan_ms,
            "static_first_ms": static_first, "rel_err": err,
            **{f"{k}_ms": v for k, v in med.items()}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["minilm", "bert"])
    ap.add_argument("--cells", nargs="+", default=["1x128", "4x40", "1x16"])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu", action="store_true",
                    help="time process CPU (all threads) instead of wall time")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.cpu:
        global CLOCK
        CLOCK = time.process_time
    print(f"{'model':7s} {'shape':>7s} {'first':>8s} {'plan':>7s} {'steady':>8s} "
          f"{'static 1st':>10s} {'static':>8s} {'eager':>8s} {'first-steady':>13s} "
          f"{'steady/static':>14s} {'err vs eager':>12s}")
    for name in a.models:
        model, example, spec = _model(name)
        t0 = time.perf_counter()
        dyn = opencann.compile(model, example, dynamic_shapes=spec)
        print(f"# {name}: one dynamic compile in {time.perf_counter() - t0:.1f} s "
              f"({dyn.report.notes[-1]})")
        for c in a.cells:
            b, s = (int(v) for v in c.split("x"))
            r = cell(model, dyn, name, b, s, a.reps)
            print(f"{name:7s} {f'{b}x{s}':>7s} {r['first_ms']:8.1f} {r['plan_ms']:7.1f} "
                  f"{r['dynamic_ms']:8.1f} {r['static_first_ms']:10.1f} {r['static_ms']:8.1f} "
                  f"{r['eager_ms']:8.1f} "
                  f"{r['first_ms'] - r['dynamic_ms']:13.1f} "
                  f"{r['dynamic_ms'] / r['static_ms']:14.3f} {r['rel_err']:12.1e}", flush=True)


if __name__ == "__main__":
    main()
