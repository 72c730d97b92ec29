"""LinearAct's fp32 GEMM kernels at encoder and prefill shapes, GFLOP/s in one process: the
panel GEMM (`opencann.ops.kernels.gemm_panel_cpu`, bound once per weight as LinearAct binds
it), oneDNN's inner product on its blocked weight (``onednn_packed``) and on nn.Linear's
(``onednn_plain``), MKL's ``addmm`` and, where onnxruntime is installed, its MLAS GEMM (a
one-node MatMul session with spinning off, the weight as an initializer: the peers'
kernel, run through a session's call, so its figure includes ~10-30 µs per call).

Shapes (M x K x N): BERT-base's at seq 128 (768x768, 768x2304 merged Q/K/V, 768x3072,
3072x768), a 125M Llama's prefill at 32 rows (768x2048, 768x4096 merged gate/up), and
768x3072 at 512 rows. Each kernel has ``--weights`` weights of the shape in rotation (8:
more than the 32 MiB L3 at the larger shapes, so a call reads its weight from memory as a
model's call does) and one x. Time: per round each kernel in turn, the least of
``--calls`` calls; reported: the median over ``--rounds`` rounds of those least times, as
GFLOP/s (2·M·K·N / time). Results agree with float64 to fp32 rounding (checked once per
shape). Writes ``--out`` (JSON).

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python bench/gemm_panel.py [--threads 2]
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from opencann.ops.kernels.gemm_panel_cpu import bind_panel, pack_panels  # noqa: E402

SHAPES = [(128, 768, 768), (128, 768, 2304), (128, 768, 3072), (128, 3072, 768),
          (32, 768, 2048), (32, 768, 4096), (512, 768, 3072)]


def mlas_runner(ws, m: int, k: int, n: int, threads: int):
    """A rotation runner over one-node ONNX Runtime MatMul sessions (None without onnxruntime)."""
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        return None
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sessions = []
    for w in ws:
        g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
                              [numpy_helper.from_array(w.t().contiguous().numpy(), "w")])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        sessions.append(ort.InferenceSession(model.SerializeToString(), so,
                                             providers=["CPUExecutionProvider"]))
    return lambda x, j: sessions[j].run(None, {"x": x.numpy()})


def runners(m: int, k: int, n: int, nw: int, threads: int) -> dict:
    """Kernel name -> ``run(x, j)`` on weight j of ``nw`` [n, k] weights (seeded)."""
    g = torch.Generator().manual_seed(m + k + n)
    ws = [torch.randn(n, k, generator=g) * k ** -0.5 for _ in range(nw)]
    bs = [torch.randn(n, generator=g) for _ in range(nw)]
    out = torch.empty(m, n)
    panels = [bind_panel(pack_panels(w, transposed=False), m, n) for w in ws]
    lin = torch.ops.mkldnn._linear_pointwise
    blocked = [torch.ops.mkldnn._reorder_linear_weight(w, m) for w in ws]
    kernels = {
        "panel": lambda x, j: panels[j](x, bs[j], out),
        "onednn_packed": lambda x, j: lin(x, blocked[j], bs[j], "none", [], ""),
        "onednn_plain": lambda x, j: lin(x, ws[j], bs[j], "none", [], ""),
        "addmm": lambda x, j: torch.addmm(bs[j], x, ws[j].t(), out=out),
    }
    mlas = mlas_runner(ws, m, k, n, threads)
    if mlas is not None:
        kernels["ort_mlas"] = mlas
    x = torch.randn(m, k, generator=g)
    ref = torch.nn.functional.linear(x.double(), ws[0].double(), bs[0].double())
    got = kernels["panel"](x, 0)
    assert (got.double() - ref).abs().max().item() < 1e-3, "panel GEMM disagrees with float64"
    return kernels, x


def measure(kernels: dict, x, nw: int, rounds: int, calls: int) -> dict:
    """Kernel -> the median over rounds of the least of ``calls`` calls (seconds)."""
    least = {name: [] for name in kernels}
    for _ in range(rounds):
        for name, run in kernels.items():
            run(x, 0)
            best = float("inf")
            for i in range(calls):
                t0 = time.perf_counter()
                run(x, i % nw)
                best = min(best, time.perf_counter() - t0)
            least[name].append(best)
    return {name: statistics.median(v) for name, v in least.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "gemm_panel.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{platform.machine()}, {os.cpu_count()} cores, {args.threads} threads, torch {torch.__version__}")
    print("| M x K x N | " + " | ".join(["panel", "onednn_packed", "onednn_plain", "addmm", "ort_mlas"]) + " |")
    print("|---|---|---|---|---|---|")
    for m, k, n in SHAPES:
        kernels, x = runners(m, k, n, args.weights, args.threads)
        t = measure(kernels, x, args.weights, args.rounds, args.calls)
        gf = {name: 2 * m * k * n / s / 1e9 for name, s in t.items()}
        rows.append(dict(m=m, k=k, n=n, gflops=gf))
        print(f"| {m}x{k}x{n} | " + " | ".join(f"{gf[c]:.0f}" if c in gf else "—" for c in
                                               ("panel", "onednn_packed", "onednn_plain", "addmm", "ort_mlas")) + " |",
              flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(command="bench/gemm_panel.py " + " ".join(sys.argv[1:] if argv is None else argv),
                       threads=args.threads, weights=args.weights, rounds=args.rounds,
                       calls=args.calls, torch=torch.__version__, rows=rows), f, indent=2)
    print(f"written to {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()
