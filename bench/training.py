"""Training benchmark: step time and planned peak activation memory for ResNet-50 and
BERT-base (batch 8): eager, opencann without recomputation (memory_budget = 1.0 is the
always-on cheap-op cut), and opencann with budgets of 50% and 30% of its own
no-recomputation peak; plus the largest batch that fits a memory cap with and without
recomputation (peaks scale linearly in the batch; computed from the plans).

    .venv/bin/python bench/training.py [--models resnet50,bert-base] [--steps 2] [--cap-gib 4]
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

from opencann import zoo
from opencann.dynamo.training import make_training_backend
from opencann.dynamo.partition import last_partition_report

MiB = 2 ** 20
BUDGETS = ("opencann, no budget", "opencann, budget 50%", "opencann, budget 40%",
           "opencann, budget 30%")


def _loss(name, model, inputs):
    out = model(*inputs)
    h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return h.float().pow(2).mean()


def _time(name, model, inputs, steps):
    _loss(name, model, inputs).backward()  # warm-up (and compile)
    t0 = time.perf_counter()
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        _loss(name, model, inputs).backward()
    return (time.perf_counter() - t0) / steps * 1e3


def eager_saved_bytes(model, inputs) -> int:
    """Bytes of the distinct storages autograd saves for backward in one eager forward
    (``torch.autograd.graph.saved_tensors_hooks``): eager's activation memory."""
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _loss("", model, inputs)
    return sum(b for ptr, b in seen.items() if ptr not in params)


def run(name, steps, cap):
    zm = zoo.get(name, batch=8)
    base = zm.model.train()
    rows = []
    ms = _time(name, base, zm.example_inputs, steps)
    rows.append((name, "eager", ms, eager_saved_bytes(base, zm.example_inputs),
                 "tensors saved for backward (measured with saved_tensors_hooks)"))
    peak0 = None
    for label, budget in zip(BUDGETS, (None, 0.5, 0.4, 0.3)):
        m = copy.deepcopy(base)
        try:
            cm = torch.compile(m, backend=make_training_backend(memory_budget=budget), dynamic=False)
            ms = _time(name, cm, zm.example_inputs, steps)
            rep = last_partition_report()
            peak0 = rep["peak_without_recompute"]
            rows.append((name, label, ms, rep["peak"],
                         f"{len(rep['recomputed'])} recomputed, {rep['recompute_flops'] / 1e9:.2f} GFLOP"))
        except Exception as e:  # noqa: BLE001 - a budget that cannot be met is a result
            msg = str(e).split("MemoryBudgetError: ")[-1].split(". Fix")[0]
            rows.append((name, label, None, None, msg[:120]))
    return rows, peak0


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="resnet50,bert-base")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--cap-gib", type=float, default=4.0)
    a = p.parse_args(argv)
    cap = a.cap_gib * 2 ** 30
    print("command: .venv/bin/python bench/training.py " + " ".join(argv or []))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| model | mode | step ms | planned peak activations MiB | note |")
    print("|---|---|---|---|---|")
    fits = []
    for name in a.models.split(","):
        rows, peak0 = run(name, a.steps, cap)
        for r in rows:
            print(f"| {r[0]} | {r[1]} | {'' if r[2] is None else f'{r[2]:.0f}'} | "
                  f"{'' if r[3] is None else f'{r[3] / MiB:.0f}'} | {r[4]} |")
        if peak0:
            fits.append([name, int(cap // (peak0 / 8))] + [
                "" if r[3] is None else int(cap // (r[3] / 8)) for r in rows[1:]])
    print(f"\nlargest batch within {a.cap_gib:g} GiB of activations (linear in batch, from the "
          "plans; no recomputation = torch's default partition):")
    print("| model | no recomputation | " + " | ".join(BUDGETS) + " |")
    print("|---|---|" + "---|" * len(BUDGETS))
    for f in fits:
        print("| " + " | ".join(str(x) for x in f) + " |")


if __name__ == "__main__":
    main()
