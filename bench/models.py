"""Compiled vs eager latency on the zoo, in one process (median of N runs, same timer),
and compile time split into capture (torch.export + decomposition) and opencann's own
part (conversion with inference checks, passes, memory planning, kernel binding).

    .venv/bin/python bench/models.py [--runs 10] [--rounds 3] [--threads 2] [--only resnet50] [--batches 1]

Eager and compiled take turns for ``--rounds`` rounds of ``--runs`` calls each (so a load
change hits both); each latency is the median of the rounds' medians. Prints a Markdown
table (the README's) and writes bench/results/models.json.
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
from opencann import zoo  # noqa: E402
from opencann.timing import median_ms  # noqa: E402

ROWS = [("minilm", 1, 128), ("bert-base", 1, 128), ("bert-base", 8, 128),
        ("resnet50", 1, None), ("resnet50", 8, None)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--batches", nargs="*", type=int, help="only these batch sizes")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved eager/compiled rounds")
    ap.add_argument("--options", default=None, help="compile options as JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    options = json.loads(args.options) if args.options else None
    results = []
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.rounds} interleaved "
          f"rounds of {args.runs} runs\n")
    print("| model | batch | eager ms | opencann ms | opencann/eager | capture s | opencann s "
          "| arena MiB | lower bound MiB | naive MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, batch, seq in ROWS:
        if args.only and name not in args.only:
            continue
        if args.batches and batch not in args.batches:
            continue
        zm = zoo.get(name, batch=batch, **({"seq": seq} if seq else {}))
        t0 = time.perf_counter()
        cm = opencann.compile(zm.model, zm.example_inputs, options=options)
        total = time.perf_counter() - t0
        runs = max(3, args.runs // (4 if batch > 1 else 1))
        eager_rounds, compiled_rounds = [], []
        for _ in range(max(1, args.rounds)):
            eager_rounds.append(median_ms(zm.model, *zm.example_inputs, runs=runs))
            compiled_rounds.append(median_ms(cm, *zm.example_inputs, runs=runs))
        e = sorted(eager_rounds)[len(eager_rounds) // 2]
        c = sorted(compiled_rounds)[len(compiled_rounds) // 2]
        r = cm.report
        cap = sum(r.capture_seconds.values())
        m = r.memory
        mib = 1 << 20
        row = dict(model=name, batch=batch, seq=seq, eager_ms=e, opencann_ms=c, ratio=c / e,
                   capture_s=cap, opencann_s=r.opencann_seconds, compile_total_s=total,
                   arena_mib=m["arena_bytes"] / mib, lower_bound_mib=m["lower_bound_bytes"] / mib,
                   naive_mib=m["naive_bytes"] / mib)
        results.append(row)
        print(f"| {name}{f' seq {seq}' if seq else ''} | {batch} | {e:.1f} | {c:.1f} | {c / e:.2f} | "
              f"{cap:.2f} | {r.opencann_seconds:.2f} | {row['arena_mib']:.2f} | "
              f"{row['lower_bound_mib']:.2f} | {row['naive_mib']:.2f} |", flush=True)
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "models.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
