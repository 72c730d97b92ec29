"""int8 on a CPU without VNNI: 7-bit weights on oneDNN's kernels against the fp32
emulation and fp32, on a BERT-base-sized stack of FFN linears and a small CNN.

Rows (one process, rounds interleaved; each figure the least of ``--rounds`` x ``--runs``
calls in ms; cosine of the output with eager fp32's):
  opencann fp32          ``opencann.compile(model, x)``
  int8 8-bit, emulated   ``opencann.quantize`` with weights in [-127, 127]: on a CPU without
                         VNNI its oneDNN products would saturate, so every layer runs the
                         fp32 emulation (`int8_emulated`; what such a CPU ran before 7-bit
                         weights, and what an 8-bit model from a VNNI host runs there)
  int8 7-bit, emulated   the same 7-bit weights as the next row on the emulation (the
                         kernels' bound patched to None): the kernel's own gain
  int8 7-bit, oneDNN     ``opencann.quantize`` as it is on this CPU (`int8_weight_bound`)

On a CPU with VNNI the 8-bit row runs oneDNN too and the 7-bit rows only show the
accuracy cost. The machine is what `opencann doctor` says; a shared one moves figures by
10% or more between runs.

    .venv/bin/python bench/int8_7bit.py                  # both models, 5 x 3 calls
    .venv/bin/python bench/int8_7bit.py --models ffn --rounds 3 --runs 2
"""
from __future__ import annotations

import argparse
import time

import torch

import opencann
import opencann.ops.kernels.int8_cpu as int8_cpu
from opencann.devices.cpu import int8_weight_bound, isa
from opencann.passes.fusion import quantize_int8


def ffn(layers: int = 2) -> torch.nn.Module:
    """BERT-base's FFN (768 → 3072 GELU → 768, with a residual) ``layers`` times, seq 128."""
    class Ffn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(768, 3072), torch.nn.Linear(3072, 768)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(x)))
    return torch.nn.Sequential(*[Ffn() for _ in range(layers)]).eval()


def cnn() -> torch.nn.Module:
    """Conv-ReLU stem and two residual blocks at 64 channels on 56 x 56, mean, Linear."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.Conv2d(64, 64, 3, padding=1)

        def forward(self, x):
            return torch.relu(self.b(torch.relu(self.a(x))) + x)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(), Block(), Block(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10)).eval()


MODELS = {"ffn": (ffn, (128, 768)), "cnn": (cnn, (1, 3, 56, 56))}


def variants(model: torch.nn.Module, shape) -> dict:
    """{row name: compiled model} for `MODELS`' ``model`` at input ``shape``."""
    g = torch.Generator().manual_seed(1)
    cal = [torch.randn(*shape, generator=g) for _ in range(4)]
    out = {"opencann fp32": opencann.compile(model, cal[0])}
    qmax, bound = quantize_int8.int8_weight_qmax, int8_cpu.int8_weight_bound
    try:
        quantize_int8.int8_weight_qmax = lambda: 127
        out["int8 8-bit, emulated"] = opencann.quantize(model, cal)
        quantize_int8.int8_weight_qmax = qmax
        int8_cpu.int8_weight_bound = lambda: None
        out["int8 7-bit, emulated"] = opencann.quantize(model, cal)
    finally:
        quantize_int8.int8_weight_qmax, int8_cpu.int8_weight_bound = qmax, bound
    out["int8 7-bit, oneDNN"] = opencann.quantize(model, cal)
    return out


def measure(name: str, rounds: int, runs: int) -> None:
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = model(x)
    rows = variants(model, shape)
    best = {k: float("inf") for k in rows}
    for fn in rows.values():
        fn(x)
    for _ in range(rounds):
        for k, fn in rows.items():
            for _ in range(runs):
                t0 = time.perf_counter()
                fn(x)
                best[k] = min(best[k], time.perf_counter() - t0)
    print(f"\n{name} {list(shape)}: int8_weight_bound() = {int8_weight_bound()}, ISA {isa()}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'row':24s} {'ms':>8s} {'vs fp32':>8s} {'cosine':>9s}")
    for k, fn in rows.items():
        cos = torch.nn.functional.cosine_similarity(fn(x).flatten().double(), ref.flatten().double(), 0).item()
        print(f"{k:24s} {best[k] * 1e3:8.2f} {best['opencann fp32'] / best[k]:7.2f}x {cos:9.6f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    for name in a.models:
        measure(name, a.rounds, a.runs)


if __name__ == "__main__":
    main()
