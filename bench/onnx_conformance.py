"""ONNX conformance: onnx's own backend test data through the ``opencann atc`` path.

Every ``node`` case of the installed onnx package (generated in memory from
``onnx/backend/test/case/node``, as ``onnx.backend.test.loader`` does; the wheel ships no
``data/node`` directory) and every ``light`` model (``onnx/backend/test/data/light``:
AlexNet, DenseNet-121, Inception v1/v2, ResNet-50, ShuffleNet, SqueezeNet, VGG-19,
ZFNet-512 at opsets 6-9, with ONNX's stored reference outputs for its dummy inputs) is
written to an ``.onnx`` file, compiled from that file and saved exactly as ``opencann
atc --framework 5`` does (``opencann.compile(path)`` + ``opencann.save``), loaded back
with ``opencann.load``, run on each of the case's data sets and compared with the
expected outputs by the suite's own ``Runner.assert_similar_outputs`` (its rtol/atol).

Each case ends in one class: ``pass``; ``unsupported_dtype`` (an element type the IR does
not model: uint16/32/64, 4-bit, float8/4, string; bfloat16 inputs); ``not_tensor``
(sequence / optional / map values); or a failure at ``compile``, ``save``, ``load``,
``run`` or ``compare``, grouped by the error's kind (ConversionError.kind) or its type
and normalised first line. The pass rate is over all cases and over the cases with
supported types.

Usage:
    python bench/onnx_conformance.py                # all node + light cases (~10-20 min)
    python bench/onnx_conformance.py --quick        # every 15th node case + 1 light model
    python bench/onnx_conformance.py --match resize --show 20 --json out.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
import time
import warnings
from typing import Dict, List, Optional, Tuple

os.environ.setdefault("OPENCANN_LOG_LEVEL", "ERROR")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import torch  # noqa: E402

SUPPORTED_ELEM = {1, 2, 3, 5, 6, 7, 9, 10, 11, 14}    # float, u8, i8, i16, i32, i64, bool, f16, f64, c64


def _elem_types(model) -> List[int]:
    g = model.graph
    out = []
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.HasField("tensor_type"):
            out.append(vi.type.tensor_type.elem_type)
    out += [t.data_type for t in g.initializer]
    for n in g.node:
        for a in n.attribute:
            if a.name == "to":
                out.append(a.i)
            if a.name == "value" and a.HasField("t"):
                out.append(a.t.data_type)
    return out


def classify_input(model) -> Optional[str]:
    """'not_tensor' / 'unsupported_dtype' for a case opencann does not take by design, else None."""
    for vi in list(model.graph.input) + list(model.graph.output):
        if not vi.type.HasField("tensor_type"):
            return "not_tensor"
    if any(t not in SUPPORTED_ELEM for t in _elem_types(model)):
        return "unsupported_dtype"
    return None


def node_cases(match: str = ""):
    """(name, model, data_sets [(inputs, outputs)], rtol, atol) of every node case."""
    from onnx.backend.test.loader import load_model_tests
    for c in load_model_tests(kind="node"):
        if match and not re.search(match, c.name):
            continue
        yield c.name, c.model, c.data_sets, c.rtol, c.atol


def light_cases(match: str = ""):
    """The light models with dummy inputs made as onnx's runner makes them and the stored
    expected outputs (``light_<name>_output_0.pb``)."""
    from onnx import numpy_helper
    from onnx.backend.test.runner import Runner
    d = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
    for f in sorted(os.listdir(d)):
        if not f.endswith(".onnx"):
            continue
        name = "test_" + f[len("light_"):-len(".onnx")]
        if match and not re.search(match, name):
            continue
        model = onnx.load(os.path.join(d, f))
        inits = {i.name for i in model.graph.initializer}
        ins = [Runner.generate_dummy_data(x, seed=0, name=name[len("test_"):], random=False)
               for x in model.graph.input if x.name not in inits]
        outs = []
        for i in range(len(model.graph.output)):
            p = os.path.join(d, f"{f[:-5]}_output_{i}.pb")
            t = onnx.TensorProto()
            with open(p, "rb") as fh:
                t.ParseFromString(fh.read())
            outs.append(numpy_helper.to_array(t))
        yield name, model, [(ins, outs)], 1e-3, 1e-5


def _norm(msg: str) -> str:
    first = (msg.strip().splitlines() or [""])[0]
    first = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", first)
    first = re.sub(r"\d+", "N", first)
    return first[:140]


def _to_np(x):
    from onnx import numpy_helper
    return numpy_helper.to_array(x) if isinstance(x, onnx.TensorProto) else np.asarray(x)


def run_case(model, data_sets, rtol, atol, workdir: str) -> Tuple[str, str]:
    """(class, reason) of one case through compile-from-file + save + load + run + compare."""
    import opencann
    from onnx.backend.test.runner import Runner
    pre = classify_input(model)
    if pre:
        return pre, ""
    src, ocm = os.path.join(workdir, "m.onnx"), os.path.join(workdir, "m.ocm")
    stage = "compile"
    try:
        onnx.save(model, src)
        cm = opencann.compile(src)
        stage = "save"
        opencann.save(cm, ocm)
        stage = "load"
        lm = opencann.load(ocm)
        for ins, outs in data_sets:
            stage = "run"
            ts = [torch.from_numpy(np.array(_to_np(x))) for x in ins]
            got = lm(*ts)
            got = [g.numpy() for g in (got if isinstance(got, (list, tuple)) else [got])]
            stage = "compare"
            Runner.assert_similar_outputs([_to_np(o) for o in outs], got, rtol=rtol, atol=atol)
    except Exception as e:  # noqa: BLE001 - every failure is classified
        kind = getattr(e, "kind", None) or type(e).__name__
        return f"{stage}:{kind}", _norm(str(e))
    return "pass", ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="every 15th node case + 1 light model")
    ap.add_argument("--match", default="", help="regex on case names")
    ap.add_argument("--show", type=int, default=3, help="case names shown per failure class")
    ap.add_argument("--json", help="write every case's class and reason here")
    ap.add_argument("--no-light", action="store_true")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import logging
    logging.getLogger("opencann").setLevel(logging.ERROR)
    results: Dict[str, Tuple[str, str]] = {}
    t0 = time.perf_counter()
    cases = list(node_cases(a.match))
    if a.quick:
        cases = cases[::15]
    if not a.no_light:
        light = list(light_cases(a.match))
        cases += light[-2:-1] if a.quick else light
    with tempfile.TemporaryDirectory() as tmp:
        for k, (name, model, data, rtol, atol) in enumerate(cases):
            results[name] = run_case(model, data, rtol, atol, tmp)
            if (k + 1) % 100 == 0:
                print(f"  {k + 1}/{len(cases)} cases, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    by = collections.defaultdict(list)
    for name, (cls, why) in results.items():
        by[(cls, why)].append(name)
    total = len(results)
    passed = sum(1 for c, _ in results.values() if c == "pass")
    by_design = sum(1 for c, _ in results.values() if c in ("unsupported_dtype", "not_tensor"))
    print(f"ONNX backend conformance (onnx {onnx.__version__}, atc + load path): "
          f"{passed}/{total} cases pass ({100 * passed / max(total, 1):.1f}%); "
          f"{passed}/{total - by_design} of those with supported types "
          f"({100 * passed / max(total - by_design, 1):.1f}%); {time.perf_counter() - t0:.0f} s")
    for (cls, why), names in sorted(by.items(), key=lambda kv: -len(kv[1])):
        if cls == "pass":
            continue
        print(f"{len(names):5d}  {cls}  {why}")
        print(f"       e.g. {', '.join(sorted(names)[:a.show])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({n: {"class": c, "reason": w} for n, (c, w) in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
