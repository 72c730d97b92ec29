"""Every precision side by side (issue #28 item 6; `bench/peers.py --precision` runs this):
the same inputs and the same accuracy gate for every row, speed-up over eager fp32.

Rows (each a zero-argument runner returning the model's first output):
  eager fp32 / eager bf16        the module; bf16 under ``torch.autocast("cpu", bfloat16)``
  opencann fp32 / bf16           ``opencann.compile``; bf16 = ``allow_mix_precision_bf16``
  opencann int8                  ``opencann.quantize`` (static, calibrated, for ResNet-50;
                                 dynamic linears for the transformers, FFN down-projections
                                 kept fp32; `bench/precision.py`'s ``int8_runners``)
  opencann int8+bf16             transformers: static int8 linears inside the bf16 graph,
                                 FFN down-projections kept bf16 (``int8_runners``)
  opencann tuned                 ``opencann.tune(model, inputs, candidates=("fp32", "bf16",
                                 "int8"), budget=output_gate)``: the per-node search
                                 under the table's own gate (below)
  openvino f32 / default / int8  the ONNX export on OpenVINO's CPU plugin with
                                 ``INFERENCE_PRECISION_HINT=f32``, with its default
                                 (bf16 where the CPU has avx512_bf16 / AMX), and NNCF's
                                 ``nncf.quantize`` of it on the calibration inputs
  onnxruntime fp32 / int8        ``ORT_ENABLE_ALL``; int8 = ``quantize_dynamic`` for the
                                 transformers, ``quantize_static`` (QDQ, per-channel,
                                 calibrated) for ResNet-50; intra-op spinning off, so its
                                 idle threads do not slow the rows after it

Gate (the output rule `opencann.tune` applies; msprobe's): a row passes when its first
output has NaN/Inf where eager fp32's has them and a cosine with it above 0.99. A failing
row is shown, marked, and not counted for "best peer". The table also gives max abs error.
Inputs: ResNet-50 a real photograph (`opencann.zoo.sample_image`) repeated to the batch,
calibration on shifted/flipped/noised copies; transformers seeded random tokens, seq 128.
Timing: `peers.interleaved` (rounds in rotating order, median of all calls), all rows in
one process at ``--threads``; each table is headed by the load average. On a shared host
run it with ``OMP_WAIT_POLICY=PASSIVE`` in the environment (read at ``import torch``):
torch's OpenMP threads (eager's and opencann's rows) otherwise spin at every barrier while
their partner waits for a CPU, and OpenVINO's and ONNX Runtime's pools do not, so load
moves the torch rows' medians 10-40x and the peers' hardly (MiniLM bf16 at load 4.4:
median 972 ms by default, 21.5 ms passive, same minute).

    .venv/bin/python bench/peers_precision.py [--models resnet50 bert-base minilm]
        [--batches 1 8] [--rounds 3] [--runs 3] [--no-tune] [--bf16 auto|on|off] [--out FILE]

``--bf16 auto`` (default): the bf16 rows and tune's bf16 candidate only where oneDNN's bf16
kernels run (AVX-512 BW/VL, AVX-NE-CONVERT or AMX); elsewhere bf16 runs on ATen's reference
kernels, rows that only measure their absence (eager BERT-base at batch 1 under autocast:
3.0 s a call against 1.0 s in fp32 on the AVX2-only EPYC while another job ran). Progress
(each model's stage, with the time) goes to stderr.

Needs the extra ``bench`` (onnxruntime, openvino, nncf); a missing peer is reported and
skipped. Writes bench/results/peers_precision.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from typing import Callable, Dict, List, Tuple

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
import opencann  # noqa: E402
from opencann import zoo  # noqa: E402
from opencann.tools.compare import metrics  # noqa: E402
from opencann.tools.tune_gate import COSINE_FAIL  # noqa: E402
from peers import export_onnx, first_tensor, interleaved, label  # noqa: E402
from precision import calibration_for, own_runners  # noqa: E402

PEERS = ("openvino", "onnxruntime")


def model_for(name: str, batch: int) -> zoo.ZooModel:
    """The zoo model at ``batch`` with its benchmark inputs (a real image for ResNet-50)."""
    zm = zoo.get(name, batch=batch)
    if name == "resnet50":
        zm.example_inputs = (zoo.sample_image(224).repeat(batch, 1, 1, 1),)
    return zm


def output_gate(actual, expected) -> bool:
    """The table's gate (`gate`) as an ``opencann.tune`` budget: the first output has
    NaN/Inf where eager fp32's has them and a cosine with it above 0.99."""
    return gate(first_tensor(actual), first_tensor(expected).float())["passed"]


def ours(zm: zoo.ZooModel, work: str, tune: bool, bf16: bool = True) -> Dict[str, Callable]:
    """eager and opencann rows and ONNX Runtime's int8 (`precision.own_runners`), and the
    tuned row: ``opencann.tune`` over fp32 / bf16 / int8 (static, calibrated on
    `calibration_for`) judged by the table's own gate (`output_gate`), the rule every
    other row passes or fails by. ``bf16`` False: no bf16 row and no bf16 candidate."""
    rows = own_runners(zm, work)
    if not bf16:
        rows = {k: v for k, v in rows.items() if "bf16" not in k}
    if tune:
        progress(f"{zm.name}: opencann.tune (time budget 120 s)")
        tuned = opencann.tune(zm.model, zm.example_inputs, time_budget_s=120, budget=output_gate,
                              candidates=("fp32", "bf16", "int8") if bf16 else ("fp32", "int8"),
                              calibration=calibration_for(zm)).compiled
        rows["opencann tuned"] = lambda: first_tensor(tuned(*zm.example_inputs))
    return rows


def openvino_rows(zm: zoo.ZooModel, path: str, threads: int) -> Dict[str, Callable]:
    """OpenVINO f32, default and NNCF int8 rows on the ONNX file ``path``."""
    import openvino as ov
    core = ov.Core()
    base = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1}
    feed = [t.numpy() for t in zm.example_inputs]
    models = {"openvino f32": (core.read_model(path), dict(base, INFERENCE_PRECISION_HINT="f32")),
              "openvino default": (core.read_model(path), base)}
    try:
        import nncf
        cal = [tuple(t.numpy() for t in c) for c in calibration_for(zm)]
        kind = None if zm.name == "resnet50" else nncf.ModelType.TRANSFORMER
        q = nncf.quantize(core.read_model(path), nncf.Dataset(cal, list), model_type=kind,
                          subset_size=len(cal))
        models["openvino int8"] = (q, base)
    except ImportError:
        print("  openvino int8: skipped (nncf is not installed: pip install -e .[bench])")
    rows = {}
    for name, (model, cfg) in models.items():
        req = core.compile_model(model, "CPU", cfg).create_infer_request()
        rows[name] = lambda r=req: torch.from_numpy(np.array(r.infer(feed)[0]))
    return rows


def onnxruntime_row(zm: zoo.ZooModel, path: str, threads: int) -> Dict[str, Callable]:
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    feed = {i.name: t.numpy() for i, t in zip(sess.get_inputs(), zm.example_inputs)}
    return {"onnxruntime fp32": lambda: torch.from_numpy(sess.run(None, feed)[0])}


def progress(what: str) -> None:
    """One progress line on stderr, flushed (stdout to a file is block-buffered)."""
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def use_bf16(choice: str) -> bool:
    """Whether the bf16 rows run: ``on``, ``off``, or ``auto`` = where oneDNN's bf16
    kernels run on this CPU (`opencann.devices.cpu.onednn_bf16_available`: AVX-512 BW/VL,
    AVX-NE-CONVERT or AMX). Elsewhere bf16 runs on ATen's reference kernels, slower than
    fp32: rows that only measure their absence (module docstring)."""
    if choice != "auto":
        return choice == "on"
    from opencann.devices.cpu import onednn_bf16_available
    return onednn_bf16_available()


def build(name: str, batch: int, threads: int, tune: bool, work: str,
          bf16: bool = True) -> Tuple[Dict[str, Callable], zoo.ZooModel]:
    zm = model_for(name, batch)
    progress(f"{name} batch {batch}: compiling the opencann rows")
    rows = ours(zm, work, tune, bf16)
    progress(f"{name} batch {batch}: the peers (export, OpenVINO, NNCF, ONNX Runtime)")
    path = export_onnx(zm.model, zm.example_inputs, os.path.join(work, f"{name}-b{batch}.onnx"))
    for peer, fn in (("openvino", openvino_rows), ("onnxruntime", onnxruntime_row)):
        try:
            rows.update(fn(zm, path, threads))
        except ImportError:
            print(f"  {peer}: skipped (not installed: pip install -e .[bench])")
    return rows, zm


def gate(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """The row's accuracy against eager fp32 and the gate's verdict (module docstring)."""
    m = metrics(out.float(), ref)
    ok = not m["note"] and m["cosine"] > COSINE_FAIL
    why = m["note"] or ("" if ok else f"cosine {m['cosine']:.5f} <= {COSINE_FAIL}")
    return {"cosine": m["cosine"], "max_abs": m["max_abs"], "passed": ok, "why": why}


def row_result(name: str, batch: int, rows: Dict[str, Callable], rounds: int, runs: int) -> dict:
    load = os.getloadavg()
    ref = rows["eager fp32"]().float()
    acc = {r: gate(fn(), ref) for r, fn in rows.items()}
    times = interleaved(rows, rounds, runs)
    med = {r: float(np.median(t)) for r, t in times.items()}
    e = med["eager fp32"]
    speed = {r: e / t for r, t in med.items()}
    passing = {r: s for r, s in speed.items() if acc[r]["passed"]}
    best_peer = max((s, r) for r, s in passing.items() if r.split()[0] in PEERS) \
        if any(r.split()[0] in PEERS for r in passing) else None
    return dict(model=name, batch=batch, median_ms=med, speedup=speed, accuracy=acc,
                best_peer=best_peer[1] if best_peer else None, load=load,
                omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"))


def print_rows(r: dict) -> None:
    print(f"\n{label(r['model'], 128 if r['model'] != 'resnet50' else None)}, batch {r['batch']} "
          f"(load average {r['load'][0]:.2f} before, {os.getloadavg()[0]:.2f} after; "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')})")
    print("| row | ms | x eager fp32 | cosine | max abs | gate |")
    print("|---|---|---|---|---|---|")
    for row, ms in r["median_ms"].items():
        a = r["accuracy"][row]
        verdict = "pass" if a["passed"] else f"FAIL ({a['why']})"
        print(f"| {row} | {ms:.1f} | {r['speedup'][row]:.2f} | {a['cosine']:.5f} | "
              f"{a['max_abs']:.3g} | {verdict} |")
    if r["best_peer"]:
        bp = r["speedup"][r["best_peer"]]
        mine = {k: v for k, v in r["speedup"].items() if k.startswith("opencann")
                and r["accuracy"][k]["passed"]}
        best = max(mine, key=mine.get)
        print(f"best passing peer: {r['best_peer']} {bp:.2f}x; best opencann: {best} "
              f"{mine[best]:.2f}x = {mine[best] / bp:.2f} of it")


def main(argv: List[str] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["resnet50", "bert-base", "minilm"])
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-tune", action="store_true", help="skip the opencann tuned row")
    ap.add_argument("--bf16", choices=("auto", "on", "off"), default="auto",
                    help="bf16 rows: auto = where oneDNN's bf16 kernels run on this CPU (default)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "peers_precision.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    bf16 = use_bf16(a.bf16)
    if not bf16:
        print("bf16 rows skipped (--bf16 on to run them): oneDNN's bf16 kernels do not run on this CPU")
    results = []
    with tempfile.TemporaryDirectory(prefix="opencann-precision-") as work:
        for name in a.models:
            for b in a.batches:
                rows, _ = build(name, b, a.threads, not a.no_tune, work, bf16)
                progress(f"{name} batch {b}: timing {len(rows)} rows")
                r = row_result(name, b, rows, a.rounds, max(1, a.runs // 2) if b > 1 else a.runs)
                print_rows(r)
                sys.stdout.flush()
                results.append(r)
    with open(os.path.join(os.path.dirname(a.out) or ".", os.path.basename(a.out)), "w") as f:
        json.dump(dict(date=datetime.date.today().isoformat(), threads=a.threads,
                       load=os.getloadavg(), command="bench/peers_precision.py "
                       + " ".join(argv if argv is not None else sys.argv[1:]), rows=results),
                  f, indent=1, default=str)


if __name__ == "__main__":
    main()
