"""F.interpolate runs ATen's upsampling kernels, bit for bit (#26, seed 73 of the shape
fuzzer): the upsampling overloads are kept whole through capture (torch.export and
AOTAutograd) and are library ops (`opencann.ops.resize`), not a re-derivation of the
interpolation (whose zero-weight taps turned NaN neighbours into NaN) nor host fallbacks.
Every mode, align_corners both ways, size= and scale_factor=, the same size, NaN and ±inf
in the input, a second call, output independence, opencann.compile, torch.compile at
two sizes, dynamic dims, a saved model file, and the ONNX Resize converter's fast path.
make test runs every mode and alignment at a rotation of the geometries (`_sampled`); the
whole mode x alignment x geometry grid is marked ``full`` (make test-all)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

import opencann
from helpers import save_and_load
from opencann.ops import get_op
from opencann.ops import per_index as pi
from opencann.dynamo.compile_fx import COMPILED_GRAPHS
from opencann.ops.resize import OVERLOADS
from opencann.tools.fuzz_shapes import check_shape_program, generate_shape_program

RANK = {"nearest1d": 3, "nearest": 4, "nearest3d": 5, "nearest-exact1d": 3, "nearest-exact": 4,
        "nearest-exact3d": 5, "linear": 3, "bilinear": 4, "bicubic": 4, "trilinear": 5, "area": 4}
ALIGNABLE = ("linear", "bilinear", "bicubic", "trilinear")


def _mode(key: str) -> str:
    return key.replace("1d", "").replace("3d", "")


def _cases():
    out = []
    for key in RANK:
        aligns = (False, True) if _mode(key) in ALIGNABLE else (None,)
        for ac in aligns:
            for geom in ("same", "size", 0.5, 1.5, 2, 3.7):
                if key == "area" and geom in (1.5, 2, 3.7):
                    geom = "size"             # area is adaptive pooling: any size
                out.append((key, ac, geom, False))
    for key in ("bilinear", "bicubic"):       # antialias: downscaling and upscaling
        for ac in (False, True):
            for geom in ("same", "size", 0.5, 1.5):
                out.append((key, ac, geom, True))
    return list(dict.fromkeys(out))


CASES = _cases()
GEOMS = ("same", "size", 0.5, 1.5, 2, 3.7)


def _sampled(cases, per_pair, geoms=GEOMS):
    """``per_pair`` geometries for each (mode, align_corners, antialias) of ``cases``, rotating
    through ``geoms`` from pair to pair: every mode, both alignments, antialias and every
    geometry stay in make test; the whole grid is marked ``full`` (make test-all)."""
    pairs = list(dict.fromkeys((k, ac, aa) for k, ac, _, aa in cases))
    keep, at = set(), 0
    for k, ac, aa in pairs:
        own = [c for c in cases if (c[0], c[1], c[3]) == (k, ac, aa)]
        mine = [c for c in own if c[2] in geoms]
        for j in range(min(per_pair, len(mine))):
            keep.add(mine[(at + j) % len(mine)])
        at += per_pair
    return [c if c in keep else pytest.param(c, marks=pytest.mark.full) for c in cases]


def _kwargs(key, ac, geom, aa, x_shape):
    kw = {"mode": _mode(key)}
    if ac is not None:
        kw["align_corners"] = ac
    if aa:
        kw["antialias"] = True
    return kw, geom


class Resize(torch.nn.Module):
    def __init__(self, kw, geom):
        super().__init__()
        self.kw, self.geom = kw, geom

    def forward(self, x):
        if self.geom == "same":
            return F.interpolate(x, size=x.shape[2:], **self.kw)
        if self.geom == "size":   # other sizes, computed from the input's
            size = tuple(max(1, (d * 3) // 2 + k) for k, d in enumerate(x.shape[2:]))
            return F.interpolate(x, size=size, **self.kw)
        return F.interpolate(x, scale_factor=self.geom, **self.kw)


def _x(rank: int, spatial: int = 6, seed: int = 0) -> torch.Tensor:
    """Random values with NaN, +inf and -inf planted (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, 3) + tuple(spatial + k for k in range(rank - 2))
    x = torch.randn(shape, generator=g)
    flat = x.view(-1)
    flat[::11] = float("nan")
    flat[5::17] = float("inf")
    flat[9::23] = float("-inf")
    return x


def _same(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _ids(c):
    key, ac, geom, aa = c
    return f"{key}-ac{ac}-{geom}{'-aa' if aa else ''}"


@pytest.mark.parametrize("case", _sampled(CASES, 2), ids=_ids)
def test_opencann_compile_bit_for_bit(case):
    key, ac, geom, aa = case
    x = _x(RANK[key])
    kw, geom = _kwargs(key, ac, geom, aa, x.shape)
    m = Resize(kw, geom).eval()
    ref = m(x)
    cm = opencann.compile(m, (x,))
    ops = [n.op for n in cm.graph.nodes]
    assert "HostFallback" not in ops and "Index" not in ops, ops
    y1 = cm(x.clone())
    _same(y1, ref)
    y1_copy = y1.clone()
    x2 = _x(RANK[key], seed=1)
    y2 = cm(x2)                                   # a second call, other values
    _same(y2, m(x2))
    _same(y1, y1_copy)                            # the first result is not overwritten
    assert y1.data_ptr() != y2.data_ptr()


TORCH_COMPILE_CASES = [c for c in CASES if c[2] in ("same", 1.5, 3.7) and c[1] is not True] + \
    [("bilinear", True, "same", False), ("bicubic", True, 0.5, False)]


@pytest.mark.parametrize("case", _sampled(list(dict.fromkeys(TORCH_COMPILE_CASES)), 1), ids=_ids)
def test_torch_compile_at_two_sizes_bit_for_bit(case):
    key, ac, geom, aa = case
    kw, geom = _kwargs(key, ac, geom, aa, None)
    m = Resize(kw, geom).eval()
    torch._dynamo.reset()
    f = torch.compile(m, backend="opencann")
    n0 = len(COMPILED_GRAPHS)
    with torch.no_grad():
        for spatial, seed in ((6, 0), (9, 1), (11, 2)):   # the 2nd size recompiles with symbols
            x = _x(RANK[key], spatial, seed)
            _same(f(x.clone()), m(x))
            _same(f(x.clone()), m(x))
    reports = COMPILED_GRAPHS[n0:]
    assert len(reports) == 2 and reports[1].dynamic        # static, then symbolic sizes
    for r in reports:                                      # one library op, ATen's kernel
        assert r.host_fallbacks == {} and len(r.op_counts_after) == 1, r.op_counts_after
        assert get_op(next(iter(r.op_counts_after))).aten in OVERLOADS or key == "area"


@pytest.mark.parametrize("key,ac,geom", [("bilinear", True, "same"), ("bicubic", False, 1.5),
                                          ("nearest", None, "size"), ("trilinear", False, 0.5)])
def test_dynamic_dims_bit_for_bit(key, ac, geom):
    kw, geom = _kwargs(key, ac, geom, False, None)
    m = Resize(kw, geom).eval()
    rank = RANK[key]
    dims = {0: torch.export.Dim("b", min=1, max=8),
            **{d: torch.export.Dim(f"s{d}", min=4, max=32) for d in range(2, rank)}}
    cm = opencann.compile(m, (_x(rank, 6),), dynamic_shapes={"x": dims})
    for batch, spatial in ((2, 6), (5, 13), (3, 8)):
        x = _x(rank, spatial, seed=spatial)
        x = torch.cat([x] * 3)[:batch]
        _same(cm(x), m(x))


def test_saved_model_file_bit_for_bit(tmp_path):
    m = Resize({"mode": "bicubic", "align_corners": True}, 1.5).eval()
    x = _x(4)
    cm = opencann.compile(m, (x,))
    loaded, _ = save_and_load(cm, tmp_path)
    _same(loaded(x), m(x))
    _same(loaded(x.clone()), m(x))


def test_compile_report_lists_no_host_fallback():
    class Many(torch.nn.Module):
        def forward(self, x, v):
            ys = [F.interpolate(x, scale_factor=1.5, mode=m) for m in ("nearest", "nearest-exact")]
            ys += [F.interpolate(x, size=(7, 9), mode=m, align_corners=True) for m in ("bilinear", "bicubic")]
            ys += [F.interpolate(x, scale_factor=0.5, mode="bilinear", antialias=True)]
            ys += [F.interpolate(v, scale_factor=2, mode="trilinear"),
                   F.interpolate(x[:, :, 0], size=5, mode="linear")]
            return ys
    x, v = _x(4), _x(5)
    cm = opencann.compile(Many().eval(), (x, v))
    assert cm.report.host_fallbacks == {}
    ops = sorted({n.op for n in cm.graph.nodes})
    assert {"ResizeNearestNeighborV2Vec", "UpsampleNearestExact2dVec", "ResizeBilinearV2Vec",
            "ResizeBicubicVec", "UpsampleBilinear2dAAVec", "UpsampleTrilinear3dVec",
            "UpsampleLinear1dVec"} <= set(ops), ops
    for got, ref in zip(cm(x, v), Many()(x, v)):
        _same(got, ref)


def test_every_upsampling_overload_is_a_library_op_with_cost_and_padding_rule():
    cm = opencann.compile(Resize({"mode": "bicubic"}, 2).eval(), (_x(4),))
    node = next(n for n in cm.graph.nodes if n.op == "ResizeBicubicVec")
    op = get_op(node.op)
    cost = op.cost(node)
    assert node.outputs[0].desc.shape == (2, 3, 12, 14)
    assert cost.flops == 31 * 2 * 3 * 12 * 14                       # 16 taps: 2·16 − 1 per output
    assert cost.bytes == (2 * 3 * 6 * 7 + 2 * 3 * 12 * 14) * 4
    assert op.per_index is pi.RESIZE
    assert isinstance(pi.RESIZE(node, {0: 0}, "b"), dict)          # batch: padding is safe
    assert isinstance(pi.RESIZE(node, {0: 1}, "c"), dict)          # channels too
    assert "mixes" in pi.RESIZE(node, {0: 2}, "h")                 # spatial: refused
    from opencann.devices.vnpu import ascend910b
    kc, model = op.device_cost["vnpu"](node, ascend910b)            # vnpu: ATen kernel, ND
    assert kc.time_us > 0 and "resize" in model
    from opencann.ops import lookup_aten
    for ov in OVERLOADS:
        assert lookup_aten(ov) is not None, ov


def _onnx_resize(shape, mode, ctm, scales, **attrs):
    inits = [numpy_helper.from_array(np.array([], np.float32), "roi"),
             numpy_helper.from_array(np.array(scales, np.float32), "scales")]
    node = helper.make_node("Resize", ["x", "roi", "scales"], ["y"], mode=mode,
                            coordinate_transformation_mode=ctm, **attrs)
    out = [int(d * s) for d, s in zip(shape, scales)]
    g = helper.make_graph([node], "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    m.ir_version = min(m.ir_version, 10)
    return m


@pytest.mark.parametrize("mode,ctm,attrs,op,torch_kw", [
    ("nearest", "asymmetric", {"nearest_mode": "floor"}, "ResizeNearestNeighborV2Vec", {"mode": "nearest"}),
    ("linear", "half_pixel", {}, "ResizeBilinearV2Vec", {"mode": "bilinear", "align_corners": False}),
])
def test_onnx_resize_fast_path_is_the_same_op(mode, ctm, attrs, op, torch_kw):
    x = _x(4)
    m = _onnx_resize(tuple(x.shape), mode, ctm, [1, 1, 2.0, 2.0], **attrs)
    cm = opencann.compile(m)
    assert op in [n.op for n in cm.graph.nodes]
    _same(cm(x)[0], F.interpolate(x, scale_factor=2.0, **torch_kw))


def test_shape_fuzzer_seed73_matches_eager():
    prog = generate_shape_program(73)
    assert prog.steps[0] == "interpolate_size"
    assert check_shape_program(prog) == []
