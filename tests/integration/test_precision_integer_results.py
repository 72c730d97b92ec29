"""Precision modes on two things a cast to fp16 / bf16 used to break:

* an op whose own ``dtype`` argument pins its output dtype (ONNX CumSum's converter,
  ``x.cumsum(1, dtype=torch.float32)``, ``sum`` / ``mean`` with ``dtype``): under
  ``force_fp16`` the pass lowered the output and left the argument, so every call failed
  ("Expected out tensor to have dtype float, but got c10::Half");
* an integer result cast to float before its dequantization scale (ConvInteger's and
  MatMulInteger's int32 accumulator in ONNX Runtime's ``quantize_dynamic`` files,
  ``torch._int_mm``): cast to fp16 it overflowed 65504, and every output was NaN. It is
  now read in fp32 up to the Mul applying its scale.

References: ONNX Runtime for float files, ``onnx.reference`` (exact integer arithmetic) for
integer-op files (ONNX Runtime's u8 x s8 kernels saturate on CPUs without VNNI), eager
PyTorch for torch models. Tolerance: fp16 rounding, 4e-3 of the output's largest value."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import opencann

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

F16_TOL = 4e-3


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _close(y: torch.Tensor, ref: np.ndarray, tol: float = F16_TOL):
    assert y.dtype == torch.from_numpy(ref).dtype and not torch.isnan(y).any()
    scale = float(np.abs(ref).max())
    assert float((y - torch.from_numpy(ref)).abs().max()) <= tol * scale


def _note(cm) -> str:
    return next(p.note for p in cm.report.passes if p.name == "precision") or ""


# -- an op's own dtype argument follows the mode ---------------------------------------

def _cumsum(elem):
    return _model([helper.make_node("CumSum", ["x", "ax"], ["y"])],
                  [helper.make_tensor_value_info("x", elem, [3, 5])],
                  [helper.make_tensor_value_info("y", elem, [3, 5])],
                  [numpy_helper.from_array(np.array(1, np.int64), "ax")])


@pytest.mark.parametrize("device", ["cpu", "vnpu:ascend310"])
def test_onnx_cumsum_under_force_fp16_matches_onnxruntime(device):
    m = _cumsum(TensorProto.FLOAT)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    ref = ort.InferenceSession(m.SerializeToString()).run(None, {"x": x.numpy()})[0]
    cm = opencann.compile(m, device=device, options={"precision_mode": "force_fp16"})
    for _ in range(2):
        _close(cm(x)[0], ref)


def test_onnx_integer_cumsum_keeps_its_dtype_under_force_fp16():
    """An int32 CumSum stays int32 (ATen would widen it to int64) and wraps as ONNX Runtime."""
    m = _cumsum(TensorProto.INT32)
    x = torch.tensor([[2 ** 30, 2 ** 30, 5, -7, 1]] * 3, dtype=torch.int32)
    ref = ort.InferenceSession(m.SerializeToString()).run(None, {"x": x.numpy()})[0]
    y = opencann.compile(m, options={"precision_mode": "force_fp16"})(x)[0]
    assert y.dtype == torch.int32
    np.testing.assert_array_equal(y.numpy(), ref)


class DtypeArg(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x) * 2


DTYPE_ARGS = {
    "cumsum": lambda x: torch.cumsum(x, 1, dtype=torch.float32),
    "sum": lambda x: torch.sum(x, 1, dtype=torch.float32),
    "mean": lambda x: torch.mean(x, 1, dtype=torch.float32),
    "sum_of_half": lambda x: torch.sum(x.half(), 1, dtype=torch.float32),
}


@pytest.mark.parametrize("name", sorted(DTYPE_ARGS))
@pytest.mark.parametrize("opts", [{"precision_mode": "force_fp16"},
                                  {"precision_mode": "allow_mix_precision_bf16"}])
def test_torch_dtype_argument_follows_the_mode(name, opts):
    model = DtypeArg(DTYPE_ARGS[name])
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    cm = opencann.compile(model, (x,), options=opts)
    tol = 2e-2 if "bf16" in opts["precision_mode"] else F16_TOL
    _close(cm(x), model(x).numpy(), tol)


def test_node_precision_fp16_on_a_node_with_a_dtype_argument():
    model = DtypeArg(DTYPE_ARGS["sum"])
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(2))
    name = next(n.name for n in opencann.compile(model, (x,)).graph.nodes if n.op == "ReduceSum")
    cm = opencann.compile(model, (x,), options={"node_precision": {name: "fp16"}})
    _close(cm(x), model(x).numpy())


# -- integer accumulators are dequantized in fp32 --------------------------------------

def _conv_integer():
    """ONNX Runtime's quantize_dynamic Conv: DynamicQuantizeLinear(x) -> ConvInteger ->
    Cast(float) -> Mul(x_scale * w_scale); weights of +-127 put the int32 sums far beyond
    fp16's 65504."""
    rng = np.random.default_rng(0)
    w = (rng.choice([-1, 1], (8, 8, 3, 3)) * rng.integers(100, 128, (8, 8, 3, 3))).astype(np.int8)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("ConvInteger", ["xq", "w", "xz", "wz"], ["acc"], pads=[1, 1, 1, 1]),
             helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["xs", "ws"], ["s"], name="scales_mul"),
             helper.make_node("Mul", ["accf", "s"], ["y"], name="dequant_mul")]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(0, np.int8), "wz"),
             numpy_helper.from_array(np.array(0.0021, np.float32), "ws")]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 6, 6])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 6, 6])], inits)


def _matmul_integer():
    """MatMulInteger of two dynamically quantized activations (not a constant weight: not
    folded into a float MatMul), int32 -> Cast -> Mul(a_scale * b_scale)."""
    nodes = [helper.make_node("DynamicQuantizeLinear", ["a"], ["aq", "as", "az"]),
             helper.make_node("DynamicQuantizeLinear", ["b"], ["bq", "bs", "bz"]),
             helper.make_node("MatMulInteger", ["aq", "bq", "az", "bz"], ["acc"]),
             helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["as", "bs"], ["s"], name="scales_mul"),
             helper.make_node("Mul", ["accf", "s"], ["y"], name="dequant_mul")]
    return _model(nodes, [helper.make_tensor_value_info("a", TensorProto.FLOAT, [4, 64]),
                          helper.make_tensor_value_info("b", TensorProto.FLOAT, [64, 5])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 5])])


def _feeds(m):
    g = torch.Generator().manual_seed(3)
    return {i.name: torch.randn(*[d.dim_value for d in i.type.tensor_type.shape.dim], generator=g) * 3
            for i in m.graph.input}


@pytest.mark.parametrize("make", [_conv_integer, _matmul_integer])
@pytest.mark.parametrize("device", ["cpu", "vnpu:ascend910b"])
def test_integer_accumulator_is_scaled_before_fp16(make, device):
    m = make()
    feeds = _feeds(m)
    ref = ReferenceEvaluator(m).run(None, {k: v.numpy() for k, v in feeds.items()})[0]
    cm = opencann.compile(m, device=device, options={"precision_mode": "force_fp16"})
    for _ in range(2):
        _close(cm(*feeds.values())[0], ref)
    note = _note(cm)
    assert "dequant_mul (Mul)" in note and "scales_mul (Mul)" in note and "beyond" in note


class IntMM(torch.nn.Module):
    """``torch._int_mm`` (int8 x int8 -> int32), then its per-column scale and a ReLU."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.register_buffer("w", torch.randint(-127, 128, (64, 32), dtype=torch.int8, generator=g))
        self.scale = torch.nn.Parameter(torch.full((32,), 1e-4))

    def forward(self, a):
        return (torch._int_mm(a, self.w).float() * self.scale).relu()


def test_torch_int_mm_is_scaled_before_fp16():
    model = IntMM().eval()
    a = torch.randint(-127, 128, (32, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(a)
    cm = opencann.compile(model, (a,), options={"precision_mode": "force_fp16"})
    _close(cm(a), ref.numpy())
    assert "mul (Mul)" in _note(cm) and "the int32 result of _int_mm" in _note(cm)


class Dequant8(torch.nn.Module):
    """DequantizeLinear's arithmetic on a uint8 input: (q - 128) fits fp16 exactly."""

    def forward(self, q, s):
        return (q.to(torch.int32) - 128).float() * s


def test_eight_bit_minus_zero_point_is_still_lowered():
    """Only integers beyond what the low type holds exactly keep their reader in fp32: an
    8-bit value minus its zero point (ONNX DequantizeLinear) is lowered as before."""
    q = torch.randint(0, 256, (4, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    s = torch.tensor(0.02)
    cm = opencann.compile(Dequant8(), (q, s), options={"precision_mode": "force_fp16"})
    assert "beyond" not in _note(cm)
    _close(cm(q, s), Dequant8()(q, s).numpy())
