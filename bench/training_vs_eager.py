"""Compiled training step vs eager, interleaved in one process (eager, compiled, eager,
compiled...), so both see the same machine state; prints each round and the ratio of
the best steps. Batch 8 (BERT-base seq 128); loss = mean of the squared last hidden
state; opencann without a memory budget.

    .venv/bin/python bench/training_vs_eager.py --models resnet50,bert-base [--rounds 3] [--steps 3]
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

from opencann import zoo
from opencann.dynamo.training import make_training_backend


def _loss(model, inputs):
    out = model(*inputs)
    h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return h.float().pow(2).mean()


def _step_ms(model, inputs, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        _loss(model, inputs).backward()
    return (time.perf_counter() - t0) / steps * 1e3


def run(name: str, rounds: int, steps: int):
    zm = zoo.get(name, batch=8)
    eager = zm.model.train()
    compiled = torch.compile(copy.deepcopy(eager), backend=make_training_backend(), dynamic=False)
    for m in (eager, compiled):  # warm-up (and compile)
        _loss(m, zm.example_inputs).backward()
    e, c = [], []
    for _ in range(rounds):
        e.append(_step_ms(eager, zm.example_inputs, steps))
        c.append(_step_ms(compiled, zm.example_inputs, steps))
    return e, c


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="resnet50,bert-base")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch 8, "
          f"{a.rounds} rounds x {a.steps} steps\n")
    print("| model | eager step ms (rounds) | opencann step ms (rounds) | best/best |")
    print("|---|---|---|---|")
    for name in a.models.split(","):
        e, c = run(name, a.rounds, a.steps)
        print(f"| {name} | {' / '.join(f'{x:.0f}' for x in e)} | "
              f"{' / '.join(f'{x:.0f}' for x in c)} | {min(c) / min(e):.2f} |")


if __name__ == "__main__":
    main()
