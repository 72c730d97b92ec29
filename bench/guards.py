"""Per-call cost of a compiled model's call-time guards (`opencann.engine.guards`) and of
the whole call, against eager, on a two-conv CNN (1x3x32x32) and BERT-base (zoo
``bert-base``).

    PYTHONPATH=. .venv/bin/python bench/guards.py [--seq 128] [--reps 20] [--rounds 300]
                                                   [--threads 1] [--skip-bert]

Per model: µs per call of each guard the model holds (``check`` on a prepared call;
the argument binding too), then the call time compiled and eager in the same process
and their ratio, and the compiled call's overhead (the call minus the executor's run
on the same inputs). Times are the minimum over ``--rounds`` rounds of the mean of
``--reps`` calls (variants interleaved per round; guards 10x the calls per round):
many short rounds give the least disturbed estimate on a shared machine. Figures are noisy on a loaded machine: compare ratios, not µs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import opencann  # noqa: E402
from opencann.engine.guards import Call  # noqa: E402


class TwoConv(torch.nn.Module):
    """conv 3->8, relu, conv 8->8 (3x3, padding 1)."""

    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = torch.nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.c2(torch.relu(self.c1(x)))


def timed(fns: Dict[str, Callable[[], object]], reps: int, rounds: int) -> Dict[str, float]:
    """Per variant, the minimum over rounds of the mean µs of ``reps`` calls."""
    best = {k: float("inf") for k in fns}
    for fn in fns.values():
        for _ in range(3):
            fn()
    for _ in range(rounds):
        for k, fn in fns.items():
            fn()   # untimed: the previous variant left other data in the caches
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            best[k] = min(best[k], (time.perf_counter() - t0) / reps * 1e6)
    return best


def report(name: str, model: torch.nn.Module, args: tuple, reps: int, rounds: int) -> None:
    cm = opencann.compile(model, args)
    with torch.no_grad():
        flat, tensors = cm._bind(args, {})
        call = Call(flat, tensors)
        inputs = cm._contiguous(list(tensors))
        fns = {f"guard {g.name}": (lambda g=g: g.check(call)) for g in cm.guards}
        fns["binding"] = lambda: cm._bind(args, {})
        per = timed(fns, reps * 10, max(1, rounds // 10))
        calls = timed({"eager": lambda: model(*args), "compiled": lambda: cm(*args),
                       "executor run": lambda: cm.shapes.run(inputs)}, reps, rounds)
    print(f"{name}: {len(cm.guards)} guards")
    for k, us in per.items():
        print(f"  {k:28s} {us:8.2f} µs/call")
    print(f"  {'guards total':28s} {sum(per.values()):8.2f} µs/call")
    e, c, r = calls["eager"], calls["compiled"], calls["executor run"]
    print(f"  eager {e:.1f} µs, compiled {c:.1f} µs: {c / e:.2f}x eager; "
          f"call overhead (compiled - executor run {r:.1f} µs) {c - r:.1f} µs")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=128, help="BERT-base sequence length")
    ap.add_argument("--reps", type=int, default=20, help="calls per round")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-bert", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    report("two-conv CNN 1x3x32x32", TwoConv().eval(), (torch.randn(1, 3, 32, 32),),
           a.reps, a.rounds)
    if not a.skip_bert:
        from opencann import zoo
        zm = zoo.get("bert-base", seq=a.seq)
        report(f"bert-base seq {a.seq}", zm.model, tuple(zm.example_inputs),
               max(1, a.reps // 10), max(3, a.rounds // 10))


if __name__ == "__main__":
    main()
