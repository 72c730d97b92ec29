"""int8 linears inside a bf16 graph (docs/guide/precision.md, "int8 linears inside a bf16
transformer"): AscendQuant reads bf16 directly (`quant_bf16_numba`), QuantLinearAct writes
bf16 (oneDNN's output dtype), no Cast around them; static and dynamic; against an exact
float64 re-computation of the quantized arithmetic and against eager, with NaN/±inf, a
second call and output independence."""
import pytest
import torch

import opencann
from opencann.devices.cpu import int8_weight_qmax, mkldnn_available
from opencann.ops.kernels.int8_cpu import dynamic_params, quantize_u8
from opencann.ops.kernels.quant_bf16_numba import quantize_bf16_dense
from opencann.passes.fusion.quantize_int8 import quantize_weight
from opencann.tools.quantize import create_quant_config, quant_report

pytestmark = pytest.mark.skipif(not (mkldnn_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")),
                                reason="no oneDNN int8 kernels in this torch")
BF16 = {"precision_mode": "allow_mix_precision_bf16"}


def _specials(x: torch.Tensor) -> torch.Tensor:
    f = x.view(-1)
    f[::37] = float("nan")
    f[5::41] = float("inf")
    f[7::43] = -float("inf")
    f[11::47] = 1e30     # finite in bf16, saturates
    return x


@pytest.mark.parametrize("shape", [(3, 5), (128, 384), (2, 3, 7, 9), (70001,)])
def test_bf16_quantize_gives_the_bits_of_quantizing_its_fp32_value(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = _specials(torch.randn(shape, generator=g) * 4).bfloat16()
    for step, off in ((0.02, 128), (0.5, 0), (1e-3, 255)):
        got = quantize_bf16_dense(x, step, off)
        assert got is not None and got.dtype == torch.uint8 and got.shape == x.shape
        assert torch.equal(got, quantize_u8(x.float(), step, off))
        assert torch.equal(quantize_u8(x, step, off), got)        # the dispatch takes it
    assert got.data_ptr() != quantize_bf16_dense(x, step, off).data_ptr()
    if len(shape) == 4:
        cl = x.contiguous(memory_format=torch.channels_last)
        y = quantize_bf16_dense(cl, 0.02, 128)
        assert y.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(y, quantize_u8(cl.float(), 0.02, 128))


def test_bf16_quantize_saturates_and_rounds_half_to_even():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, 1000.0, -1000.0, float("nan"), float("inf"), float("-inf")],
                     dtype=torch.bfloat16)
    assert quantize_bf16_dense(x, 1.0, 10).tolist() == [10, 12, 12, 10, 255, 0, 0, 255, 0]
    t = torch.randn(6, 8).bfloat16().t()                     # not dense in memory order
    assert quantize_bf16_dense(t, 0.1, 3) is None
    assert torch.equal(quantize_u8(t, 0.1, 3), quantize_u8(t.float(), 0.1, 3))
    assert quantize_bf16_dense(torch.randn(4), 0.1, 3) is None    # fp32: not this kernel


class Mlp(torch.nn.Module):
    """LayerNorm → Linear-GELU → Linear: in bf16 the linears read and write bf16."""

    def __init__(self, d=48, h=96):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc1, self.fc2 = torch.nn.Linear(d, h), torch.nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x)))) + x


def _mlp():
    torch.manual_seed(0)
    return Mlp().eval()


def _x(seed=1, rows=16):
    return torch.randn(rows, 48, generator=torch.Generator().manual_seed(seed))


def _ref_linear(x_bf16: torch.Tensor, lin: torch.nn.Linear, step: float, off: int, act=None) -> torch.Tensor:
    """float64 re-computation of a bf16 QuantLinearAct: x (bf16) to uint8, the weight cast
    to bf16 (the precision pass) then ARQ int8, bias bf16 → exact products and sums,
    activation, rounded once to bf16."""
    xd = (quantize_u8(x_bf16.float(), step, off).double() - off) * step
    wq, ws = quantize_weight(lin.weight.detach().t().bfloat16().float(), 1, int8_weight_qmax())
    y = xd @ (wq.double() * ws.double()) + lin.bias.detach().bfloat16().double()
    if act == "gelu":
        y = torch.nn.functional.gelu(y)
    return y.float().bfloat16()


def _close_bf16(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal up to one bf16 rounding of the fp32 rescale (oneDNN rounds acc * scale once in
    fp32; the reference in float64)."""
    torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-3)


def test_static_int8_linears_in_a_bf16_graph_read_and_write_bf16():
    m, x = _mlp(), _x()
    q = opencann.quantize(m, [x, _x(2)], options=BF16)
    ops = q.report.op_counts_after
    assert ops.get("QuantLinearAct") == 2 and "LinearAct" not in ops
    quants = [n for n in q.graph.nodes if n.op == "AscendQuant"]
    lins = [n for n in q.graph.nodes if n.op == "QuantLinearAct"]
    assert all(n.inputs[0].desc.dtype.torch == torch.bfloat16 for n in quants)     # read bf16: no Cast
    # fc1 writes bf16 (uint8 once fuse_requant takes it), fc2 fp32: the residual Add reads fp32
    assert [n.outputs[0].desc.dtype.torch for n in lins][1] == torch.float32
    assert lins[0].outputs[0].desc.dtype.torch in (torch.bfloat16, torch.uint8)
    for n in quants + lins:        # the LayerNorm's own Cast to bf16 (as in the bf16 graph) only
        for v in n.inputs:
            assert v.producer is None or v.producer.op != "Cast" or v.desc.dtype.torch == torch.bfloat16, \
                f"{n.name} reads a Cast to fp32"
        for u in n.outputs[0].users:
            assert u.op != "Cast", f"{n.name} is cast after"
    y = q(x)
    with torch.no_grad():
        ref = m(x)
    cos = torch.nn.functional.cosine_similarity(y.flatten().double(), ref.flatten().double(), 0)
    assert y.dtype == torch.float32 and cos > 0.999
    y2 = q(x)
    assert torch.equal(y, y2) and y.data_ptr() != y2.data_ptr()
    y2.fill_(0)
    assert torch.equal(q(x), y)
    assert all(r["int8"] for r in quant_report(q))


def test_bf16_quant_linear_matches_the_quantized_arithmetic():
    """One int8 Linear in a bf16 graph: equal to a float64 re-computation of its arithmetic
    (bf16 x and weight, uint8 x at the calibrated range, ARQ weight) rounded once to bf16."""
    torch.manual_seed(3)
    lin = torch.nn.Linear(40, 24).eval()
    x = torch.randn(7, 40)
    xb = x.bfloat16()
    for mode in ("static", "dynamic"):
        q = opencann.quantize(lin, [x], config=create_quant_config(mode=mode), options=BF16)
        node = next(n for n in q.graph.nodes if n.op == "QuantLinearAct")
        assert node.outputs[0].desc.dtype.torch == torch.bfloat16
        assert node.arg("mat1").desc.dtype.torch == (torch.bfloat16 if mode == "dynamic" else torch.uint8)
        step, off = dynamic_params(xb)      # the calibration of this one batch spans its range
        _close_bf16(q(x), _ref_linear(xb, lin, step, off))


def test_nan_and_inf_in_a_bf16_graph_saturate_as_documented():
    """A NaN/±inf reaching a quantized layer is saturated (NaN → the zero point's level),
    as in fp32 graphs (docs/guide/quantization.md); values elsewhere are untouched."""
    torch.manual_seed(3)
    lin = torch.nn.Linear(40, 24).eval()
    x = torch.randn(7, 40)
    for mode in ("static", "dynamic"):
        q = opencann.quantize(lin, [x], config=create_quant_config(mode=mode), options=BF16)
        bad = x.clone()
        bad[1, 3], bad[2, 4], bad[3, 5] = float("nan"), float("inf"), -float("inf")
        y = q(bad)
        assert torch.isfinite(y).all()
        if mode == "static":       # rows without a special value are as before
            ok = [0, 4, 5, 6]
            assert torch.equal(y[ok], q(x)[ok])
            step, off = dynamic_params(x.bfloat16())
        else:                      # x's range per call is over its finite values only
            step, off = dynamic_params(bad.nan_to_num(0.0, 0.0, 0.0).bfloat16())
        _close_bf16(y, _ref_linear(bad.bfloat16(), lin, step, off))


def test_dynamic_range_leaves_nan_and_inf_out():
    """One NaN/±inf in x must not take the per-call range (step 1.0 would quantize every
    other row to garbage): the range is over the finite values, as calibration's."""
    x = torch.randn(6, 10, generator=torch.Generator().manual_seed(4)) * 3
    for v in (float("nan"), float("inf"), -float("inf")):
        bad = x.clone()
        bad[2, 3] = v
        want = dynamic_params(bad.nan_to_num(0.0, 0.0, 0.0))
        assert dynamic_params(bad) == want and want[0] != 1.0
        assert dynamic_params(bad.bfloat16()) == dynamic_params(bad.nan_to_num(0.0, 0.0, 0.0).bfloat16())
    assert dynamic_params(torch.full((3,), float("nan"))) == (1.0, 0)


def test_bf16_layers_that_int8_does_not_take_say_why():
    class Tanh(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 8)

        def forward(self, x):
            return torch.tanh(self.fc(x))
    m = Tanh().eval()
    q = opencann.quantize(m, [torch.randn(4, 16)], options=BF16)
    rows = quant_report(q)
    if q.report.op_counts_after.get("QuantLinearAct"):
        pytest.skip("tanh is not fused into the linear here")
    assert rows and "activation 'tanh'" in rows[0]["reason"] and "kept in bf16" in rows[0]["reason"]


def test_quantize_refuses_fp16_modes_and_bf16_off_the_cpu_in_one_line():
    lin = torch.nn.Linear(8, 4).eval()
    with pytest.raises(ValueError, match="lowers layers to fp16/bf16.*allow_mix_precision_bf16") as e:
        opencann.quantize(lin, [torch.randn(2, 8)], options={"precision_mode": "allow_mix_precision"})
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="on vnpu:ascend910b; leave it unset"):
        opencann.quantize(lin, [torch.randn(2, 8)], device="vnpu:ascend910b", options=BF16)


class Block(torch.nn.Module):
    """A transformer block's int8 path: residual Add + LayerNorm → Linear-GELU → Linear,
    [B, S, H] reshaped around each Linear as transformers do."""

    def __init__(self, d=32, h=64):
        super().__init__()
        self.inp, self.ln = torch.nn.Linear(d, d), torch.nn.LayerNorm(d)
        self.fc1, self.fc2 = torch.nn.Linear(d, h), torch.nn.Linear(h, d)

    def forward(self, x):
        y = self.ln(self.inp(x) + x)
        return self.fc2(torch.nn.functional.gelu(self.fc1(y))) + y


def test_producers_write_the_uint8_input_and_the_model_file_keeps_it(tmp_path):
    """Static, bf16 graph: the norm writes fc1's uint8 input (AddLayerNormQuant), fc1 writes
    fc2's (fuse_requant through the Reshapes); one AscendQuant is left (the model's input
    before ``inp``). Close to eager, and the same bits after a save / load."""
    torch.manual_seed(0)
    m = Block().eval()
    g = torch.Generator().manual_seed(5)
    cal = [torch.randn(2, 8, 32, generator=g) for _ in range(3)]
    q = opencann.quantize(m, cal, options=BF16)
    ops = q.report.op_counts_after
    assert ops.get("AddLayerNormQuant") == 1 and ops.get("AscendQuant") == 1 and ops.get("QuantLinearAct") == 3, ops
    passes = {e["pass"] for e in q.report.applied}
    assert {"fuse_add_layer_norm_quant", "fuse_requant"} <= passes
    x = torch.randn(2, 8, 32, generator=g)
    with torch.no_grad():
        ref = m(x)
    y = q(x)
    cos = torch.nn.functional.cosine_similarity(y.flatten().double(), ref.flatten().double(), 0)
    assert cos > 0.999
    unfused = opencann.quantize(m, cal, options=dict(BF16, disable=["fuse_add_layer_norm_quant", "fuse_requant"]))
    assert unfused.report.op_counts_after.get("AscendQuant") == 3
    yu = unfused(x)                  # one uint8 step of fc1 / fc2's input at most: close
    torch.testing.assert_close(y, yu, rtol=0.05, atol=0.05 * float(ref.abs().max()))
    path = str(tmp_path / "q.ocm")
    opencann.save(q, path)
    assert torch.equal(opencann.load(path)(x), y)
    bad = x.clone()
    bad[0, 1, 2] = float("nan")
    bad[1, 3, 4] = float("inf")
    yb = q(bad)
    with torch.no_grad():
        eb = m(bad)
    # rows with NaN/inf: eager gives NaN rows (LayerNorm), the int8 path keeps its fp32
    # residual's NaN and saturates the quantized branch; other rows as before
    assert torch.equal(yb.isnan(), eb.isnan())
    assert torch.equal(yb[0, 0], y[0, 0]) and torch.equal(yb[1, 5], y[1, 5])


def test_bf16_convolutions_stay_bf16_with_the_reason():
    class ConvLin(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(torch.relu(self.conv(x)).mean((2, 3)))
    torch.manual_seed(0)
    m = ConvLin().eval()
    x = torch.randn(2, 4, 8, 8)
    q = opencann.quantize(m, [x], options=BF16)
    rows = {r["layer"]: r for r in quant_report(q)}
    conv = next(r for k, r in rows.items() if k.startswith("convolution"))
    assert not conv["int8"] and "bf16 convolution" in conv["reason"]
    assert any(r["int8"] for k, r in rows.items() if k.startswith("addmm"))
    with torch.no_grad():
        ref = m(x)
    assert torch.nn.functional.cosine_similarity(q(x).flatten().double(), ref.flatten().double(), 0) > 0.999


def test_a_skipped_linear_in_a_bf16_graph_is_reported_bf16():
    """A skip_layers linear of a bf16 graph runs bf16: the report says so, not fp32."""
    m, x = _mlp(), _x()
    q = opencann.quantize(m, [x], config=create_quant_config(["fc1"]), options=BF16)
    rows = {r["where"].split(" ")[0]: r for r in quant_report(q)}
    assert not rows["fc1"]["int8"] and rows["fc1"]["reason"] == "in skip_layers: kept in bf16"
    assert rows["fc2"]["int8"] and q.report.op_counts_after.get("LinearAct") == 1
    node = next(n for n in q.graph.nodes if n.op == "LinearAct")
    assert node.outputs[0].desc.dtype.torch == torch.bfloat16
    with torch.no_grad():
        ref = m(x)
    assert torch.nn.functional.cosine_similarity(q(x).flatten().double(), ref.flatten().double(), 0) > 0.999


def test_a_skip_layers_name_of_no_layer_is_one_error_line():
    """A skip_layers typo would leave that layer int8 without a word: one ValueError line
    with near matches instead."""
    m, x = _mlp(), _x()
    with pytest.raises(ValueError, match=r"skip_layers names no layer of the model: 'fc_1'.*near matches: fc1") as e:
        opencann.quantize(m, [x], config=create_quant_config(["fc_1"]), options=BF16)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="skip_layers names no layer"):
        opencann.quantize(m, [x], config=create_quant_config(["fc1", "nothing_like_it"], mode="dynamic"))


def test_bad_calibration_and_config_arguments_are_one_line_each():
    m, x = _mlp(), _x()
    for bad, match in ((None, "calibration_inputs is NoneType: give a list of batches"),
                       (5, "calibration_inputs is int")):
        with pytest.raises(ValueError, match=match) as e:
            opencann.quantize(m, bad, options=BF16)
        assert "\n" not in str(e.value)
    cfg = dict(create_quant_config(), skip_layers="fc1")       # a string would skip 'f', 'c', '1'
    with pytest.raises(ValueError, match=r"skip_layers'\] takes a list of names, e.g. \['fc1'\]"):
        opencann.quantize(m, [x], config=cfg, options=BF16)
