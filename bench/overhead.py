"""Runtime overhead per op of the generated code: a chain of tiny elementwise ops
(8 floats each, so the kernels' work is nil) compiled with opencann, timed against
the same chain in eager PyTorch.

    .venv/bin/python bench/overhead.py [--ops 100 400] [--reps 2000] [--threads 1]

Per chain length: µs per call and per op, compiled and eager. The marginal cost
(difference of two lengths' call times / difference of op counts) removes the fixed
cost of a call (argument binding, input checks, output copies) and is the per-op figure
the issue holds to ≤ 5 µs. Times are the minimum over ``--rounds`` rounds of the mean
of ``--reps`` calls (the least disturbed estimate on a shared machine). Writes
bench/results/overhead.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import opencann  # noqa: E402


class Chain(torch.nn.Module):
    """``n`` dependent tiny ops cycling through add, mul, sub-of-a-tensor, relu, tanh."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, x, y):
        for i in range(self.n):
            k = i % 5
            if k == 0:
                x = x + 0.5
            elif k == 1:
                x = x * 0.75
            elif k == 2:
                x = x - y
            elif k == 3:
                x = torch.relu(x)
            else:
                x = torch.tanh(x)
        return x


def per_call_us(fn, args, reps: int, rounds: int) -> float:
    best = float("inf")
    with torch.no_grad():
        for _ in range(3):
            fn(*args)
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn(*args)
            best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, nargs=2, default=[100, 400], metavar=("SHORT", "LONG"))
    ap.add_argument("--reps", type=int, default=300, help="calls per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    x, y = torch.randn(8), torch.randn(8)
    rows = []
    for n in args.ops:
        m = Chain(n).eval()
        cm = opencann.compile(m, (x, y))
        nodes = len(cm.graph.nodes)
        torch.testing.assert_close(cm(x, y), m(x, y))
        c = per_call_us(cm, (x, y), args.reps, args.rounds)
        e = per_call_us(m, (x, y), args.reps, args.rounds)
        raw = per_call_us(cm.executor.run, ([x, y],), args.reps, args.rounds)
        rows.append(dict(ops=n, nodes=nodes, opencann_us=c, executor_us=raw, eager_us=e))
        print(f"{n} ops ({nodes} nodes): opencann {c:.0f} µs/call ({c / nodes:.2f} µs/op), "
              f"executor alone {raw:.0f} µs ({raw / nodes:.2f} µs/op), "
              f"eager {e:.0f} µs ({e / n:.2f} µs/op)")
    a, b = rows
    dn = b["nodes"] - a["nodes"]
    marg = {k: (b[k] - a[k]) / dn for k in ("opencann_us", "executor_us")}
    marg["eager_us"] = (b["eager_us"] - a["eager_us"]) / (b["ops"] - a["ops"])
    fixed = a["opencann_us"] - marg["opencann_us"] * a["nodes"]
    print(f"marginal per op: opencann {marg['opencann_us']:.2f} µs, eager {marg['eager_us']:.2f} µs;"
          f" fixed per call: opencann {fixed:.0f} µs")
    out = os.path.join(os.path.dirname(__file__), "results", "overhead.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(threads=args.threads, torch=torch.__version__, rows=rows,
                       marginal_us_per_op=marg, fixed_us_per_call=fixed), f, indent=2)
    print(f"written to {os.path.relpath(out)}")


if __name__ == "__main__":
    main()
