"""ONNX frontend: models exported by ``torch.onnx.export`` (TorchScript exporter,
``dynamo=False``: it runs offline in a few seconds, while the dynamo exporter needs
onnxscript's full pipeline and minutes for ResNet-50 on this machine) compared with ONNX
Runtime; loading errors; external data; symbolic inputs; host fallbacks."""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper  # noqa: E402

import opencann  # noqa: E402
from opencann.frontend.onnx import ConversionError, OnnxLoadError  # noqa: E402

RTOL = 1e-4


def export(model, args, path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), args, path, dynamo=False, opset_version=17, **kw)
    return path


def ort_run(path, inputs):
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return s.run(None, {i.name: x.numpy() for i, x in zip(s.get_inputs(), inputs)})


def assert_close(outs, refs, rtol=RTOL):
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        o = o.numpy()
        assert o.shape == r.shape and o.dtype == r.dtype
        np.testing.assert_array_equal(np.isnan(o), np.isnan(r))
        ok = ~np.isnan(r)
        scale = max(float(np.abs(r[ok]).max()), 1e-30) if ok.any() else 1.0
        assert float(np.abs(o[ok] - r[ok]).max(initial=0)) <= rtol * scale


class SmallNet(torch.nn.Module):
    """Conv+BN+ReLU, pooling, Linear+GELU, LayerNorm, softmax, reshape/transpose/slice."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.lin = torch.nn.Linear(8 * 4 * 4, 16)
        self.ln = torch.nn.LayerNorm(16)
        self.up = torch.nn.Upsample(scale_factor=2, mode="nearest")

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        z = self.up(y)[:, :, ::3]
        y = torch.nn.functional.max_pool2d(y, 2)
        h = torch.nn.functional.gelu(self.lin(y.flatten(1)))
        return torch.softmax(self.ln(h), -1), y.reshape(2, -1, 8)[:, 1:5].transpose(1, 2), z.mean((2, 3))


_SMALL = {}


def small_model(x):
    return _SMALL["model"](x)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    torch.manual_seed(0)
    m = SmallNet().eval()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-1, 1)
        m.bn.running_var.uniform_(0.5, 2)
    path = tmp_path_factory.mktemp("onnx") / "small.onnx"
    _SMALL["model"] = m
    return export(m, (torch.randn(2, 3, 8, 8),), str(path), input_names=["x"])


def test_small_net_matches_onnxruntime(small):
    cm = opencann.compile(small)
    x = torch.randn(2, 3, 8, 8)
    outs = cm(x)
    assert isinstance(outs, tuple) and len(outs) == 3
    assert_close(outs, ort_run(small, [x]))
    x2 = torch.randn(2, 3, 8, 8)
    outs2 = cm(x=x2)                      # a second call, by input name
    assert_close(outs2, ort_run(small, [x2]))
    assert outs[0].data_ptr() != outs2[0].data_ptr()   # each call's results are its own
    assert len({o.data_ptr() for o in outs2}) == 3
    ops = cm.graph.op_counts()
    assert "ConvBiasAct" in ops and "LinearAct" in ops      # Conv+BN+ReLU, Gemm+GELU fused
    assert not [k for k in cm.report.host_fallbacks if k.startswith("onnx::")]


def test_nan_positions_match_eager(small):
    """NaN positions as eager PyTorch (ONNX Runtime's MaxPool drops some NaNs, depending on
    their place in the window). fuse_conv_act is off: oneDNN's fused ReLU post-op turns
    NaN into 0, an engine issue shared with the torch frontend, not the ONNX one."""
    cm = opencann.compile(small, options={"disable": ["fuse_conv_act"]})
    x = torch.randn(2, 3, 8, 8)
    x[0, 1, 2, 3] = float("nan")
    with torch.no_grad():
        eager = [t.numpy() for t in small_model(x)]
    assert_close(cm(x), eager)


def test_call_errors(small):
    cm = opencann.compile(onnx.load(small))   # a ModelProto works too
    with pytest.raises(ValueError, match=r"takes inputs \['x'\]"):
        cm(torch.randn(2, 3, 8, 8), y=torch.randn(1))
    with pytest.raises(ValueError, match="compiled for float32"):
        cm(torch.randn(1, 3, 8, 8))


def _one_line(e):
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_malformed_and_truncated_files(small, tmp_path):
    data = open(small, "rb").read()
    for cut in (len(data) // 3, len(data) // 2, len(data) - 7):
        p = tmp_path / f"cut{cut}.onnx"
        p.write_bytes(data[:cut])
        with pytest.raises(OnnxLoadError) as e:
            opencann.compile(str(p))
        assert "truncated or corrupt" in _one_line(e)
    p = tmp_path / "junk.onnx"
    p.write_bytes(b"\xff\xfe this is not a protobuf \x00\x01" * 10)
    with pytest.raises(OnnxLoadError, match="truncated or corrupt|not a valid ONNX"):
        opencann.compile(str(p))
    (tmp_path / "empty.onnx").write_bytes(b"")
    with pytest.raises(OnnxLoadError, match="empty"):
        opencann.compile(str(tmp_path / "empty.onnx"))
    with pytest.raises(OnnxLoadError, match="no such ONNX file"):
        opencann.compile(str(tmp_path / "missing.onnx"))


def _relu_model(opset=17, dims=(2, 4), out_dims=None):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(dims))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, list(out_dims or dims))
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_old_opset_is_upgraded_and_logged(caplog):
    """A model below opset 13 is upgraded with onnx.version_converter (ATC accepts old
    opsets), the log says so, and the result is ONNX Runtime's; a model the converter
    cannot upgrade is one clear error naming the converter's failure and the fix."""
    import logging
    model = _relu_model(opset=11)
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    x[0, :3] = [np.nan, -np.inf, np.inf]
    with caplog.at_level(logging.WARNING, logger="opencann"):
        cm = opencann.compile(model)
    assert "opset 11: upgraded to opset 13" in caplog.text
    _assert_same(cm(torch.from_numpy(x)), _ort(model, {"x": x}))
    g = helper.make_graph([helper.make_node("Foo", ["x"], ["y"])], "foo",
                          [helper.make_tensor_value_info("x", _F, [3])],
                          [helper.make_tensor_value_info("y", _F, [3])])
    bad = helper.make_model(g, opset_imports=[helper.make_opsetid("", 9)])
    with pytest.raises(OnnxLoadError) as e:
        opencann.compile(bad)
    assert "opset 9" in _one_line(e) and "version_converter could not upgrade" in str(e.value)


def test_shape_inference_disagreement_is_an_error():
    with pytest.raises((ConversionError, OnnxLoadError), match="relu|y"):
        opencann.compile(_relu_model(dims=(2, 4), out_dims=(2, 5)))


def test_external_data_resolved_next_to_the_file(tmp_path):
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(3, 64)
    src = export(lin, (x,), str(tmp_path / "src.onnx"))
    model = onnx.load(src)
    d = tmp_path / "sub"
    d.mkdir()
    onnx.save_model(model, str(d / "lin.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="lin.weights", size_threshold=0)
    assert os.path.exists(d / "lin.weights")
    cwd = os.getcwd()
    os.chdir(tmp_path)          # resolved relative to the file, not the working directory
    try:
        cm = opencann.compile(str(d / "lin.onnx"))
    finally:
        os.chdir(cwd)
    assert_close(cm(x), ort_run(src, [x]))
    unloaded = onnx.load(str(d / "lin.onnx"), load_external_data=False)
    with pytest.raises(OnnxLoadError, match="external data"):
        opencann.compile(unloaded)
    os.remove(d / "lin.weights")
    with pytest.raises(OnnxLoadError, match="external weight data"):
        opencann.compile(str(d / "lin.onnx"))


def test_symbolic_dims_need_input_shapes(tmp_path):
    m = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh())
    path = export(m, (torch.randn(2, 8),), str(tmp_path / "dyn.onnx"), input_names=["x"],
                  dynamic_axes={"x": {0: "batch"}})
    with pytest.raises(ConversionError) as e:
        opencann.compile(path)
    assert "input_shapes={'x': (1, 8)}" in _one_line(e)
    cm = opencann.compile(path, input_shapes={"x": (5, 8)})
    x = torch.randn(5, 8)
    assert_close(cm(x), ort_run(path, [x]))
    with pytest.raises(ConversionError, match="does not match"):
        opencann.compile(path, input_shapes={"x": (5, 9)})


def test_unconverted_op_runs_on_host_and_is_reported(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 3, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 6, 6])
    nodes = [helper.make_node("DepthToSpace", ["x"], ["l"], blocksize=2, name="d2s0"),
             helper.make_node("Relu", ["l"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "d2s", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    path = str(tmp_path / "d2s.onnx")
    onnx.save(model, path)
    cm = opencann.compile(path)
    assert cm.report.host_fallbacks["onnx::DepthToSpace"]["count"] == 1
    assert "d2s0" in cm.report.host_fallbacks["onnx::DepthToSpace"]["where"][0]
    t = torch.randn(1, 8, 3, 3)
    assert_close(cm(t), ort_run(path, [t]))
    assert_close(cm(t), ort_run(path, [t]))            # a second call
    with pytest.raises(ValueError, match="onnx::DepthToSpace"):
        opencann.compile(path, options={"host_fallback": False})


def test_data_dependent_shape_is_a_clear_error():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, [1, "n"])
    model = helper.make_model(helper.make_graph([helper.make_node("NonZero", ["x"], ["y"])],
                                                "nz", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ConversionError) as e:
        opencann.compile(model)
    assert "depends on the data" in _one_line(e)



def _qlinear_add_model(a_shape, b_shape):
    """A com.microsoft QLinearAdd (uint8, broadcasting) whose output has no declared shape:
    onnx's shape inference does not know the op, ONNX Runtime's does."""
    from onnx import numpy_helper
    q = {"as": np.float32(0.02), "az": np.uint8(120), "bs": np.float32(0.03), "bz": np.uint8(100),
         "ys": np.float32(0.04), "yz": np.uint8(128)}
    node = helper.make_node("QLinearAdd", ["a", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"],
                            domain="com.microsoft")
    graph = helper.make_graph([node, helper.make_node("Transpose", ["y"], ["r"], perm=[2, 0, 1])], "qadd",
                              [helper.make_tensor_value_info("a", TensorProto.UINT8, a_shape),
                               helper.make_tensor_value_info("b", TensorProto.UINT8, b_shape)],
                              [helper.make_tensor_value_info("r", TensorProto.UINT8, ["d0", "d1", "d2"])],
                              [numpy_helper.from_array(np.array(v), k) for k, v in q.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


def test_com_microsoft_fallback_takes_onnxruntime_shape_inference(tmp_path):
    """A node onnx's shape inference gives no shape (a com.microsoft op, its output read by
    another node) runs on ONNX Runtime with the output shape ONNX Runtime's inference
    gives (broadcast here): ONNX Runtime's values exactly, live and after save / load."""
    model = _qlinear_add_model([3, 1, 5], [4, 5])
    path = str(tmp_path / "qadd.onnx")
    onnx.save(model, path)
    cm = opencann.compile(path)
    assert cm.report.host_fallbacks["onnx::QLinearAdd"]["count"] == 1
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 256, (3, 1, 5), generator=g).to(torch.uint8), \
        torch.randint(0, 256, (4, 5), generator=g).to(torch.uint8)
    ref = torch.from_numpy(ort_run(path, [a, b])[0])
    y = cm(a, b)[0]
    assert y.shape == (5, 3, 4) and torch.equal(y, ref)
    opencann.save(cm, str(tmp_path / "qadd.ocm"))
    assert torch.equal(opencann.load(str(tmp_path / "qadd.ocm"))(a, b)[0], ref)


def test_fallback_shape_from_run_time_axes_is_data_dependent():
    """An output neither onnx's nor ONNX Runtime's inference gives a shape, of a node that
    reads a run-time integer input (Squeeze by axes fed as a graph input), is one
    data-dependent line naming that input and the fix."""
    graph = helper.make_graph([helper.make_node("Squeeze", ["x", "axes"], ["y"]),
                               helper.make_node("Relu", ["y"], ["r"])], "sq",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 1]),
                               helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("r", TensorProto.FLOAT, ["d0"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ConversionError) as e:
        opencann.compile(model)
    msg = _one_line(e)
    assert "neither onnx's nor ONNX Runtime's shape inference" in msg and "'axes'" in msg
    assert "make them constants" in msg and e.value.kind == "data_dependent"


def test_fallback_without_any_shape_inference_names_the_fix(tmp_path, monkeypatch):
    """Where ONNX Runtime's inference gives no shape either (stubbed here: it gives QLinearAdd's),
    the error says so, without claiming the shape depends on the data, and names the fix;
    the fix (the output's static shape declared in graph.value_info) compiles, with ONNX
    Runtime's values."""
    from opencann.frontend.onnx import converter
    monkeypatch.setattr(converter, "infer_outputs_ort", lambda *a: [None])
    model = _qlinear_add_model([3, 1, 5], [4, 5])
    with pytest.raises(ConversionError) as e:
        opencann.compile(model)
    msg = _one_line(e)
    assert "neither onnx's nor ONNX Runtime's shape inference" in msg and "graph.value_info" in msg
    assert "depends on the data" not in msg and e.value.kind == "unsupported_op"
    model.graph.value_info.append(helper.make_tensor_value_info("y", TensorProto.UINT8, [3, 4, 5]))
    path = str(tmp_path / "declared.onnx")
    onnx.save(model, path)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 256, (3, 1, 5), generator=g).to(torch.uint8), \
        torch.randint(0, 256, (4, 5), generator=g).to(torch.uint8)
    assert torch.equal(opencann.compile(path)(a, b)[0], torch.from_numpy(ort_run(path, [a, b])[0]))

class _Bert(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, ids, mask):
        return self.m(input_ids=ids, attention_mask=mask).last_hidden_state


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["resnet50", "minilm"])
def test_zoo_model_matches_onnxruntime(name, tmp_path):
    """Zoo models (ResNet-50 at 64x64, MiniLM at seq 16, batch 1) exported to ONNX."""
    from opencann import zoo
    if name == "resnet50":
        z = zoo.get(name, batch=1, size=64)
        model, names = z.model, ["pixel_values"]
    else:
        z = zoo.get(name, batch=1, seq=16)
        model, names = _Bert(z.model), ["input_ids", "attention_mask"]
    path = export(model, z.example_inputs, str(tmp_path / f"{name}.onnx"), input_names=names)
    cm = opencann.compile(path)
    assert cm.report.host_fallbacks == {}
    refs = ort_run(path, z.example_inputs)
    assert_close(cm(*z.example_inputs), refs)
    with torch.no_grad():
        eager = model(*z.example_inputs)
    eager = eager.last_hidden_state if hasattr(eager, "last_hidden_state") else eager
    assert_close(cm(*z.example_inputs)[:1], [eager.numpy()])


def _model(nodes, inputs, outputs, inits=(), opset=17):
    """A one-graph model: ``inputs``/``outputs`` as (name, elem type, dims)."""
    vi = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "m", [vi(*i) for i in inputs], [vi(*o) for o in outputs],
                          initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _ort(model, feeds):
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


_F = TensorProto.FLOAT


@pytest.mark.parametrize("case", ["relu_relu", "identity_identity", "output_is_input",
                                  "output_is_initializer", "same_name_twice"])
def test_outputs_are_independent_tensors(case):
    """Every ONNX output is its own tensor, as ONNX Runtime's: CSE merging ``Relu(x)``
    twice, an Identity of the input, the input or an initializer itself as an output.
    Writing into one output changes no other, nor the input, nor the next call's."""
    w = onnx.numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
    nodes, outs, inits = {
        "relu_relu": ([helper.make_node("Relu", ["x"], ["y"]),
                       helper.make_node("Relu", ["x"], ["z"])], ["y", "z"], []),
        "identity_identity": ([helper.make_node("Identity", ["x"], ["y"]),
                               helper.make_node("Identity", ["x"], ["z"])], ["y", "z"], []),
        "output_is_input": ([helper.make_node("Relu", ["x"], ["y"])], ["y", "x"], []),
        "output_is_initializer": ([helper.make_node("Add", ["x", "w"], ["y"])], ["y", "w"], [w]),
        "same_name_twice": ([helper.make_node("Relu", ["x"], ["y"])], ["y", "y"], []),
    }[case]
    model = _model(nodes, [("x", _F, [2, 3])], [(o, _F, [2, 3]) for o in outs], inits)
    cm = opencann.compile(model)
    x = torch.randn(2, 3)
    x0 = x.clone()
    outs1 = cm(x)
    refs = _ort(model, {"x": x.numpy()})
    assert_close(outs1, refs)
    for k, o in enumerate(outs1):
        before = [t.clone() for t in outs1]
        o.fill_(123.0)
        for j, t in enumerate(outs1):
            if j != k:
                assert torch.equal(t, before[j]), (k, j)
        assert torch.equal(x, x0)
    kept = [t.clone() for t in outs1]
    outs2 = cm(torch.randn(2, 3))
    assert all(torch.equal(a, b) for a, b in zip(outs1, kept))     # a second call
    if case == "output_is_initializer":
        assert_close(outs2[1:], refs[1:])        # the weights were not changed by the write


_SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.7, -0.7,
            300.0, -300.0, 3.4e38, -3.4e38, 1e10]


def _assert_same(outs, refs):
    """Bit-exact agreement with ONNX Runtime, NaN in the same places, same dtypes."""
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        o = o.numpy()
        assert o.dtype == r.dtype and o.shape == r.shape
        np.testing.assert_array_equal(o, r)          # NaN equals NaN here


@pytest.mark.parametrize("n", [108, 200_000])     # the serial pass and the parallel one
@pytest.mark.parametrize("qtype,zp", [(TensorProto.UINT8, 128), (TensorProto.INT8, 0)])
def test_quantize_linear_divides_by_its_scale_as_the_specification(n, qtype, zp):
    """QuantizeLinear is round(x / scale): x · (1 / scale) rounded values that lie on a
    rounding boundary to the other side (x = -1.515, scale 0.03: x / s = -50.5 but
    x · (1/s) = -50.500004; 28 of 108 such values one step from ONNX Runtime)."""
    npq = np.uint8 if qtype == TensorProto.UINT8 else np.int8
    s = np.float32(0.03)
    x = (((np.arange(n) % 216) - 108).astype(np.float32) + np.float32(0.5)) * s
    x[7] = np.nan
    inits = [onnx.numpy_helper.from_array(s, "s"), onnx.numpy_helper.from_array(np.array(zp, npq), "z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"])]
    model = _model(nodes, [("x", _F, [n])], [("q", qtype, [n]), ("d", _F, [n])], inits, 19)
    cm = opencann.compile(model)
    assert not cm.report.host_fallbacks
    want = _ort(model, {"x": x})
    spec = np.clip(np.round(x / s) + zp, np.iinfo(npq).min, np.iinfo(npq).max)   # fp32 x / s
    assert np.array_equal(want[0][8:], spec[8:].astype(npq))   # the reference is the spec's
    for _ in range(2):
        _assert_same(cm(torch.from_numpy(x)), want)


@pytest.mark.parametrize("opset", [13, 19, 21])
@pytest.mark.parametrize("qtype,zp", [(TensorProto.UINT8, 3), (TensorProto.INT8, -2),
                                      (TensorProto.INT8, 3), (TensorProto.UINT8, None)])
def test_quantize_dequantize_match_onnxruntime(opset, qtype, zp):
    """QuantizeLinear saturates ±inf to the type's range (the reference evaluator gave the
    minimum for +inf), rounds half to even, NaN as ONNX Runtime (the type's minimum);
    DequantizeLinear runs at opset 13 (the reference evaluator implements only 19+)."""
    npq = np.uint8 if qtype == TensorProto.UINT8 else np.int8
    x = np.array(_SPECIAL * 2, np.float32).reshape(2, len(_SPECIAL))
    ins = ["x", "s"] + (["z"] if zp is not None else [])
    inits = [onnx.numpy_helper.from_array(np.array(0.5, np.float32), "s")]
    if zp is not None:
        inits.append(onnx.numpy_helper.from_array(np.array(zp, npq), "z"))
    nodes = [helper.make_node("QuantizeLinear", ins, ["q"]),
             helper.make_node("DequantizeLinear", ["qi"] + ins[1:], ["d"])]
    model = _model(nodes, [("x", _F, list(x.shape)), ("qi", qtype, list(x.shape))],
                   [("q", qtype, list(x.shape)), ("d", _F, list(x.shape))], inits, opset)
    qi = np.random.default_rng(0).integers(np.iinfo(npq).min, np.iinfo(npq).max + 1, x.shape,
                                           dtype=npq)
    cm = opencann.compile(model)
    assert not cm.report.host_fallbacks
    _assert_same(cm(torch.from_numpy(x), torch.from_numpy(qi)), _ort(model, {"x": x, "qi": qi}))
    q = cm(torch.from_numpy(x), torch.from_numpy(qi))[0]
    hi, lo = np.iinfo(npq).max, np.iinfo(npq).min
    assert q[0, 1] == hi and q[0, 2] == lo                  # +inf, -inf saturate


@pytest.mark.parametrize("axis", [1, -1, 0])
def test_quantize_per_axis_matches_onnxruntime(axis):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 4, 5)) * 50).astype(np.float32)
    x[0, 0, :4] = [np.nan, np.inf, -np.inf, 2.5]
    c = x.shape[axis]
    s = onnx.numpy_helper.from_array((rng.random(c) + 0.25).astype(np.float32), "s")
    z = onnx.numpy_helper.from_array(rng.integers(-5, 6, c).astype(np.int8), "z")
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], axis=axis),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"], axis=axis)]
    model = _model(nodes, [("x", _F, list(x.shape))],
                   [("q", TensorProto.INT8, list(x.shape)), ("d", _F, list(x.shape))], [s, z], 13)
    cm = opencann.compile(model)
    _assert_same(cm(torch.from_numpy(x)), _ort(model, {"x": x}))


def test_fallback_runs_on_onnxruntime_where_the_reference_cannot(monkeypatch):
    """A node without a converter runs on ONNX Runtime (its DequantizeLinear at opset 13,
    which onnx's reference evaluator implements only from 19, gives ORT's result); an op
    neither runs fails at compile time naming the op and saying it is not supported."""
    from opencann.frontend.onnx import convert
    monkeypatch.delitem(convert.CONVERTERS, "DequantizeLinear")
    s = onnx.numpy_helper.from_array(np.array(0.5, np.float32), "s")
    model = _model([helper.make_node("DequantizeLinear", ["x", "s"], ["y"], name="dq0")],
                   [("x", TensorProto.INT8, [3])], [("y", _F, [3])], [s], 13)
    cm = opencann.compile(model)
    assert [n.attrs["engine"] for n in cm.graph.nodes if n.op == "OnnxHostFallback"] == \
        ["onnxruntime"]
    x = np.array([-128, 3, 127], np.int8)
    _assert_same(cm(torch.from_numpy(x)), _ort(model, {"x": x}))
    g = helper.make_graph([helper.make_node("Foo", ["x"], ["y"], name="f0", domain="my.dom")], "g",
                          [helper.make_tensor_value_info("x", _F, [3])],
                          [helper.make_tensor_value_info("y", _F, [3])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                                helper.make_opsetid("my.dom", 1)])
    with pytest.raises(ConversionError) as e:
        opencann.compile(model)
    assert "Foo" in _one_line(e) and "not supported yet" in str(e.value)


@pytest.mark.parametrize("ins,eq", [(["x", "x"], "ij,ij->i"), (["x", "w", "x"], "ij,jk,ij->i")])
def test_a_fallback_reading_one_tensor_twice_runs_on_onnxruntime(ins, eq, tmp_path):
    """A fallback node that reads one tensor in several slots (Einsum(x, x)) declares it
    once in its one-node model: ONNX Runtime runs it (a name declared twice made it refuse
    the model, and onnx's reference evaluator ran it, 1e-6 from ONNX Runtime's values),
    live and from a model file."""
    rng = np.random.default_rng(0)
    w = onnx.numpy_helper.from_array(rng.standard_normal((5, 5)).astype(np.float32), "w")
    model = _model([helper.make_node("Einsum", ins, ["y"], equation=eq)],
                   [("x", _F, [3, 5])], [("y", _F, [3])], [w] if "w" in ins else [], 17)
    cm = opencann.compile(model)
    assert [n.attrs["engine"] for n in cm.graph.nodes if n.op == "OnnxHostFallback"] == \
        ["onnxruntime"]
    opencann.save(cm, str(tmp_path / "m.ocm"))
    loaded = opencann.load(str(tmp_path / "m.ocm"))
    x = rng.standard_normal((3, 5)).astype(np.float32)
    x[1, 2] = np.nan
    for m in (cm, loaded):
        _assert_same(m(torch.from_numpy(x)), _ort(model, {"x": x}))


def _unary_model(op, xt=_F, outt=None, n=len(_SPECIAL), inits=(), extra_ins=(), **attrs):
    node = helper.make_node(op, ["x"] + list(extra_ins), ["y"], **attrs)
    return _model([node], [("x", xt, [n])], [("y", outt or xt, [n])], inits)


@pytest.mark.parametrize("op", ["Sign", "Abs", "Neg", "Floor", "Ceil", "Round", "Relu",
                                "Reciprocal", "Exp", "Sqrt", "HardSigmoid", "ThresholdedRelu"])
def test_elementwise_specials_match_onnxruntime(op):
    """NaN, ±inf, ±0 and halves (Round: half to even) as ONNX Runtime, bit for bit;
    ``Sign(NaN)`` is NaN (``aten.sign`` gave 0)."""
    x = np.array(_SPECIAL, np.float32)
    model = _unary_model(op)
    cm = opencann.compile(model)
    out, ref = cm(torch.from_numpy(x))[0].numpy(), _ort(model, {"x": x})[0]
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_allclose(out, ref, rtol=1e-6)        # Exp/Sqrt: one ulp apart
    np.testing.assert_array_equal(np.signbit(out[~np.isnan(out)]), np.signbit(ref[~np.isnan(ref)]))
    if op == "Sign":
        assert np.isnan(out[0]) and np.isnan(np.sign(x[0]))


@pytest.mark.parametrize("bounds", [(), ("lo",), ("", "hi"), ("lo", "hi"), ("lo_in",),
                                    ("", "hi_in")])
def test_clip_default_bounds_are_the_type_limits(bounds):
    """Absent Clip bounds are ``numeric_limits`` lowest / max (the specification), so
    ``±inf`` clips to ``±FLT_MAX`` as ONNX Runtime's; bounds given as constants or at run
    time."""
    x = np.array(_SPECIAL, np.float32)
    inits = [onnx.numpy_helper.from_array(np.array(-1.0, np.float32), "lo"),
             onnx.numpy_helper.from_array(np.array(2.0, np.float32), "hi")]
    inits = [t for t in inits if t.name in bounds]
    runtime = [b for b in bounds if b.endswith("_in")]
    node = helper.make_node("Clip", ["x"] + list(bounds), ["y"])
    model = _model([node], [("x", _F, [len(x)])] + [(b, _F, []) for b in runtime],
                   [("y", _F, [len(x)])], inits)
    feeds = {"x": x, **{b: np.array(-1.0 if b == "lo_in" else 2.0, np.float32) for b in runtime}}
    cm = opencann.compile(model)
    out = cm(*[torch.from_numpy(v) for v in feeds.values()])[0].numpy()
    ref = _ort(model, feeds)[0]
    np.testing.assert_array_equal(out, ref)
    assert out[1] == (2.0 if "hi" in bounds or "hi_in" in bounds else np.finfo(np.float32).max)


def test_nan_reductions_follow_the_spec_and_numpy():
    """ReduceMax/Min give NaN and ArgMax/ArgMin the index of the first NaN, as numpy and
    the specification (ONNX Runtime skips NaN: documented in ``frontend/onnx/nn.py``)."""
    x = np.array([[1.0, np.nan, 5.0, -2.0], [3.0, -1.0, np.nan, 7.0], [0.0, -0.0, 2.5, -np.inf]],
                 np.float32)
    ax = helper.make_tensor("ax", TensorProto.INT64, [1], [1])
    nodes = [helper.make_node("ReduceMax", ["x", "ax"], ["mx"], keepdims=0),
             helper.make_node("ReduceMin", ["x", "ax"], ["mn"], keepdims=0),
             helper.make_node("ArgMax", ["x"], ["amx"], axis=1, keepdims=0),
             helper.make_node("ArgMin", ["x"], ["amn"], axis=1, keepdims=0)]
    model = _model(nodes, [("x", _F, [3, 4])],
                   [("mx", _F, [3]), ("mn", _F, [3]), ("amx", TensorProto.INT64, [3]),
                    ("amn", TensorProto.INT64, [3])], [ax], 18)
    mx, mn, amx, amn = (t.numpy() for t in opencann.compile(model)(torch.from_numpy(x)))
    np.testing.assert_array_equal(mx, x.max(1))
    np.testing.assert_array_equal(mn, x.min(1))
    np.testing.assert_array_equal(amx, x.argmax(1))
    np.testing.assert_array_equal(amn, x.argmin(1))


@pytest.mark.parametrize("op", ["Max", "Min", "Mod", "Fmod", "Div", "Pow"])
def test_binary_specials_match_onnxruntime(op):
    """NaN / ±inf / ±0 pairs; float Mod where the quotient overflows float32
    (``fmod(3.4e38, -0.7)``: ATen's vectorized float32 kernel gave NaN)."""
    x = np.array(_SPECIAL, np.float32)
    y = np.roll(x, 3)
    attrs = {"fmod": 1} if op == "Fmod" else {}
    node = helper.make_node("Mod" if op == "Fmod" else op, ["x", "z"], ["y"], **attrs)
    model = _model([node], [("x", _F, [len(x)]), ("z", _F, [len(x)])], [("y", _F, [len(x)])])
    out = opencann.compile(model)(torch.from_numpy(x), torch.from_numpy(y))[0].numpy()
    if op == "Mod":      # ONNX Runtime takes float Mod only with fmod=1 (before opset 28)
        with np.errstate(all="ignore"):
            ref = np.mod(x, y)
    else:
        ref = _ort(model, {"x": x, "z": y})[0]
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_allclose(out, ref, rtol=1e-6)


@pytest.mark.parametrize("fmod", [0, 1])
def test_integer_mod_signs_match_onnxruntime(fmod):
    a = np.array([-7, 7, -7, 7, 0, 5, -5, 3, -3, 1, -1, 6], np.int32)
    b = np.array([3, -3, -3, 3, 2, 5, 5, -2, 2, 4, 4, -4], np.int32)
    node = helper.make_node("Mod", ["a", "b"], ["y"], fmod=fmod)
    i32 = TensorProto.INT32
    model = _model([node], [("a", i32, [12]), ("b", i32, [12])], [("y", i32, [12])])
    out = opencann.compile(model)(torch.from_numpy(a), torch.from_numpy(b))[0].numpy()
    np.testing.assert_array_equal(out, _ort(model, {"a": a, "b": b})[0])


def test_checker_failure_is_not_called_a_corrupt_file():
    """A well-formed protobuf that onnx.checker rejects (an output without a type) names
    the checker and the fix, not a truncated file."""
    x = helper.make_tensor_value_info("x", _F, [2])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "untyped", [x],
                          [helper.make_value_info("y", onnx.TypeProto())])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(OnnxLoadError) as e:
        opencann.compile(model)
    msg = _one_line(e)
    assert "onnx.checker" in msg and "give every graph output a type" in msg
    assert "truncated" not in msg and "corrupt" not in msg
