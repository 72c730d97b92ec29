"""Reduced precision side by side: speed-up over eager fp32 and cosine with eager fp32's
output, batch 1, in one process, rounds interleaved (a load burst hits every row).

Rows (each a zero-argument runner on the same inputs):
  eager fp32         the module under ``torch.no_grad`` (the reference: speed-up 1.00x)
  eager bf16         the same under ``torch.autocast("cpu", dtype=torch.bfloat16)``
  opencann fp32      ``opencann.compile(model, inputs)``
  opencann bf16      ``opencann.compile(..., options={"precision_mode": "allow_mix_precision_bf16"})``
  opencann int8      ``opencann.quantize``: ResNet-50 static (calibrated on 4 batches of
                     the photo flipped / shifted / with noise), BERT-base dynamic linears
                     with the FFN down-projections kept fp32 (docs/guide/quantization.md)
  opencann int8+bf16 transformers: static int8 linears inside the bf16 graph
                     (``opencann.quantize(..., options={"precision_mode":
                     "allow_mix_precision_bf16"})``: they read and write bf16, the norms write
                     their uint8 input), the FFN down-projections kept in bf16
  onnxruntime int8   ONNX Runtime on the ONNX export quantized by ``quantize_static`` (QDQ,
                     the same calibration batches) for ResNet-50, ``quantize_dynamic`` for
                     BERT-base; spinning off; only when onnxruntime is importable
  opencann int8 (ONNX QDQ file)  ResNet-50: that same QDQ file compiled by opencann
                     (``qdq_to_int8``: oneDNN's int8 kernels)
  openvino default   the ONNX export on OpenVINO's CPU plugin with its default precision
                     (bf16 where the CPU has avx512_bf16/AMX), ``PERFORMANCE_HINT=LATENCY``;
                     only when ``openvino`` is importable (it is never installed from here)

Inputs are "real-ish": ResNet-50 gets a real photograph (`opencann.zoo.sample_image`,
ImageNet-normalized), BERT-base a seeded random token sequence of length 128. Each
figure is the least of ``--rounds`` x ``--runs`` calls (robust on a loaded machine;
the least call is what the kernels can do, not what a busy neighbour left over).
Cosine: of the flattened first output with eager fp32's (1.0 = same direction).

    .venv/bin/python bench/precision.py                       # both models, 5 x 3 calls
    .venv/bin/python bench/precision.py --models resnet50 --rounds 3 --runs 2
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import opencann  # noqa: E402
from opencann import zoo  # noqa: E402
from peers import export_onnx, first_tensor, interleaved  # noqa: E402

BF16 = "allow_mix_precision_bf16"
MODELS = ("resnet50", "bert-base")


def inputs_for(name: str, batch: int = 1) -> zoo.ZooModel:
    """The zoo model at ``batch`` with its benchmark inputs (a real image for ResNet-50,
    repeated over the batch)."""
    zm = zoo.get(name, batch=batch)
    if name == "resnet50":
        zm.example_inputs = (zoo.sample_image(224).repeat(batch, 1, 1, 1),)
    return zm


def calibration_for(zm: zoo.ZooModel) -> List[tuple]:
    """4 calibration batches shaped as the example: for an image, the example flipped,
    shifted and with noise (seeded; no dataset ships here); else the example itself."""
    x = zm.example_inputs
    if zm.name != "resnet50":
        return [x]
    g = torch.Generator().manual_seed(0)
    out = []
    for k in range(4):
        img = x[0].flip(-1) if k % 2 else x[0]
        img = torch.roll(img, shifts=7 * k, dims=-2) + 0.1 * torch.randn(img.shape, generator=g)
        out.append((img,))
    return out


def int8_runners(zm: zoo.ZooModel, workdir: str) -> Dict[str, Callable]:
    """The int8 rows: opencann's, and ONNX Runtime's when it is importable."""
    from opencann.tools.quantize import create_quant_config
    m, x = zm.model, zm.example_inputs
    cal = calibration_for(zm)
    if zm.name == "resnet50":
        cfg = create_quant_config()
    else:
        fp = opencann.compile(m, x)
        ffn_down = sorted({n.scope for n in fp.graph.nodes if n.op == "LinearAct"
                           and n.scope.endswith("output.dense") and "attention" not in n.scope})
        cfg = create_quant_config(ffn_down, mode="dynamic")
    q = opencann.quantize(m, cal, config=cfg)
    rows = {"opencann int8": lambda: first_tensor(q(*x))}
    if zm.name != "resnet50":    # int8 linears inside the bf16 graph, static, calibrated
        qb = opencann.quantize(m, cal, config=create_quant_config(ffn_down), options={"precision_mode": BF16})
        rows["opencann int8+bf16"] = lambda: first_tensor(qb(*x))
    try:
        import onnxruntime as ort
        from onnxruntime import quantization as oq
    except ImportError:
        print("  onnxruntime int8: skipped (onnxruntime is not installed)")
        return rows
    path = export_onnx(m, x, os.path.join(workdir, f"{zm.name}.onnx"))
    qpath = os.path.join(workdir, f"{zm.name}.int8.onnx")
    sess0 = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess0.get_inputs()]
    if zm.name == "resnet50":
        class Reader(oq.CalibrationDataReader):
            def __init__(self):
                self.it = iter([{names[0]: c[0].numpy()} for c in cal])

            def get_next(self):
                return next(self.it, None)
        oq.quantize_static(path, qpath, Reader(), quant_format=oq.QuantFormat.QDQ,
                           per_channel=True, weight_type=oq.QuantType.QInt8)
    else:
        oq.quantize_dynamic(path, qpath, weight_type=oq.QuantType.QInt8)
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(qpath, so, providers=["CPUExecutionProvider"])
    feed = {n: t.numpy() for n, t in zip(names, x)}
    rows["onnxruntime int8"] = lambda: torch.from_numpy(sess.run(None, feed)[0])
    if zm.name == "resnet50":   # the same QDQ file on opencann's int8 kernels (qdq_to_int8)
        cq = opencann.compile(qpath)
        rows["opencann int8 (ONNX QDQ file)"] = lambda: first_tensor(cq(*x)[0])
    return rows


def own_runners(zm: zoo.ZooModel, workdir: str) -> Dict[str, Callable]:
    """The eager and opencann rows (fp32, bf16, int8) and ONNX Runtime's int8: row name ->
    zero-argument runner returning the model's first output tensor."""
    m, x = zm.model, zm.example_inputs

    def eager():
        with torch.no_grad():
            return first_tensor(m(*x))

    def eager_bf16():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return first_tensor(m(*x))

    fp32 = opencann.compile(m, x)
    bf16 = opencann.compile(m, x, options={"precision_mode": BF16})
    rows = {"eager fp32": eager, "eager bf16 (autocast)": eager_bf16,
            "opencann fp32": lambda: first_tensor(fp32(*x)),
            "opencann bf16": lambda: first_tensor(bf16(*x))}
    rows.update(int8_runners(zm, workdir))
    return rows


def runners_for(zm: zoo.ZooModel, workdir: str) -> Dict[str, Callable]:
    """`own_runners` and, when openvino is importable, OpenVINO's default precision."""
    m, x = zm.model, zm.example_inputs
    rows = own_runners(zm, workdir)
    try:
        import openvino as ov
    except ImportError:
        print("  openvino default: skipped (openvino is not installed in this environment)")
        return rows
    path = export_onnx(m, x, os.path.join(workdir, f"{zm.name}.onnx"))
    compiled = ov.Core().compile_model(path, "CPU", {"PERFORMANCE_HINT": "LATENCY",
                                                     "INFERENCE_NUM_THREADS": torch.get_num_threads(),
                                                     "NUM_STREAMS": 1})
    req, feed = compiled.create_infer_request(), [t.numpy() for t in x]

    def ov_default():
        req.infer(feed)
        return torch.from_numpy(req.get_output_tensor(0).data.copy())
    rows["openvino default"] = ov_default
    return rows


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two tensors' flattened fp64 values."""
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-300))


def main(argv: List[str] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", choices=MODELS, default=list(MODELS))
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--runs", type=int, default=3, help="calls per row per round (default 3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, least of {args.rounds} x "
          f"{args.runs} interleaved calls per row, batch {args.batch}")
    table = []
    with tempfile.TemporaryDirectory(prefix="opencann-precision-") as work:
        for name in args.models:
            zm = inputs_for(name, args.batch)
            t0 = time.perf_counter()
            rows = runners_for(zm, work)
            print(f"{name}: built in {time.perf_counter() - t0:.0f} s", flush=True)
            ref = rows["eager fp32"]().float()
            cos = {r: cosine(fn().float(), ref) for r, fn in rows.items()}
            times = interleaved(rows, args.rounds, args.runs)
            best = {r: min(t) for r, t in times.items()}
            for r in rows:
                table.append((name, r, best[r], best["eager fp32"] / best[r], cos[r]))
    print("\n| model | row | ms (least) | speed-up over eager fp32 | cosine vs eager fp32 |")
    print("|---|---|---|---|---|")
    for name, r, ms, sp, c in table:
        print(f"| {name} | {r} | {ms:.1f} | {sp:.2f}x | {c:.6f} |")


if __name__ == "__main__":
    main()
