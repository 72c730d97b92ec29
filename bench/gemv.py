"""Decode linears (M <= 32 rows): GB/s of weight read by opencann's decode GEMV/GEMM
(`opencann.ops.kernels.gemv_cpu.gemv`) against torch's kernels, in the same process.

Per shape (default): against ``torch.nn.functional.linear`` and, where this torch has
it, oneDNN's prepacked inner product (``torch.ops.mkldnn._linear_pointwise`` on a
``_reorder_linear_weight`` weight: LinearAct's ``onednn_packed`` GEMM kernel) and, at
M = 1, ``torch.addmv`` (MKL's sgemv on the [N, K] weight). Shapes K x N of a ~125M Llama
(issue #27): 768x768 (q/o proj), 768x2048 (gate/up), 2048x768 (down), 768x32000 (LM
head); M in ``--rows`` (1, 2, 4, 8). GB/s = K·N·4 bytes of W / time (x, b and y are
small). Time: the least over ``--rounds`` interleaved rounds (each kernel in turn, so a
burst of load on a shared machine hits all of them) of the mean of ``--calls`` calls.
The ``ratio`` column is gemv's GB/s over the best torch kernel's.

``--rotation``: the GEMMs of one decode step of that Llama (hidden 768, 12 layers, q/o
768x768, k/v 256x768, gate/up 2048x768, down 768x2048, LM head 32000x768: 400 MB of fp32
weights, larger than the caches), each weight once in model order, bias-free as Llama's:
``gemv`` (ours, bound once per weight by `bind_gemv` as a decode step binds it, with its
launch policy), ``mm`` (``torch.mm`` on a
contiguous [K, N] copy), ``mkl_packed`` (``torch.ops.mkl._mkl_linear`` on
``_mkl_reorder_linear_weight(w, M)``), ``onednn_packed`` (``_linear_pointwise`` on
``_reorder_linear_weight(w, M)``); a table of ms per rotation and GB/s (400 MB / time),
the least of ``--passes`` passes, the kernels interleaved pass by pass with a 50 ms pause
between kernels (an OpenMP team that spins after one kernel does not slow the next).
Packed copies are made per M and freed after it. numba's threads follow ``--threads``
(as torch's).

    PYTHONPATH=. .venv/bin/python bench/gemv.py [--threads 2] [--rounds 100] [--calls 1]
    PYTHONPATH=. .venv/bin/python bench/gemv.py --rotation [--passes 8] [--rows 1 2 4 8]

``--per-call``: µs per call of the decode GEMV on a tiny weight (8 x 64: the call's fixed
cost) and on q_proj's 768 x 768, per M in ``--rows``: ``gemv`` (validates, binds and runs
every call: the cost of an unbound call), the bound call (`bind_gemv`'s ``run``, what a
compiled decode step makes), and the numba kernel alone on numpy views (the floor); the
least over ``--rounds`` interleaved rounds of ``--calls`` calls (default 2000).

    PYTHONPATH=. .venv/bin/python bench/gemv.py --per-call [--rows 1 8] [--rounds 7]
"""
import argparse
import time

import numba
import torch

from opencann.devices import cpu as cpu_device
from opencann.ops.kernels import gemv_cpu
from opencann.ops.kernels.gemv_cpu import bind_gemv, gemv, pack_weight

SHAPES = [(768, 768), (768, 2048), (2048, 768), (768, 32000)]
# one decode step of the random Llama 125M of bench/llm.py: (N, K) per weight, model order
LLAMA125M_LAYER = [(768, 768), (256, 768), (256, 768), (768, 768), (2048, 768), (2048, 768),
                   (768, 2048)]
LLAMA125M_STEP = LLAMA125M_LAYER * 12 + [(32000, 768)]


def _time(fn, calls):
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def _rotation_kernels(ws, m: int) -> dict:
    """name -> (x by K, call(x by K)): one rotation over ``ws`` ([N, K] weights) at m rows."""
    g = torch.Generator().manual_seed(m)
    xs = {k: torch.randn(m, k, generator=g) for k in {w.shape[1] for w in ws}}
    outs = {n: torch.empty(m, n) for n in {w.shape[0] for w in ws}}
    kn = [w.t().contiguous() for w in ws]
    bound = [(bind_gemv(w, m), xs[w.shape[1]], outs[w.shape[0]]) for w in ws]
    fns = {"gemv": lambda: [run(x, None, out) for run, x, out in bound],
           "mm": lambda: [torch.mm(xs[w.shape[0]], w) for w in kn]}
    if cpu_device.mkl_packed_available():
        mkl = [(torch.ops.mkl._mkl_reorder_linear_weight(w, m), w) for w in ws]
        fns["mkl_packed"] = lambda: [torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, m)
                                     for p, w in mkl]
    if cpu_device.onednn_linear_available():
        dnn = [(torch.ops.mkldnn._reorder_linear_weight(w, m), w.shape[1]) for w in ws]
        lin = torch.ops.mkldnn._linear_pointwise
        fns["onednn_packed"] = lambda: [lin(xs[k], p, None, "none", [], "") for p, k in dnn]
        fns["onednn_plain"] = lambda: [lin(xs[w.shape[1]], w, None, "none", [], "") for w in ws]
    w0 = ws[-1]
    ref = torch.nn.functional.linear(xs[w0.shape[1]], w0)
    for name, fn in fns.items():                   # a sanity check, not a test
        assert torch.allclose(fn()[-1], ref, rtol=1e-4, atol=1e-3), name
    return fns


def rotation(rows, passes: int) -> None:
    """Print the decode-step rotation table (module docstring): ms and GB/s per kernel."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g) for n, k in LLAMA125M_STEP]
    nbytes = sum(w.numel() * 4 for w in ws)
    cols = ["gemv", "mm", "mkl_packed", "onednn_packed", "onednn_plain"]
    print(f"rotation: {len(ws)} weights, {nbytes / 1e6:.0f} MB; least of {passes} passes; "
          f"ms (GB/s)")
    print(f"{'M':>2} " + " ".join(f"{c:>16}" for c in cols))
    for m in rows:
        fns = _rotation_kernels(ws, m)
        best = {c: float("inf") for c in fns}
        for _ in range(passes):
            for c, fn in fns.items():
                time.sleep(0.05)
                best[c] = min(best[c], _time(fn, 1))
        print(f"{m:>2} " + " ".join(
            f"{best[c] * 1e3:>7.1f} ({nbytes / best[c] / 1e9:>4.1f})" if c in best else f"{'-':>16}"
            for c in cols), flush=True)
        del fns


def per_call(rows, rounds: int, calls: int) -> None:
    """Print µs per call of `gemv`, the bound call and the kernel alone (module docstring)."""
    g = torch.Generator().manual_seed(0)
    print(f"threads={numba.get_num_threads()}; us per call, least of {rounds} rounds of {calls} calls")
    print(f"{'N x K':>9} {'M':>2} {'gemv()':>8} {'bound':>8} {'kernel':>8}")
    for n, k in [(8, 64), (768, 768)]:
        w_nk = torch.randn(n, k, generator=g)
        for m in rows:
            x, out = torch.randn(m, k, generator=g), torch.empty(m, n)
            run = bind_gemv(w_nk, m)
            kernel, args = gemv_cpu._kernel_for(m), (x.numpy(), w_nk.numpy(), gemv_cpu._NO_BIAS,
                                                     False, out.numpy())
            fns = {"gemv()": lambda: gemv(x, w_nk, None, out), "bound": lambda: run(x, None, out),
                   "kernel": lambda: kernel(*args)}
            best = {c: float("inf") for c in fns}
            for _ in range(rounds):
                for c, fn in fns.items():
                    best[c] = min(best[c], _time(fn, calls))
            print(f"{n:>4}x{k:<4} {m:>2} " + " ".join(f"{best[c] * 1e6:>8.2f}" for c in fns), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rotation", action="store_true",
                    help="time one decode step's weights in turn (module docstring)")
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--per-call", action="store_true",
                    help="the decode GEMV's cost per call, bound and not (module docstring)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    numba.set_num_threads(a.threads)
    if a.rotation:
        rotation(a.rows, a.passes)
        return
    if a.per_call:
        per_call(a.rows, a.rounds if a.rounds != 100 else 7, a.calls if a.calls != 1 else 2000)
        return
    onednn = cpu_device.onednn_linear_available()
    cols = ["F.linear"] + (["onednn_packed"] if onednn else []) + ["addmv", "gemv"]
    print(f"threads={a.threads} rounds={a.rounds} calls={a.calls} (GB/s of W read; higher is better)")
    print(f"{'K x N':>11} {'M':>2} " + " ".join(f"{c:>14}" for c in cols) + f" {'ratio':>6}")
    g = torch.Generator().manual_seed(0)
    for k, n in SHAPES:
        w = torch.randn(n, k, generator=g)
        b = torch.randn(n, generator=g)
        w_nk = pack_weight(w)
        for m in a.rows:
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
