"""Issue 26, items 1 and 6: ONNX nodes where opencann's converters and host fallbacks meet,
each against ONNX Runtime (values, NaN positions, shapes incl. rank 0, a second call,
the saved file loaded here and in a fresh process)."""
from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import opencann
from opencann.devices.cpu import onednn_int8_exact
from onnx_check import check, fallbacks, model

_F = TensorProto.FLOAT
rng = np.random.default_rng(26)


def _x(*shape, nan=True):
    x = rng.standard_normal(shape).astype(np.float32)
    if nan:
        x.reshape(-1)[::7] = np.nan
    return x


# -- Resize: every mode through the converter ---------------------------------------------

def _resize_model(shape, mode, ctm, scales=None, sizes=None, opset=19, **attrs):
    inits = [numpy_helper.from_array(np.array([], np.float32), "roi")]
    ins = ["x", "roi"]
    if ctm == "tf_crop_and_resize":
        r = len(shape)
        inits = [numpy_helper.from_array(np.array([0] * (r - 2) + [0.1, -0.2] + [1] * (r - 2)
                                                  + [0.8, 1.3], np.float32), "roi")]
    if scales is not None:
        inits.append(numpy_helper.from_array(np.array(scales, np.float32), "scales"))
        ins.append("scales")
    else:
        inits.append(numpy_helper.from_array(np.array(sizes, np.int64), "sizes"))
        ins += ["", "sizes"]
    node = helper.make_node("Resize", ins, ["y"], mode=mode, coordinate_transformation_mode=ctm,
                            **attrs)
    return model([node], [("x", _F, list(shape))], [("y", _F, None)], inits, opset)


CTMS = ["half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
        "asymmetric", "tf_half_pixel_for_nn", "tf_crop_and_resize"]
GEOMS = [dict(scales=[1, 1, 1.5, 0.6]), dict(scales=[1, 1, 2.0, 3.0]), dict(sizes=[1, 2, 7, 1]),
         dict(sizes=[1, 2, 3, 11])]


@pytest.mark.parametrize("mode,ctm,geom", [
    (m, c, g) for m, c, g in itertools.product(["nearest", "linear", "cubic"], CTMS, range(4))
    if not (m == "nearest" and c == "tf_half_pixel_for_nn" and False)])
def test_resize_modes_match_onnxruntime(mode, ctm, geom):
    x = _x(1, 2, 5, 4, nan=False)
    m = _resize_model(x.shape, mode, ctm, **GEOMS[geom], extrapolation_value=-3.0)
    # cubic: 16 products with coefficients of both signs; where they cancel (a result of
    # 0.015 from inputs of ~1) fp32 summation order alone moves it by ~2e-6
    cm = check(m, {"x": x}, rtol=1e-5, atol=5e-6 if mode == "cubic" else 2e-6)
    assert fallbacks(cm) == []


@pytest.mark.parametrize("nearest_mode", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
@pytest.mark.parametrize("ctm", ["half_pixel", "asymmetric", "align_corners"])
def test_resize_nearest_modes_and_nan(nearest_mode, ctm):
    x = _x(1, 3, 4, 6)
    for geom in (dict(scales=[1, 1, 2.5, 0.5]), dict(sizes=[1, 3, 9, 5])):
        check(_resize_model(x.shape, "nearest", ctm, nearest_mode=nearest_mode, **geom), {"x": x})


@pytest.mark.parametrize("a,exclude", [(-0.75, 0), (-0.5, 1), (-0.75, 1)])
def test_resize_cubic_coefficient_and_exclude_outside(a, exclude):
    x = _x(2, 1, 6, 5, nan=False)
    m = _resize_model(x.shape, "cubic", "half_pixel", scales=[1, 1, 1.7, 0.8], cubic_coeff_a=a,
                      exclude_outside=exclude)
    check(m, {"x": x}, atol=2e-6)


def test_resize_axes_keep_aspect_ratio_and_3d():
    x = _x(1, 2, 4, 6, nan=False)
    for policy in ("not_larger", "not_smaller"):
        node = helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="linear",
                                axes=[2, 3], keep_aspect_ratio_policy=policy)
        s = numpy_helper.from_array(np.array([7, 7], np.int64), "sizes")
        check(model([node], [("x", _F, list(x.shape))], [("y", _F, None)], [s], 18), {"x": x})
    v = _x(1, 1, 3, 4, 5, nan=False)
    check(_resize_model(v.shape, "linear", "half_pixel", scales=[1, 1, 2, 1.5, 0.5]), {"x": v})


def test_resize_antialias_runs_on_onnxruntime(tmp_path):
    x = _x(1, 2, 8, 8, nan=False)
    m = _resize_model(x.shape, "linear", "half_pixel", scales=[1, 1, 0.5, 0.4], antialias=1)
    cm = check(m, {"x": x}, tmp_path)
    assert fallbacks(cm) == ["Resize"]


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("dynamo", [False, pytest.param(True, marks=pytest.mark.full)])
def test_interpolate_align_corners_fractional_scale(mode, dynamo, tmp_path):   # make test: the
    # TorchScript exporter's file (the dynamo exporter's Resize is the same node)
    """The issue's example: F.interpolate(scale_factor=1.5, align_corners=True) by either
    exporter equals ONNX Runtime and eager PyTorch (onnx.reference was off by ~1.2)."""
    import torch.nn.functional as F

    class M(torch.nn.Module):
        def forward(self, x):
            return F.interpolate(x, scale_factor=1.5, mode=mode, align_corners=True)

    x = torch.randn(1, 3, 6, 5)
    path = str(tmp_path / "m.onnx")
    torch.onnx.export(M(), (x,), path, dynamo=dynamo, opset_version=18)
    m = onnx.load(path)
    cm = check(m, {m.graph.input[0].name: x.numpy()}, tmp_path, fresh=not dynamo, atol=1e-5)
    torch.testing.assert_close(cm(x)[0], M()(x), rtol=1e-4, atol=1e-4)


# -- host fallback: ONNX Runtime semantics, rank 0, saveable --------------------------------

def test_fallback_rank0_einsum_and_saved_in_fresh_process(tmp_path):
    m = model([helper.make_node("Einsum", ["a", "b"], ["c"], equation="ij,ij->")],
              [("a", _F, [3, 4]), ("b", _F, [3, 4])], [("c", _F, [])])
    cm = check(m, {"a": _x(3, 4, nan=False), "b": _x(3, 4, nan=False)}, tmp_path, fresh=True)
    assert fallbacks(cm) == ["Einsum"]


def test_dynamic_quantize_linear_scalars_stay_rank0(tmp_path):
    m = model([helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])],
              [("x", _F, [4, 5])],
              [("y", TensorProto.UINT8, [4, 5]), ("s", _F, []), ("z", TensorProto.UINT8, [])])
    check(m, {"x": _x(4, 5, nan=False)}, tmp_path, fresh=True)


def test_quantize_dynamic_model_runs_and_saves(tmp_path):
    """A model made by onnxruntime.quantization.quantize_dynamic (DynamicQuantizeLinear,
    MatMulInteger) compiles, matches ONNX Runtime, and is saved by ``opencann atc``."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    w = numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w")
    src = model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", _F, [4, 16])],
                [("y", _F, [4, 8])], [w], 13)
    fp, q = str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx")
    onnx.save(src, fp)
    quantize_dynamic(fp, q, weight_type=QuantType.QInt8)
    x = _x(4, 16, nan=False)
    if onednn_int8_exact():
        check(onnx.load(q), {"x": x}, tmp_path, atol=1e-5)
    else:   # ONNX Runtime's MatMulInteger saturates without VNNI: the exact arithmetic instead
        lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
        step = (hi - lo) / 255
        zp = np.clip(np.round(-lo / step), 0, 255)
        xq = np.clip(np.round(x / step) + zp, 0, 255) - zp
        wf = numpy_helper.to_array(w).astype(np.float64)
        ws = np.abs(wf).max() / 127
        want = (xq.astype(np.float64) @ np.clip(np.round(wf / ws), -127, 127)) * step * ws
        got = opencann.compile(q)(torch.from_numpy(x))[0]
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)
    from opencann.cli import main
    out = str(tmp_path / "q_atc")
    assert main(["atc", "--model", q, "--framework", "5", "--output", out]) == 0


# -- item 6: refusals and crashes -------------------------------------------------------------

@pytest.mark.parametrize("mode", ["reflect", "edge", "wrap"])
def test_pad_modes(mode, tmp_path):
    x = _x(2, 3, 5, 6)
    pads = numpy_helper.from_array(np.array([0, 1, 2, -1, 0, 0, 3, 2], np.int64), "p")
    m = model([helper.make_node("Pad", ["x", "p"], ["y"], mode=mode)], [("x", _F, list(x.shape))],
              [("y", _F, None)], [pads], 19)
    cm = check(m, {"x": x}, tmp_path)
    assert fallbacks(cm) == []


def test_reflection_pad_and_lrn_from_torch_export(tmp_path):
    net = torch.nn.Sequential(torch.nn.ReflectionPad2d((1, 2, 3, 0)),
                              torch.nn.LocalResponseNorm(3, alpha=0.3, beta=0.6, k=1.5),
                              torch.nn.ReplicationPad2d(1))
    x = torch.randn(2, 5, 6, 7)
    path = str(tmp_path / "m.onnx")
    torch.onnx.export(net, (x,), path, dynamo=False, opset_version=17)
    m = onnx.load(path)
    cm = check(m, {m.graph.input[0].name: x.numpy()}, tmp_path, atol=1e-5)
    assert fallbacks(cm) == []
    torch.testing.assert_close(cm(x)[0], net(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("size", [1, 3, 5])   # ONNX Runtime takes odd sizes only
def test_lrn_converter(size):
    # no NaN: ONNX Runtime's sliding channel sum spreads a NaN past its window (the
    # specification's window sum, ours, keeps it inside)
    x = _x(2, 6, 3, 4, nan=False)
    m = model([helper.make_node("LRN", ["x"], ["y"], size=size, alpha=0.2, beta=0.7, bias=2.0)],
              [("x", _F, list(x.shape))], [("y", _F, None)])
    assert fallbacks(check(m, {"x": x})) == []


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_3d_pooling(kind):
    # MaxPool keeps every NaN (the specification, numpy); ONNX Runtime drops some by position
    x = _x(1, 2, 5, 6, 7, nan=kind == "avg")
    op = "MaxPool" if kind == "max" else "AveragePool"
    m = model([helper.make_node(op, ["x"], ["y"], kernel_shape=[3, 2, 3], strides=[1, 2, 2],
                                pads=[1, 0, 1, 1, 0, 1])],
              [("x", _F, list(x.shape))], [("y", _F, None)])
    assert fallbacks(check(m, {"x": x})) == []


@pytest.mark.parametrize("opset,mode", [(16, "bilinear"), (16, "nearest"), (16, "bicubic"),
                                        (20, "linear"), (20, "nearest"), (20, "cubic")])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [0, 1])
def test_grid_sample(opset, mode, padding, align):
    x = _x(2, 3, 5, 6, nan=False)
    g = (rng.random((2, 4, 7, 2)).astype(np.float32) * 2.4 - 1.2)
    m = model([helper.make_node("GridSample", ["x", "g"], ["y"], mode=mode, padding_mode=padding,
                                align_corners=align)],
              [("x", _F, list(x.shape)), ("g", _F, list(g.shape))], [("y", _F, None)], (), opset)
    assert fallbacks(check(m, {"x": x, "g": g}, atol=1e-5)) == []


def test_grid_sample_from_torch_export(tmp_path):
    import torch.nn.functional as F

    class M(torch.nn.Module):
        def forward(self, x, g):
            return F.grid_sample(x, g, mode="bilinear", padding_mode="border", align_corners=False)

    x, g = torch.randn(1, 2, 5, 5), torch.rand(1, 3, 4, 2) * 2 - 1
    path = str(tmp_path / "m.onnx")
    torch.onnx.export(M(), (x, g), path, dynamo=False, opset_version=16)
    m = onnx.load(path)
    cm = check(m, {m.graph.input[0].name: x.numpy(), m.graph.input[1].name: g.numpy()}, tmp_path)
    torch.testing.assert_close(cm(x, g)[0], M()(x, g), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("b,ishape", [(0, (3, 2)), (0, (2, 3, 1)), (1, (2, 4, 1)), (1, (2, 2)),
                                      (2, (2, 3, 1))])
def test_gather_nd(b, ishape):
    x = _x(2, 3, 4)
    k = ishape[-1]
    hi = x.shape[b:b + k]
    idx = np.stack([rng.integers(-d, d, ishape[:-1]) for d in hi], -1).astype(np.int64)
    i = numpy_helper.from_array(idx, "i")
    m = model([helper.make_node("GatherND", ["x", "i"], ["y"], batch_dims=b)],
              [("x", _F, list(x.shape))], [("y", _F, None)], [i])
    assert fallbacks(check(m, {"x": x})) == []
    m = model([helper.make_node("GatherND", ["x", "i"], ["y"], batch_dims=b)],
              [("x", _F, list(x.shape)), ("i", TensorProto.INT64, list(idx.shape))], [("y", _F, None)])
    check(m, {"x": x, "i": idx})


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceProd", "ReduceL1", "ReduceSumSquare",
                                "ReduceMean", "ReduceMax", "ReduceL2"])
@pytest.mark.parametrize("elem,npdt", [(TensorProto.INT32, np.int32), (TensorProto.INT64, np.int64)])
@pytest.mark.parametrize("keep", [0, 1])
def test_integer_reductions(op, elem, npdt, keep):
    hi = 3 if op == "ReduceProd" else 10      # products of 20 values must not overflow (UB)
    x = rng.integers(-hi + 1, hi, (3, 4, 5)).astype(npdt)
    if op in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceL1"):   # no signed overflow (UB)
        x[0, 0, 0] = np.iinfo(npdt).max // 2
    a = numpy_helper.from_array(np.array([1, -1], np.int64), "a")
    m = model([helper.make_node(op, ["x", "a"], ["y"], keepdims=keep)], [("x", elem, list(x.shape))],
              [("y", elem, None)], [a], 18)
    assert fallbacks(check(m, {"x": x})) == []


@pytest.mark.parametrize("start,end,step", [(10, -10, -1), (-1, -100, -2), (100, 0, -3),
                                            (2, 2, -1), (-100, 100, 2), (0, -1, -1),
                                            (4, 100, 1), (-7, -2, -2)])
def test_slice_clamping(start, end, step):
    x = _x(6, 5)
    ins = [numpy_helper.from_array(np.array([v], np.int64), k) for k, v in
           (("s", start), ("e", end), ("a", 0), ("t", step))]
    m = model([helper.make_node("Slice", ["x", "s", "e", "a", "t"], ["y"])],
              [("x", _F, [6, 5])], [("y", _F, None)], ins)
    check(m, {"x": x})


def test_if_constant_condition_reads_outer_scope(tmp_path):
    outer = helper.make_node("Relu", ["x"], ["r"])
    then_g = helper.make_graph([helper.make_node("Mul", ["r", "x"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", _F, [3, 4])])
    else_g = helper.make_graph([helper.make_node("Neg", ["r"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", _F, [3, 4])])
    for cond in (True, False):
        c = numpy_helper.from_array(np.array(cond), "c")
        node = helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)
        m = model([outer, node], [("x", _F, [3, 4])], [("y", _F, [3, 4])], [c])
        assert fallbacks(check(m, {"x": _x(3, 4)}, tmp_path)) == []


def test_tiny_bert_dynamic_axes_with_input_shapes(tmp_path):
    """The default exporter with dynamic axes: GatherND and friends get static shapes once
    ``input_shapes`` fixes the inputs (the exporter's symbolic value_info is re-inferred)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=32)
    net = transformers.BertForQuestionAnswering(cfg).eval()
    ids = torch.randint(0, 50, (2, 9))

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, ids):
            o = self.net(input_ids=ids)
            return o.start_logits, o.end_logits

    path = str(tmp_path / "bert.onnx")
    torch.onnx.export(M(), (ids,), path, dynamo=False, opset_version=17, input_names=["ids"],
                      dynamic_axes={"ids": {0: "batch", 1: "seq"}})
    m = onnx.load(path)
    check(m, {"ids": ids.numpy()}, tmp_path, input_shapes={"ids": (2, 9)}, atol=1e-5)
