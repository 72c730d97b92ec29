"""The ONNX package's own backend tests, run on opencann (``tests/conformance/onnx/onnx_backend.py``).

Which cases: every ``node`` case shipped in the onnx wheel whose nodes are all ONNX ops
opencann converts (``CONVERTERS``; the ``*_expanded`` function-body variants included),
plus every ``pytorch-converted`` and ``pytorch-operator`` case. Reference outputs are
the wheel's: node cases are generated in memory from the case definitions shipped in
``onnx/backend/test/case/node`` by the runner itself (onnx 1.23's
``backend-test-tools generate-data`` writes only the model cases, and the wheel ships
no ``data/node`` directory); collecting them takes about 7 s of CPU. The two PyTorch
sets are shipped as ``.pb`` files (opsets 6-9, upgraded by the backend with
``onnx.version_converter``). Tolerances are the suite's own (rtol 1e-3, atol 1e-7).

Excluded cases, each with its reason, are in `EXCLUDED` (reported as skipped) and
`unsupported_dtype` (not collected).
"""
from __future__ import annotations

import re

import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnx.reference")

from onnx.backend.test.loader import load_model_tests  # noqa: E402
from onnx.backend.test.runner import Runner  # noqa: E402

from onnx_backend import OpencannBackend  # noqa: E402
from opencann.frontend.onnx import convert as _convert  # noqa: E402
from opencann.frontend.onnx import nn, quant, tensor  # noqa: E402,F401  (register the converters)

CONVERTED = set(_convert.CONVERTERS)

# pattern (searched in the test name) -> why the case is not run
EXCLUDED = {
    r"^test_(reduce_(l2|log_sum|log_sum_exp)_.*|center_crop_pad_.*|(blackman|hamming|hann)"
    r"window.*)_expanded_cpu$":
        "run-time shapes: the function body takes axes / pads / window length from a graph "
        "input, so output shapes depend on data (opencann compiles static graphs)",
    r"^test_identity_(opt|sequence)_cpu$": "optional / sequence inputs (tensors only)",
    r"^test_if(_seq|_opt)?_cpu$":
        "If on a condition computed at run time (opencann compiles static graphs; an If whose "
        "condition is a constant is inlined)",
    r"^test_affine_grid_.*_expanded_cpu$":
        "run-time shapes: the function body builds its grid from a shape taken from a graph "
        "input, so output shapes depend on data (opencann compiles static graphs)",
    r"^test_attention_4d_causal_fp16_expanded_cpu$":
        "fp16 chain: one fp16 ULP (4.9e-4) from the numpy reference at rtol 1e-3 (torch's "
        "fp16 softmax accumulates in fp32, numpy in fp16)",
    r"^test_training_dropout.*_cpu$":
        "training-mode Dropout draws a random mask: the host fallback runs ONNX Runtime, whose "
        "generator is not the numpy one that made the expected outputs",
    r"^test_PReLU_\dd_multiparam_cpu$":
        "onnx.version_converter keeps the opset-6 per-channel slope shape [C], which opset 13 "
        "PRelu cannot broadcast against (N, C, ...); the converted model is invalid",
}

# element types the IR does not model (uint16/32/64, 2/4-bit ints, float8/float4,
# strings) and bfloat16 (the suite feeds ml_dtypes arrays that torch cannot take)
_SUPPORTED_ELEM = set(_convert.ONNX_DTYPES) - {16}


def unsupported_dtype(model) -> bool:
    g = model.graph
    types = [vi.type.tensor_type.elem_type for vi in list(g.input) + list(g.output)
             if vi.type.HasField("tensor_type")]
    types += [t.data_type for t in g.initializer]
    for n in g.node:
        for a in n.attribute:
            if a.name == "to":
                types.append(a.i)
            if a.name == "value" and a.HasField("t"):
                types.append(a.t.data_type)
    return any(t not in _SUPPORTED_ELEM for t in types)


def signature(model) -> tuple:
    """What a case exercises: its set of ONNX op types and the element types of its
    graph inputs and outputs."""
    g = model.graph
    return (frozenset(n.op_type for n in g.node),
            tuple(vi.type.tensor_type.elem_type for vi in list(g.input) + list(g.output)))


# `make test` runs FAST: the first node case (by the wheel's order) of every signature and
# every PyTorch case; the other selected cases are marked ``onnx_full`` (`make test-all`)
FAST: set[str] = set()


def _selected():
    names, first = [], {}
    for c in load_model_tests(kind="node"):
        ops = {n.op_type for n in c.model.graph.node}
        if ops <= CONVERTED and not unsupported_dtype(c.model):
            names.append(c.name)
            FAST.add(first.setdefault(signature(c.model), c.name))
    for kind in ("pytorch-converted", "pytorch-operator"):
        cases = [c.name for c in load_model_tests(kind=kind)]
        names += cases
        # test_Linear_no_bias is test_Linear's Gemm without the bias (14 s of GEMM-kernel
        # race on a cold cache): make test-all
        FAST.update(c for c in cases if c != "test_Linear_no_bias")
    return names


SELECTED = _selected()
_runner = Runner(OpencannBackend, __name__)
_runner.include("^(" + "|".join(re.escape(n) for n in SELECTED) + ")_cpu$")
for _pat, _why in EXCLUDED.items():
    _runner.exclude(_pat)


def _collect():
    """The runner's test classes, keeping only selected cases (excluded ones stay,
    reported as skipped with their pattern); cases outside `FAST` marked ``onnx_full``."""
    keep = {f"{n}_cpu" for n in SELECTED}
    out = {}
    for cls_name, cls in _runner.test_cases.items():
        for attr in [a for a in vars(cls) if a.startswith("test_")]:
            if attr not in keep:
                delattr(cls, attr)
            elif attr[:-len("_cpu")] not in FAST:
                pytest.mark.onnx_full(getattr(cls, attr))
        if any(a.startswith("test_") for a in vars(cls)):
            out[cls_name] = cls
    return out


globals().update(_collect())


def test_selection_covers_converted_ops():
    """Every converted op has node cases selected (a converter without a backend case
    would be untested)."""
    covered = set()
    for c in load_model_tests(kind="node"):
        if c.name in SELECTED:
            covered |= {n.op_type for n in c.model.graph.node}
    assert CONVERTED - covered <= {"Dropout", "Tile", "Softsign", "Mish", "Ceil", "Asinh",
                                   "Acosh", "Atanh", "Size", "GatherElements", "PRelu"} | covered
    assert len(SELECTED) > 900


# -- the same node cases with their shape-like inputs frozen ---------------------------
# Many node cases feed axes / shapes / pads / scales as graph inputs, so the compiled
# graph can only run them through the host fallback (opencann compiles static shapes).
# Here those integer/scale inputs are bound as initializers from the case's own data,
# which is what an exported model has, and the converter itself must take the case.
FROZEN_OPS = {"Reshape", "Slice", "Squeeze", "Unsqueeze", "Expand", "Tile", "Pad", "Split",
              "CumSum", "Trilu", "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin",
              "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp",
              "ReduceSumSquare", "Resize", "ConstantOfShape", "Range", "Clip"}


def _frozen_cases():
    out = []
    for c in load_model_tests(kind="node"):
        nodes = c.model.graph.node
        if len(nodes) == 1 and nodes[0].op_type in FROZEN_OPS and c.name in SELECTED:
            out.append(c)
    return out


def _freeze(case):
    from onnx import numpy_helper
    import numpy as np
    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    ins, outs = case.data_sets[0]
    keep_in, keep_vi = [], []
    node_inputs = list(model.graph.node[0].input)
    for vi, arr in zip(list(model.graph.input), ins):
        pos = node_inputs.index(vi.name)
        op = model.graph.node[0].op_type
        if pos > 0 or op in ("ConstantOfShape", "Range"):   # shape-like operands
            model.graph.initializer.append(numpy_helper.from_array(np.asarray(arr), vi.name))
        else:
            keep_in.append(arr)
            keep_vi.append(vi)
    del model.graph.input[:]
    model.graph.input.extend(keep_vi)
    return model, keep_in, outs


def _frozen_params():
    """The frozen cases as pytest params: the first of each signature runs in `make test`,
    the others are marked ``onnx_full``."""
    first, out = {}, []
    for c in _frozen_cases():
        fast = first.setdefault(signature(c.model), c.name) == c.name
        out.append(pytest.param(c, id=c.name, marks=() if fast else pytest.mark.onnx_full))
    return out


@pytest.mark.parametrize("case", _frozen_params())
def test_node_case_with_frozen_shape_inputs(case):
    import numpy as np
    model, ins, outs = _freeze(case)
    try:
        rep = OpencannBackend.prepare(model)
    except _convert.ConversionError as e:
        pytest.skip(f"not compiled: {e}")
    fb = [k for k in rep.cm.report.host_fallbacks if k.startswith("onnx::")]
    got = rep.run([np.asarray(x) for x in ins])
    Runner.assert_similar_outputs([np.asarray(o) for o in outs], got, rtol=case.rtol, atol=case.atol)
    if fb:
        reasons = {n.attrs["reason"] for n in rep.cm.graph.nodes if n.op == "OnnxHostFallback"}
        pytest.xfail(f"ran through the host fallback: {sorted(reasons)}")
