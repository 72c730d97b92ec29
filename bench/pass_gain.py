"""The measured gain of one switchable pass: a zoo model compiled with the pass and with
it disabled (``options={"disable": [name]}``; ``enable`` for a pass off by default),
timed in one process with rounds interleaved (the order alternating), median and min.

    .venv/bin/python bench/pass_gain.py drop_unused_outputs --model resnet50 --batch 1
    .venv/bin/python bench/pass_gain.py fuse_add_layer_norm --model bert-base --rounds 8
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/pass_gain.py fuse_add_layer_norm_cast \
        --model minilm --precision allow_mix_precision_bf16

Prints one line per variant and the ratio off/on (> 1: the pass makes it faster).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import opencann  # noqa: E402
from opencann import zoo  # noqa: E402
from opencann.passes import default_pipeline  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pass_name", help=f"one of {default_pipeline().names()}")
    ap.add_argument("--model", default="resnet50", choices=sorted(zoo.ZOO))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128, help="sequence length (transformers)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--runs", type=int, default=5, help="calls per variant per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", default=None, metavar="MODE",
                    help="precision_mode of both variants (e.g. allow_mix_precision_bf16)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    passes = {p.name: p for p in default_pipeline().passes}
    if args.pass_name not in passes:
        raise SystemExit(f"unknown pass {args.pass_name!r}; passes are {sorted(passes)}")
    on_by_default = passes[args.pass_name].default_enabled
    kw = {} if args.model == "resnet50" else {"seq": args.seq}
    zm = zoo.get(args.model, batch=args.batch, **kw)
    switch = "disable" if on_by_default else "enable"
    base = {"precision_mode": args.precision} if args.precision else {}
    variants = {"on": {**base} if on_by_default else {**base, "enable": [args.pass_name]},
                "off": {**base, "disable": [args.pass_name]} if on_by_default else {**base}}
    models = {k: opencann.compile(zm.model, zm.example_inputs, options=o) for k, o in variants.items()}
    with torch.no_grad():
        ref = zm.model(*zm.example_inputs)[0].float()
    for k, cm in models.items():
        out = cm(*zm.example_inputs)[0].float()
        err = float((out - ref).abs().max() / ref.abs().max())
        changes = [p.changed for p in cm.report.passes if p.name == args.pass_name]
        print(f"{k}: {args.pass_name} rewrites {changes[0] if changes else 0}, "
              f"max rel err vs eager {err:.1e}")
        for _ in range(2):
            cm(*zm.example_inputs)
    times = {k: [] for k in models}
    for r in range(args.rounds):
        for k in (list(models) if r % 2 == 0 else list(models)[::-1]):
            for _ in range(args.runs):
                t0 = time.perf_counter()
                models[k](*zm.example_inputs)
                times[k].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(t) for k, t in times.items()}
    for k, t in times.items():
        print(f"{args.pass_name} {k:3s}: median {med[k]:.2f} ms, min {min(t):.2f} ms "
              f"({len(t)} calls)")
    print(f"{args.model} batch {args.batch}, {args.threads} threads ({switch} switch): "
          f"off/on median {med['off'] / med['on']:.3f}, min "
          f"{min(times['off']) / min(times['on']):.3f}")


if __name__ == "__main__":
    main()
