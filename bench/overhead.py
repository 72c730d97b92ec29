"""Runtime overhead per op of the generated code: a chain of tiny elementwise ops
(8 floats each, so the kernels' work is nil) compiled with opencann, timed against
the same chain in eager PyTorch.

    .venv/bin/python bench/overhead.py [--ops 100 400] [--reps 2000] [--threads 1]

Per chain length: µs per call and per op, compiled (kernels bound through
`opencann.runtime.fast_call`, and every kernel bound as its OpOverload) and eager. The marginal cost
(difference of two lengths' call times / difference of op counts) removes the fixed
cost of a call (argument binding, input checks, output copies) and is the per-op figure
the issue holds to ≤ 5 µs. Times are the minimum over ``--rounds`` rounds (variants
interleaved) of the mean of ``--reps`` calls: the least disturbed estimate on a shared
machine. Writes
bench/results/overhead.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Dict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import opencann  # noqa: E402
from opencann.runtime import fast_call  # noqa: E402


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


def per_call_us(fns: Dict[str, Callable], args, reps: int, rounds: int) -> Dict[str, float]:
    """Per variant, the minimum over rounds of the mean time of ``reps`` calls (µs);
    the variants take turns within each round."""
    best = {k: float("inf") for k in fns}
    with torch.no_grad():
        for fn in fns.values():
            for _ in range(3):
                fn(*args)
        for _ in range(rounds):
            for k, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn(*args)
                best[k] = min(best[k], (time.perf_counter() - t0) / reps * 1e6)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, nargs=2, default=[100, 400], metavar=("SHORT", "LONG"))
    ap.add_argument("--reps", type=int, default=200, help="calls per round")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    x, y = torch.randn(8), torch.randn(8)
    fns, nodes = {}, {}
    for n in args.ops:
        m = Chain(n).eval()
        for variant, on in (("opencann", True), ("overloads", False)):
            fast_call.ENABLED = on
            fns[(variant, n)] = opencann.compile(m, (x, y))
        fast_call.ENABLED = True
        torch.testing.assert_close(fns[("opencann", n)](x, y), m(x, y))
        nodes[n] = len(fns[("opencann", n)].graph.nodes)
        fns[("eager", n)] = m
    t = per_call_us(fns, (x, y), args.reps, args.rounds)   # every variant, every length: interleaved
    rows = []
    for n in args.ops:
        c, o, e = t[("opencann", n)], t[("overloads", n)], t[("eager", n)]
        rows.append(dict(ops=n, nodes=nodes[n], opencann_us=c, overloads_us=o, eager_us=e))
        print(f"{n} ops ({nodes[n]} nodes): opencann {c:.0f} µs/call ({c / nodes[n]:.2f} µs/op); "
              f"with every kernel bound as its OpOverload {o:.0f} µs ({o / nodes[n]:.2f} µs/op); "
              f"eager {e:.0f} µs ({e / n:.2f} µs/op)")
    a, b = rows
    marg = {k: (b[k] - a[k]) / (b["ops"] - a["ops"]) for k in ("opencann_us", "overloads_us", "eager_us")}
    fixed = a["opencann_us"] - marg["opencann_us"] * a["ops"]
    print(f"marginal per op: opencann {marg['opencann_us']:.2f} µs (as OpOverloads "
          f"{marg['overloads_us']:.2f} µs), eager {marg['eager_us']:.2f} µs; fixed per call: "
          f"opencann {fixed:.0f} µs")
    out = os.path.join(os.path.dirname(__file__), "results", "overhead.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(threads=args.threads, torch=torch.__version__, rows=rows,
                       marginal_us_per_op=marg, fixed_us_per_call=fixed), f, indent=2)
    print(f"written to {os.path.relpath(out)}")


if __name__ == "__main__":
    main()
