"""AddLayerNormQuant in the graph, before / after its one-pass kernel, A/B in one process.

"before": the node's former kernel, ATen's ``add`` + ``native_layer_norm`` then the uint8
quantization pass (three passes over the activation, fresh outputs); "after": the one
numba pass writing the planned buffers (``ops/kernels/add_layer_norm_quant_cpu.py``).
Each model is compiled twice (``opencann.quantize``, all linears static int8, bf16
elsewhere; with ``--tune S`` also ``opencann.tune`` over fp32 / bf16 / int8 with
``bench/peers_precision.py``'s gate and calibration and S seconds of budget, each tuning
run with its variant's kernel), then
the two are called interleaved (``--rounds`` rounds of 4 calls each). Printed: the load
average before and after, each variant's call time (median, 10th percentile, minimum)
and AddLayerNormQuant's kernel time inside those calls (a timer around the kernel call).
Run:

    .venv/bin/python bench/add_layer_norm_quant.py [--models bert-base minilm] [--rounds 15] [--tune 60]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import opencann  # noqa: E402
from opencann import zoo  # noqa: E402
from opencann.ops.kernels import add_layer_norm_quant_cpu as alnq  # noqa: E402
from opencann.ops.kernels.add_layer_norm_cast_cpu import add_layer_norm_f32  # noqa: E402
from opencann.ops.kernels.int8_cpu import quantize_u8  # noqa: E402
from opencann.ops.opdef import get_op  # noqa: E402
from opencann.tools.quantize import create_quant_config  # noqa: E402
from peers_precision import output_gate  # noqa: E402
from precision import calibration_for  # noqa: E402

BF16 = {"precision_mode": "allow_mix_precision_bf16"}
MODE = ["after"]
TIMES = collections.defaultdict(list)
_ONE_PASS = alnq.OnePass.__call__


def _before(self, x1, x2, out=None):
    """The former kernel: ATen's add + native_layer_norm, then the quantization pass."""
    w, b, eps, step, offset = self.args
    y = add_layer_norm_f32(x1, x2, w, b, eps, "add_layer_norm_quant")
    return y, quantize_u8(y, step, offset)


def _timed(self, x1, x2, out=None):
    f = _before if MODE[0] == "before" else _ONE_PASS
    t = time.perf_counter()
    r = f(self, x1, x2, out)
    TIMES[MODE[0]].append(time.perf_counter() - t)
    return r


@contextlib.contextmanager
def variant(name: str):
    """Compile and call with ``name``'s kernel: "before" also binds without ``out=`` (the
    former kernel allocated its outputs)."""
    op = get_op("AddLayerNormQuant")
    keep = op.out_capable
    MODE[0] = name
    if name == "before":
        object.__setattr__(op, "out_capable", None)
    try:
        yield
    finally:
        object.__setattr__(op, "out_capable", keep)


def build(name: str, tune_s: float):
    """{label: (variant, compiled)} for one zoo model, and its inputs."""
    zm = zoo.get(name, batch=1)
    m, x = zm.model, zm.example_inputs
    out = {}
    for v in ("before", "after"):
        with variant(v):
            out[f"int8+bf16 {v}"] = (v, opencann.quantize(m, [x], config=create_quant_config(), options=BF16))
            if tune_s:
                out[f"tuned {v}"] = (v, opencann.tune(m, x, time_budget_s=tune_s, budget=output_gate,
                                                      candidates=("fp32", "bf16", "int8"),
                                                      calibration=calibration_for(zm)).compiled)
    return out, x


def _stats(v):
    v = sorted(v)
    return v[len(v) // 2], v[len(v) // 10], v[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=["bert-base", "minilm"])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tune", type=float, default=0.0, help="opencann.tune's time budget (s); 0: no tuned rows")
    a = ap.parse_args()
    alnq.OnePass.__call__ = _timed
    for name in a.models:
        rows, x = build(name, a.tune)
        for label, (v, cm) in rows.items():
            MODE[0] = v
            for _ in range(3):
                cm(*x)
        TIMES.clear()
        calls = collections.defaultdict(list)
        print(f"{name}: load before {open('/proc/loadavg').read().split()[:3]}")
        for _ in range(a.rounds):
            for label, (v, cm) in rows.items():
                MODE[0] = v
                for _ in range(4):
                    t = time.perf_counter()
                    cm(*x)
                    calls[label].append(time.perf_counter() - t)
        print(f"{name}: load after {open('/proc/loadavg').read().split()[:3]}")
        for label in rows:
            med, p10, lo = _stats(calls[label])
            print(f"  {label:18s} call median {med * 1e3:7.2f} ms  p10 {p10 * 1e3:7.2f}  min {lo * 1e3:7.2f}")
        for v in ("before", "after"):
            med, p10, lo = _stats(TIMES[v])
            print(f"  AddLayerNormQuant {v:6s} (all its rows' calls) median {med * 1e6:5.0f} us  p10 {p10 * 1e6:5.0f}  "
                  f"min {lo * 1e6:5.0f}")


if __name__ == "__main__":
    with torch.no_grad():
        main()
