"""The transformer levers of issue #11 item 5, kernel by kernel, rounds interleaved
(minimum per variant over rounds of best-of-5 calls, 2 threads by default):

- gemm: per BERT-base / MiniLM GEMM shape, addmm into the buffer, MKL's packed GEMM
  (``torch.ops.mkl._mkl_linear``, with and without the copy into the buffer), oneDNN's
  prepacked ``torch.ops.mkldnn._linear_pointwise``; and bias+GELU as addmm + ``gelu_``
  against oneDNN's GELU post-op.
- qkv: three [m, H] @ [H, H] addmm against one [m, H] @ [H, 3H] (`fuse_qkv_linear`).
- addln: LayerNorm(x + y) compiled with and without `fuse_add_layer_norm`.

    .venv/bin/python bench/transformer_levers.py [--what gemm qkv addln] [--rounds 5]

End to end, per pass: ``bench/pass_gain.py fuse_qkv_linear --model bert-base``.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import opencann  # noqa: E402
from opencann.devices.cpu import best_time_us  # noqa: E402

SHAPES = [(128, 768, 768), (128, 768, 2304), (128, 768, 3072), (128, 3072, 768),
          (1024, 768, 768), (1024, 768, 3072), (128, 384, 1536)]


def race(fns: dict, rounds: int) -> dict:
    """Minimum µs per variant, variants taking turns each round (order alternating)."""
    res = {k: float("inf") for k in fns}
    for r in range(rounds):
        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            res[k] = min(res[k], best_time_us(fns[k]))
    return res


def gemm(rounds: int) -> None:
    for m, k, n in SHAPES:
        x, w, b, out = torch.randn(m, k), torch.randn(n, k) / k ** 0.5, torch.randn(n), torch.empty(m, n)
        wt = w.t()
        mp = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
        dp = torch.ops.mkldnn._reorder_linear_weight(w, m)
        lp = torch.ops.mkldnn._linear_pointwise
        fns = {"addmm": lambda: torch.addmm(b, x, wt, out=out),
               "mkl+copy": lambda: out.copy_(torch.ops.mkl._mkl_linear(x, mp, w, b, m)),
               "mkl": lambda: torch.ops.mkl._mkl_linear(x, mp, w, b, m),
               "onednn": lambda: lp(x, dp, b, "none", [], ""),
               "addmm+gelu_": lambda: torch.ops.aten.gelu_(torch.addmm(b, x, wt, out=out)),
               "onednn gelu": lambda: lp(x, dp, b, "gelu", [], "none")}
        r = race(fns, rounds)
        gf = 2 * m * k * n / 1e3
        print(f"{m}x{k} @ {k}x{n}: " + "  ".join(f"{v} {t:.0f} us ({gf / t:.0f} GF/s)"
                                                   for v, t in r.items()), flush=True)


def qkv(rounds: int) -> None:
    for m, h in ((128, 768), (1024, 768), (128, 384)):
        x = torch.randn(m, h)
        ws = [torch.randn(h, h).t() for _ in range(3)]
        bs = [torch.randn(h) for _ in range(3)]
        outs = [torch.empty(m, h) for _ in range(3)]
        wc, bc, oc = torch.cat([w.t() for w in ws]).t(), torch.cat(bs), torch.empty(m, 3 * h)
        r = race({"3 GEMMs": lambda: [torch.addmm(b, x, w, out=o) for b, w, o in zip(bs, ws, outs)],
                  "merged": lambda: torch.addmm(bc, x, wc, out=oc)}, rounds)
        print(f"m={m} H={h}: 3 GEMMs {r['3 GEMMs']:.0f} us, merged {r['merged']:.0f} us, "
              f"ratio {r['3 GEMMs'] / r['merged']:.3f}", flush=True)


class _Residual(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.ln = torch.nn.LayerNorm(h)

    def forward(self, x, y):
        return self.ln(x + y)


def addln(rounds: int) -> None:
    for rows in (128, 1024):
        m = _Residual(768).eval()
        x, y = torch.randn(rows, 768), torch.randn(rows, 768)
        cms = {"add + layer_norm": opencann.compile(m, (x, y)),
               "fuse_add_layer_norm": opencann.compile(m, (x, y), options={"enable": ["fuse_add_layer_norm"]})}
        r = race({k: (lambda c=c: c(x, y)) for k, c in cms.items()}, rounds)
        print(f"[{rows}, 768]: " + "  ".join(f"{k} {t:.1f} us" for k, t in r.items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--what", nargs="*", default=["gemm", "qkv", "addln"], choices=["gemm", "qkv", "addln"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with torch.no_grad():
        for w in args.what:
            {"gemm": gemm, "qkv": qkv, "addln": addln}[w](args.rounds)


if __name__ == "__main__":
    main()
