"""Decode attention (one query per sequence against a KV cache): opencann's FlashDecoding
kernel (`opencann.ops.kernels.decode_attention_cpu.decode_attention`, split-KV, GQA,
lengths as data) against eager ``F.scaled_dot_product_attention`` on the same cache
(``enable_gqa=True``, a boolean mask from the lengths: what a static-cache transformers
decode step runs), in the same process. Shapes of a ~125M Llama (issue #27): Hq 12,
Hkv 4, D 64, S_max 2048; batch 1 and 8; live length 128, 1024 and 2048 (every row).

GB/s = bytes of live K and V read (B·Hkv·length·D·4·2) / time; eager SDPA reads the
whole S_max cache. Time: the least over ``--rounds`` interleaved rounds of the mean of
``--calls`` calls. ``ratio``: the kernel's speed over SDPA's.

    PYTHONPATH=. .venv/bin/python bench/decode_attention.py [--threads 2] [--rounds 100] [--calls 1]
"""
import argparse
import time

import torch

from opencann.ops.kernels.decode_attention_cpu import decode_attention

HQ, HKV, D, S_MAX = 12, 4, 64, 2048


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
    print(f"threads={a.threads} Hq={HQ} Hkv={HKV} D={D} S_max={S_MAX} (GB/s of live K+V read)")
    print(f"{'B':>2} {'len':>5} {'SDPA':>8} {'decode':>8} {'ratio':>6}")
    g = torch.Generator().manual_seed(0)
    for b in (1, 8):
        q = torch.randn(b, HQ, 1, D, generator=g)
        k = torch.randn(b, HKV, S_MAX, D, generator=g)
        v = torch.randn(b, HKV, S_MAX, D, generator=g)
        for length in (128, 1024, 2048):
            lengths = torch.full((b,), length, dtype=torch.int64)
            keep = (torch.arange(S_MAX)[None, :] < lengths[:, None])[:, None, None, :]
            fns = {"SDPA": lambda: torch.nn.functional.scaled_dot_product_attention(
                       q, k, v, attn_mask=keep, enable_gqa=True),
                   "decode": lambda: decode_attention(q, k, v, lengths)}
            ref = fns["SDPA"]()
            assert torch.allclose(fns["decode"](), ref, atol=1e-5, rtol=1e-5)  # sanity, not a test
            best = {c: float("inf") for c in fns}
            for _ in range(a.rounds):
                for c, fn in fns.items():
                    best[c] = min(best[c], _time(fn, a.calls))
            live = b * HKV * length * D * 4 * 2
            gbs = {c: live / t / 1e9 for c, t in best.items()}
            print(f"{b:>2} {length:>5} {gbs['SDPA']:>8.1f} {gbs['decode']:>8.1f} "
                  f"{best['SDPA'] / best['decode']:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
