"""ResNet-50's stem max-pool [N, 64, 112, 112] k3 s2 p1 on a channels-last input (as a
oneDNN convolution leaves it), by kernel: before drop_unused_outputs (values and int64
indices written through ``.out`` into NCHW buffers), after (``max_pool2d``,
kernel-allocated), an indices-free chain of ``torch.maximum`` over strided views, and the
numba pass MaxPool binds now (`opencann.ops.kernels.maxpool_numba`), in fp32 and against
ATen in bf16; and QuantMaxPool's ``quantized::max_pool2d`` on uint8.
Minimum of ``--calls`` calls per round, rounds interleaved.

    .venv/bin/python bench/maxpool.py [--threads 2] [--batch 1]
"""
import argparse
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from opencann.ops.kernels.maxpool_numba import max_pool_float  # noqa: E402

aten = torch.ops.aten


def chain(x, out):
    xp = torch.constant_pad_nd(x, [1, 1, 1, 1], float("-inf"))
    h, w = out.shape[-2:]
    torch.maximum(xp[:, :, 0:2 * h:2, 0:2 * w:2], xp[:, :, 0:2 * h:2, 1:2 * w + 1:2], out=out)
    for i in range(3):
        for j in range(3):
            if i or j > 1:
                torch.maximum(out, xp[:, :, i:i + 2 * h:2, j:j + 2 * w:2], out=out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cl = torch.channels_last
    b = a.batch
    x = torch.randn(b, 64, 112, 112).contiguous(memory_format=cl)
    o_nchw, i_nchw = torch.empty(b, 64, 56, 56), torch.empty(b, 64, 56, 56, dtype=torch.long)
    o_cl = torch.empty(b, 64, 56, 56).contiguous(memory_format=cl)
    ref = aten.max_pool2d.default(x, [3, 3], [2, 2], [1, 1])
    assert torch.equal(chain(x, o_cl), ref)
    assert torch.equal(max_pool_float(x, [3, 3], [2, 2], [1, 1], [1, 1], False), ref)
    xb = x.bfloat16()
    xu = torch.randint(0, 256, x.shape, dtype=torch.uint8).contiguous(memory_format=cl)
    cases = {
        "before: max_pool2d_with_indices.out into NCHW buffers":
            lambda: aten.max_pool2d_with_indices.out(x, [3, 3], [2, 2], [1, 1], out=o_nchw, indices=i_nchw),
        "after: max_pool2d (kernel-allocated, channels-last)":
            lambda: aten.max_pool2d.default(x, [3, 3], [2, 2], [1, 1]),
        "torch.maximum chain, channels-last": lambda: chain(x, o_cl),
        "numba (MaxPool's kernel now)": lambda: max_pool_float(x, [3, 3], [2, 2], [1, 1], [1, 1], False),
        "bf16: max_pool2d": lambda: aten.max_pool2d.default(xb, [3, 3], [2, 2], [1, 1]),
        "bf16: numba": lambda: max_pool_float(xb, [3, 3], [2, 2], [1, 1], [1, 1], False),
        "uint8: quantized::max_pool2d (QuantMaxPool's kernel)": lambda: torch.ops.quantized.max_pool2d(
            torch._make_per_tensor_quantized_tensor(xu, 1.0, 0), [3, 3], [2, 2], [1, 1], [1, 1], False),
    }
    warnings.simplefilter("ignore")   # torch's once-per-process note on quantized tensors
    best = {k: float("inf") for k in cases}
    for _ in range(a.rounds):
        for k, f in cases.items():
            for _ in range(a.calls):
                t0 = time.perf_counter()
                f()
                best[k] = min(best[k], time.perf_counter() - t0)
    for k, v in best.items():
        print(f"{k}: {v * 1e6:.0f} µs")


if __name__ == "__main__":
    main()
