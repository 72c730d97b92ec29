"""The CPU layout stage's measurements (issue #11 item 3; docs/performance.md, "CPU
layout"): which activation layout oneDNN's convolutions run fastest in on this host,
and what the ``layout_selection`` pass gains end to end.

    .venv/bin/python bench/cpu_layout.py convs --batch 1 --threads 1
    .venv/bin/python bench/cpu_layout.py models --batch 1 --rounds 10
    .venv/bin/python bench/cpu_layout.py sizes --threads 1 --rounds 15

``convs``: each distinct convolution of ResNet-50 (bias, no post-op), minimum of 7
calls, summed over the network's 53 convolutions, with the activation (a) NCHW (oneDNN
reorders it inside), (b) NHWC (channels-last strides: oneDNN's ``nhwc``), (c) an
opaque oneDNN tensor (``to_mkldnn``: ``nChw8c`` on AVX2 = NC1HWC0 with C0 = 8) through
``torch.mkldnn_convolution``. Weights are prepacked once for each.
``sizes``: per convolution shape (batch, channels in -> out, kernel, input H = W,
stride 1, padding k // 2) the two kernels a CPU convolution may run
(`opencann.ops.kernels.conv_choice`): eager's ``F.conv2d`` on an NCHW activation and
oneDNN's prepacked ``_convolution_pointwise`` on an NHWC one (what ``layout_selection``
makes), interleaved per round, minimum over ``--rounds`` rounds; prints µs, the ratio
NHWC / NCHW, the multiply-adds (MACs) and what the size rule `conv_choice.choose`
picks, so the rule's threshold can be checked on a new CPU.
``models``: eager, opencann with ``layout_selection`` and with it disabled, rounds
interleaved in one process (median and min), on ResNet-50 (zoo) and on a
MobileNetV3-like stack (hardswish and sigmoid gates: unfused elementwise ops between
the convolutions, which is where the pass moves data). Prints the load average.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import opencann  # noqa: E402
from opencann import zoo  # noqa: E402
from opencann.devices.cpu import best_time_us  # noqa: E402

_RESNET50 = [(64, 256, 3, 1), (128, 512, 4, 2), (256, 1024, 6, 2), (512, 2048, 3, 2)]


def resnet50_convs():
    """(cin, cout, k, stride, input H) of ResNet-50's 53 convolutions after the stem."""
    out, cin, h = [], 64, 56
    for mid, cout, n, s in _RESNET50:
        for i in range(n):
            st = s if i == 0 else 1
            out += [(cin, mid, 1, 1, h), (mid, mid, 3, st, h), (mid, cout, 1, 1, h // st)]
            if i == 0:
                out.append((cin, cout, 1, st, h))
            cin, h = cout, h // st
    return out


def _best_ms(fn, reps=7):
    return best_time_us(fn, reps) / 1e3


def convs(batch: int) -> None:
    pw, reorder = torch.ops.mkldnn._convolution_pointwise, torch.ops.mkldnn._reorder_convolution_weight
    seen, tot = {}, {"NCHW": 0.0, "NHWC": 0.0, "nChw8c (opaque)": 0.0}
    for key in resnet50_convs():
        if key not in seen:
            ci, co, k, s, h = key
            w, b, p = torch.randn(co, ci, k, k), torch.randn(co), [k // 2] * 2
            x = torch.randn(batch, ci, h, h)
            wp = reorder(w, p, [s, s], [1, 1], 1, list(x.shape))
            wm = torch._C._nn.mkldnn_reorder_conv2d_weight(w.to_mkldnn(), p, [s, s], [1, 1], 1, list(x.shape))
            xn, xm = x.contiguous(memory_format=torch.channels_last), x.to_mkldnn()
            seen[key] = {
                "NCHW": _best_ms(lambda: pw(x, wp, b, p, [s, s], [1, 1], 1, "none", [], "")),
                "NHWC": _best_ms(lambda: pw(xn, wp, b, p, [s, s], [1, 1], 1, "none", [], "")),
                "nChw8c (opaque)": _best_ms(lambda: torch.mkldnn_convolution(xm, wm, b, p, [s, s], [1, 1], 1)),
            }
        for k2, v in seen[key].items():
            tot[k2] += v
    print(f"ResNet-50 convolutions, batch {batch}, {torch.get_num_threads()} thread(s), "
          f"load {os.getloadavg()[0]:.2f}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in tot.items()))


_SIZES = [(n, ci, co, k, h) for n in (1, 8) for ci, co in ((3, 8), (8, 8), (16, 16), (32, 32), (64, 64))
          for k in (1, 3) for h in (8, 16, 32, 56)]


def sizes(rounds: int) -> None:
    from opencann.ops.kernels.conv_choice import choose_for_shape
    pw, reorder = torch.ops.mkldnn._convolution_pointwise, torch.ops.mkldnn._reorder_convolution_weight
    print(f"{torch.get_num_threads()} thread(s), load {os.getloadavg()[0]:.2f}; "
          "shape (n, cin, cout, k, h): eager NCHW µs, oneDNN NHWC µs, NHWC/NCHW, MACs, rule")
    for n, ci, co, k, h in _SIZES:
        p = [k // 2] * 2
        w, b = torch.randn(co, ci, k, k), torch.randn(co)
        x = torch.randn(n, ci, h, h)
        xn = x.contiguous(memory_format=torch.channels_last)
        wp = reorder(w, p, [1, 1], [1, 1], 1, list(x.shape))
        fns = {"nchw": lambda: F.conv2d(x, w, b, 1, p),
               "nhwc": lambda: pw(xn, wp, b, p, [1, 1], [1, 1], 1, "none", [], "")}
        best = {key: float("inf") for key in fns}
        reps = max(1, min(50, int(2e6 // (n * ci * co * k * k * h * h) or 1)))
        for _ in range(rounds):
            for key, fn in fns.items():
                best[key] = min(best[key], best_time_us(fn, reps=reps))
        macs = n * ci * co * k * k * h * h
        kernel, _ = choose_for_shape(n, ci, co, k, k, h, h, 1)
        print(f"  {(n, ci, co, k, h)!s:24s} {best['nchw']:9.1f} {best['nhwc']:9.1f} "
              f"{best['nhwc'] / best['nchw']:6.2f} {macs / 1e6:8.2f}M  {kernel}")


class MobileNetish(nn.Module):
    """Conv + hardswish, depthwise conv as a sigmoid gate, residual add: elementwise
    ops between the convolutions that no fusion takes (hardswish decomposes)."""

    def __init__(self, c: int = 64, n: int = 6):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, 2, 1)
        self.convs = nn.ModuleList(nn.Conv2d(c, c, 3, 1, 1) for _ in range(n))
        self.dw = nn.ModuleList(nn.Conv2d(c, c, 3, 1, 1, groups=c) for _ in range(n))

    def forward(self, x):
        x = F.hardswish(self.stem(x))
        for c, d in zip(self.convs, self.dw):
            x = F.hardswish(c(x))
            x = x * torch.sigmoid(d(x)) + x
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)


def models(batch: int, rounds: int) -> None:
    torch.manual_seed(0)
    z = zoo.resnet50(batch)
    cases = {"resnet50": (z.model, z.example_inputs),
             "mobilenetish": (MobileNetish().eval(), (torch.randn(batch, 3, 224, 224),))}
    for name, (m, ins) in cases.items():
        fns = {"eager": lambda m=m: m(*ins),
               "layout_selection on": opencann.compile(m, ins),
               "off": opencann.compile(m, ins, options={"disable": ["layout_selection"]})}
        times = {k: [] for k in fns}
        with torch.no_grad():
            for k, f in fns.items():
                f(*ins) if k != "eager" else f()
            load0 = os.getloadavg()[0]
            for r in range(rounds):
                order = list(fns) if r % 2 == 0 else list(reversed(fns))
                for k in order:
                    t0 = time.perf_counter()
                    fns[k](*ins) if k != "eager" else fns[k]()
                    times[k].append((time.perf_counter() - t0) * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{name} batch {batch}, {torch.get_num_threads()} thread(s), load "
              f"{load0:.2f} -> {os.getloadavg()[0]:.2f}: " +
              ", ".join(f"{k} {med[k]:.1f} ms (min {min(times[k]):.1f})" for k in fns) +
              f"; off/on {med['off'] / med['layout_selection on']:.3f} (median), "
              f"{min(times['off']) / min(times['layout_selection on']):.3f} (min)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["convs", "models", "sizes"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.what == "convs":
        convs(args.batch)
    elif args.what == "sizes":
        sizes(args.rounds)
    else:
        models(args.batch, args.rounds)


if __name__ == "__main__":
    main()
