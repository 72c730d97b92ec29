"""Decode linears (M <= 4 rows): GB/s of weight read by opencann's row-parallel GEMV
(`opencann.ops.kernels.gemv_cpu.gemv`) against ``torch.nn.functional.linear`` and, where
this torch has it, oneDNN's prepacked inner product (``torch.ops.mkldnn._linear_pointwise``
on a ``_reorder_linear_weight`` weight: LinearAct's ``onednn_packed`` GEMM kernel) and,
at M = 1, ``torch.addmv`` (MKL's sgemv on the [N, K] weight), in the same process. Shapes K x N of a ~125M Llama (issue #27): 768x768 (q/o proj), 768x2048
(gate/up), 2048x768 (down), 768x32000 (LM head); M in {1, 2, 4}.

GB/s = K·N·4 bytes of W / time (x, b and y are small). Time: the least over ``--rounds``
interleaved rounds (each kernel in turn, so a burst of load on a shared machine hits all
of them) of the mean of ``--calls`` calls. The ``ratio`` column is gemv's GB/s over the
best torch kernel's. numba's threads follow ``--threads`` (as torch's).

    PYTHONPATH=. .venv/bin/python bench/gemv.py [--threads 2] [--rounds 100] [--calls 1]
"""
import argparse
import time

import numba
import torch

from opencann.devices import cpu as cpu_device
from opencann.ops.kernels.gemv_cpu import gemv, pack_weight

SHAPES = [(768, 768), (768, 2048), (2048, 768), (768, 32000)]


def _time(fn, calls):
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--calls", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    numba.set_num_threads(a.threads)
    onednn = cpu_device.onednn_linear_available()
    cols = ["F.linear"] + (["onednn_packed"] if onednn else []) + ["addmv", "gemv"]
    print(f"threads={a.threads} rounds={a.rounds} calls={a.calls} (GB/s of W read; higher is better)")
    print(f"{'K x N':>11} {'M':>2} " + " ".join(f"{c:>14}" for c in cols) + f" {'ratio':>6}")
    g = torch.Generator().manual_seed(0)
    for k, n in SHAPES:
        w = torch.randn(n, k, generator=g)
        b = torch.randn(n, generator=g)
        w_nk = pack_weight(w)
        for m in (1, 2, 4):
            x = torch.randn(m, k, generator=g)
            out = torch.empty(m, n)
            fns = {"F.linear": lambda: torch.nn.functional.linear(x, w, b),
                   "gemv": lambda: gemv(x, w_nk, b, out=out)}
            if m == 1:
                fns["addmv"] = lambda: torch.addmv(b, w, x[0]).unsqueeze(0)
            if onednn:
                packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
                lin = torch.ops.mkldnn._linear_pointwise
                fns["onednn_packed"] = lambda: lin(x, packed, b, "none", [], "")
            ref = torch.nn.functional.linear(x, w, b)
            run = [c for c in cols if c in fns]
            for name, fn in fns.items():
                r = fn()
                assert torch.allclose(r, ref, rtol=1e-4, atol=1e-3), name  # a sanity check, not a test
            best = {c: float("inf") for c in run}
            for _ in range(a.rounds):
                for c in run:
                    best[c] = min(best[c], _time(fns[c], a.calls))
            gbs = {c: k * n * 4 / best[c] / 1e9 for c in run}
            ratio = gbs["gemv"] / max(v for c, v in gbs.items() if c != "gemv")
            print(f"{k:>5}x{n:<5} {m:>2} " + " ".join(f"{gbs[c]:>14.1f}" if c in gbs else f"{'-':>14}"
                                                      for c in cols)
                  + f" {ratio:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
