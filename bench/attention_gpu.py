"""Triton FlashAttention on a CUDA GPU: check against the float64 reference, then time
forward (and forward+backward) against torch SDPA. Exits with a message without a GPU.

Usage: python bench/attention_gpu.py [--seqs 1024 4096 16384] [--dtype float16]
"""
import argparse
import sys

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="*", default=[1024, 4096, 16384])
    ap.add_argument("--dims", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU visible to torch: nothing to benchmark (the CPU benchmark is "
                 "bench/attention.py; the Triton kernels are tested on CPU by "
                 "tests/unit/test_flash_attention_triton.py under TRITON_INTERPRET=1)")
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("triton is not installed: pip install 'opencann[triton]'")
    from opencann.ops.flash_attention import attention_reference, flash_attention
    dt = getattr(torch, a.dtype)
    # correctness on a small shape with tails, GQA, causal bottom-right, float mask
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 300, 64, device="cuda", dtype=dt, generator=g).requires_grad_()
    k = torch.randn(2, 2, 333, 64, device="cuda", dtype=dt, generator=g).requires_grad_()
    v = torch.randn(2, 2, 333, 64, device="cuda", dtype=dt, generator=g).requires_grad_()
    mask = torch.randn(2, 1, 1, 333, device="cuda", generator=g)
    out = flash_attention(q, k, v, attn_mask=mask, causal="bottom_right")
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    rq, rk, rv = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(rq, rk, rv, attn_mask=mask, causal="bottom_right")
    rgrads = torch.autograd.grad(ref, (rq, rk, rv), do.double())
    rel = lambda x, y: ((x.double() - y).abs().max() / y.abs().max()).item()
    print(f"check ({a.dtype}): out {rel(out, ref):.2e}, "
          + ", ".join(f"d{n} {rel(x, y):.2e}" for n, x, y in zip("qkv", grads, rgrads)))
    print("| seq | d | SDPA fwd ms | opencann fwd ms | SDPA fwd+bwd ms | opencann fwd+bwd ms |")
    print("|---|---|---|---|---|---|")
    for D in a.dims:
        for S in a.seqs:
            q, k, v = (torch.randn(1, 8, S, D, device="cuda", dtype=dt, requires_grad=True)
                       for _ in range(3))
            res = []
            for fn in (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                       lambda: flash_attention(q, k, v, causal=True)):
                for bwd in (False, True):
                    def step():
                        o = fn()
                        if bwd:
                            o.backward(torch.ones_like(o))
                    step()
                    torch.cuda.synchronize()
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    for _ in range(10):
                        step()
                    e1.record()
                    torch.cuda.synchronize()
                    res.append(e0.elapsed_time(e1) / 10)
            print(f"| {S} | {D} | {res[0]:.2f} | {res[2]:.2f} | {res[1]:.2f} | {res[3]:.2f} |")


if __name__ == "__main__":
    main()
