"""Same-process interleaved A/B of the bound ``DecodeAttentionKvUpdate`` kernel (the rotary
decode step: RoPE of q/k, the KV-cache rows, decode attention, GQA) at a 125M Llama's
shapes (12 query / 4 KV heads, D 64, fp32, q/k/v the merged QKV GEMM's strided views):
the kernel of git revision ``--old`` (loaded from ``git show``) against this tree's, per
batch, cache size S_max and live length; least and median µs per call of ``--reps``
alternating calls (warm caches), and the largest output difference.

    python bench/decode_attention_update_ab.py --old 2165462 --reps 100
"""
import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import opencann.ops.kernels.decode_attention_cpu as new
from opencann.ir import DataType, TensorDesc

Hq, Hkv, D = 12, 4, 64


def _old_module(rev: str):
    src = subprocess.run(["git", "show", f"{rev}:opencann/ops/kernels/decode_attention_cpu.py"],
                         check=True, capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "decode_attention_cpu_old.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("opencann.ops.kernels._dac_old", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _case(B, S, L, g):
    d = lambda *s, dt=DataType.FLOAT: TensorDesc(tuple(s), dt)   # noqa: E731
    merged = torch.randn(B, 1, (Hq + 2 * Hkv) * D, generator=g)
    q = merged[..., :Hq * D].view(B, 1, Hq, D).transpose(1, 2)
    kn = merged[..., Hq * D:(Hq + Hkv) * D].view(B, 1, Hkv, D).transpose(1, 2)
    vn = merged[..., (Hq + Hkv) * D:].view(B, 1, Hkv, D).transpose(1, 2)
    cos, sin = torch.randn(B, 1, 1, D, generator=g), torch.randn(B, 1, 1, D, generator=g)
    kc, vc = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    descs = [d(B, Hq, 1, D), d(B, Hkv, S, D), d(B, Hkv, S, D), d(B, Hkv, 1, D), d(B, Hkv, 1, D),
             d(B, dt=DataType.INT64), d(B, dt=DataType.INT64), d(B, 1, 1, D), d(B, 1, 1, D)]
    args = (q, kc, vc, kn, vn, torch.full((B,), L - 1), torch.full((B,), L), cos, sin)
    return descs, args, torch.empty(B, Hq, 1, D)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="HEAD", help="git revision of the baseline kernel")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    old = _old_module(a.old)
    g = torch.Generator().manual_seed(0)
    print(f"{'B':>2} {'S_max':>5} {'len':>5} | old µs min / median | new µs min / median | max |diff|")
    for S, L in ((256, 40), (256, 256), (2048, 40), (2048, 2048)):
        for B in (1, 4, 8):
            descs, args, out = _case(B, S, L, g)
            fo = old.bind_decode_attention_update(*descs[:7], 0.125, *descs[7:])
            fn = new.bind_decode_attention_update(*descs[:7], 0.125, *descs[7:])
            ro = fo(*[x.clone() for x in args], out=torch.empty_like(out))[0]
            rn = fn(*[x.clone() for x in args], out=torch.empty_like(out))[0]
            to, tn = [], []
            for r in range(a.reps):
                for f, t in ((fo, to), (fn, tn)) if r % 2 else ((fn, tn), (fo, to)):
                    t0 = time.perf_counter()
                    f(*args, out=out)
                    t.append(time.perf_counter() - t0)
            print(f"{B:>2} {S:>5} {L:>5} | {min(to) * 1e6:8.1f} {statistics.median(to) * 1e6:8.1f} | "
                  f"{min(tn) * 1e6:8.1f} {statistics.median(tn) * 1e6:8.1f} | {(ro - rn).abs().max():.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
