"""The transformer levers of issue #11 item 5, kernel by kernel, rounds interleaved
(minimum per variant over rounds of best-of-5 calls, 2 threads by default):

- gemm: per BERT-base / MiniLM GEMM shape, addmm into the buffer, MKL's packed GEMM
  (``torch.ops.mkl._mkl_linear``, with and without the copy into the buffer), oneDNN's
  prepacked ``torch.ops.mkldnn._linear_pointwise``; and bias+GELU as addmm + ``gelu_``
  against oneDNN's GELU post-op.
- qkv: three [m, H] @ [H, H] addmm against one [m, H] @ [H, 3H] (`fuse_qkv_linear`).
- addln: LayerNorm(x + y) compiled with and without `fuse_add_layer_norm`.
- attention: per SDPA shape (MiniLM, BERT-base batch 1 and 8, a long sequence), at 1 and
  2 threads, the attention kernels of `opencann.ops.kernels.attention_cpu` (each forced,
  through a one-node compiled model: same call overhead) next to eager SDPA, and which one
  the bind-time race picks; then end to end MiniLM and BERT-base (batch 1, seq 128) with
  every attention node forced to each kernel, calls interleaved.

    .venv/bin/python bench/transformer_levers.py [--what gemm qkv addln attention] [--rounds 5]

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


# (name, B, H, S, D, mask): the SDPA calls of the zoo's transformers (q, k, v transposed heads)
ATTN_SHAPES = [("MiniLM b1", 1, 12, 128, 32, "bool [B,1,S,S]"), ("BERT-base b1", 1, 12, 128, 64, "none"),
               ("BERT-base b8", 8, 12, 128, 64, "float [B,1,1,S]"), ("S=512 b1", 1, 12, 512, 64, "none")]


class _Attn(torch.nn.Module):
    def forward(self, q, k, v, *mask):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[0] if mask else None)


def _forced(kernel: str):
    """A stand-in for ATTENTION_CHOICES answering ``kernel`` for every shape."""
    class Forced(dict):
        def get(self, key, default=None):
            return kernel
    return Forced()


def _attn_args(b, h, s, d, mask):
    qkv = [torch.randn(b, s, h, d) for _ in range(3)]
    if mask.startswith("bool"):
        return (*qkv, (torch.rand(b, 1, 1, s) > 0.1).expand(b, 1, s, s))
    return (*qkv, torch.randn(b, 1, 1, s)) if mask.startswith("float") else tuple(qkv)


def attention(rounds: int) -> None:
    from opencann.ops.kernels import attention_cpu as ac
    keep = ac.ATTENTION_CHOICES
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, b, h, s, d, mask in ATTN_SHAPES:
            args, cms = _attn_args(b, h, s, d, mask), {}
            for k in ac.ATTENTION_KERNELS:
                ac.ATTENTION_CHOICES = _forced(k)
                cms[k] = opencann.compile(_Attn(), args)
            ac.ATTENTION_CHOICES = {}
            picked = [n.meta.get("kernel") for n in opencann.compile(_Attn(), args).graph.nodes
                      if n.op == "ScaledDotProductAttention"]
            fns = {"eager SDPA": lambda: _Attn()(*args), **{k: (lambda c=c: c(*args)) for k, c in cms.items()}}
            r = race(fns, rounds)
            print(f"{threads} thr {name} [{b},{h},{s},{d}] mask {mask}: " + "  ".join(
                f"{k} {t:.0f} us" for k, t in r.items()) + f"  sdpa/bmm_softmax "
                f"{r['sdpa'] / r['bmm_softmax']:.3f}  race picked {picked}", flush=True)
    ac.ATTENTION_CHOICES = keep
    _attention_e2e(rounds)


def _attention_e2e(rounds: int) -> None:
    """MiniLM and BERT-base b1 seq 128, every attention node forced to each kernel."""
    from opencann import zoo
    from opencann.ops.kernels import attention_cpu as ac
    keep = ac.ATTENTION_CHOICES
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for zm in (zoo.minilm(1, 128), zoo.bert_base(1, 128)):
            cms = {}
            for k in ac.ATTENTION_KERNELS:
                ac.ATTENTION_CHOICES = _forced(k)
                cms[k] = opencann.compile(zm.model, zm.example_inputs)
            fns = {k: (lambda c=c: c(*zm.example_inputs)) for k, c in cms.items()}
            r = {k: float("inf") for k in fns}
            for i in range(rounds):
                for k in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
                    r[k] = min(r[k], best_time_us(fns[k], reps=3))
            print(f"{threads} thr {zm.name} b1 s128 end to end: " + "  ".join(
                f"{k} {t / 1e3:.2f} ms" for k, t in r.items()) +
                f"  sdpa/bmm_softmax {r['sdpa'] / r['bmm_softmax']:.3f}", flush=True)
    ac.ATTENTION_CHOICES = keep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--what", nargs="*", default=["gemm", "qkv", "addln"],
                    choices=["gemm", "qkv", "addln", "attention"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with torch.no_grad():
        for w in args.what:
            {"gemm": gemm, "qkv": qkv, "addln": addln, "attention": attention}[w](args.rounds)


if __name__ == "__main__":
    main()
