"""ResNet-50's stem max-pool [1, 64, 112, 112] k3 s2 p1 on a channels-last input (as a
oneDNN convolution leaves it), by kernel: before drop_unused_outputs (values and int64
indices written through ``.out`` into NCHW buffers), after (``max_pool2d``,
kernel-allocated), and an indices-free chain of ``torch.maximum`` over strided views.
Minimum of ``--calls`` calls per round, rounds interleaved.

    .venv/bin/python bench/maxpool.py [--threads 2]
"""
import argparse
import time

import torch

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
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cl = torch.channels_last
    x = torch.randn(1, 64, 112, 112).contiguous(memory_format=cl)
    o_nchw, i_nchw = torch.empty(1, 64, 56, 56), torch.empty(1, 64, 56, 56, dtype=torch.long)
    o_cl = torch.empty(1, 64, 56, 56).contiguous(memory_format=cl)
    ref = aten.max_pool2d.default(x, [3, 3], [2, 2], [1, 1])
    assert torch.equal(chain(x, o_cl), ref)
    cases = {
        "before: max_pool2d_with_indices.out into NCHW buffers":
            lambda: aten.max_pool2d_with_indices.out(x, [3, 3], [2, 2], [1, 1], out=o_nchw, indices=i_nchw),
        "after: max_pool2d (kernel-allocated, channels-last)":
            lambda: aten.max_pool2d.default(x, [3, 3], [2, 2], [1, 1]),
        "torch.maximum chain, channels-last": lambda: chain(x, o_cl),
    }
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
