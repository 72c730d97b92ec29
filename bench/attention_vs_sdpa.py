"""Interleaved CPU forward timing: torch's scaled_dot_product_attention vs
opencann.ops.flash_attention (no grad, default tiles), same inputs, alternating, 3 rounds
of median-of-3; prints the median round per cell. Less exposed to load changes on a
shared machine than bench/attention.py's one-cell-after-another table.

    .venv/bin/python bench/attention_vs_sdpa.py [--seqs 4096 8192] [--dims 64 128]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import opencann.ops as ops  # noqa: E402


def _median_ms(fn, n: int = 3) -> float:
    fn()
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return sorted(xs)[n // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"batch 1, {a.heads} heads, fp32, {a.threads} threads\n")
    print("| seq | d | SDPA ms | opencann ms | opencann / SDPA |\n|---|---|---|---|---|")
    with torch.no_grad():
        for d in a.dims:
            for s in a.seqs:
                g = torch.Generator().manual_seed(0)
                q, k, v = (torch.randn(1, a.heads, s, d, generator=g) for _ in range(3))
                sd, oc = [], []
                for _ in range(3):
                    sd.append(_median_ms(lambda: F.scaled_dot_product_attention(q, k, v)))
                    oc.append(_median_ms(lambda: ops.flash_attention(q, k, v)))
                sd, oc = sorted(sd)[1], sorted(oc)[1]
                print(f"| {s} | {d} | {sd:.0f} | {oc:.0f} | {oc / sd:.2f} |", flush=True)


if __name__ == "__main__":
    main()
