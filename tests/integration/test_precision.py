"""Mixed precision (CANN precision modes): matmul/conv in fp16/bf16, softmax/norms in
fp32, outputs close to fp32.

Tolerances (relative max|a-b|/max|ref|): bf16 keeps 8 mantissa bits (eps 2^-8 = 0.4%),
fp16 11 bits (eps 2^-11); each matmul/conv rounds its inputs once, errors add over the
layers, so we allow 3% (bf16) and 0.5% (fp16) for these two- and three-layer models."""
import pytest
import torch

from opencann.engine import compile_graph
from opencann.frontend.torch import capture, from_exported_program
from opencann.passes.base import PassContext
from opencann.engine.options import complete
from opencann.passes.prepare.precision import MixedPrecision, default_keep_fp32, low_dtype, precision_summary
from opencann.report import CompileReport
from opencann.runtime import Executor


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
        self.ln = torch.nn.LayerNorm(32)
        self.out = torch.nn.Linear(32, 16)

    def forward(self, x):
        a = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) / 32 ** 0.5, dim=-1)
        return self.out(self.ln(a @ x + x))


def _cnn():
    """4 input channels: an odd count keeps a convolution fp32 in bf16 (test_bf16_conv_specials)."""
    return torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv2d(8, 4, 3, padding=1), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 8 * 8, 10), torch.nn.Softmax(-1))


def _run(model, x, mode, **opts):
    torch.manual_seed(0)
    ep, _ = capture(model.eval(), (x,))
    g = from_exported_program(ep)
    ctx = PassContext(options=complete({"precision_mode": mode, **opts}), report=CompileReport())
    MixedPrecision().run(g, ctx)
    g, plan, _ = compile_graph(g, "cpu")
    return Executor(g, plan).run([x])[0], precision_summary(g)


@pytest.mark.parametrize("mode,dt,tol", [("allow_mix_precision_bf16", "bfloat16", 3e-2),
                                         ("allow_mix_precision", "float16", 5e-3)])
def test_mix_precision_transformer_block(mode, dt, tol):
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 8, 32)
    ref = model(x)
    out, summ = _run(model, x, mode)
    # bf16 Linears become LinearAct (oneDNN's prepacked bf16 GEMM); fp16 ones stay addmm
    gemm = "LinearAct" if dt == "bfloat16" else "MatMulV2"
    assert set(summ[gemm]) == {dt} and set(summ["BatchMatMul"]) == {dt}
    # the norm stays fp32: its residual Add and the Casts around it are one AddLayerNormCast
    # (fuse_add_layer_norm_cast: fp32 arithmetic, a low-precision copy for the next GEMM)
    assert set(summ["SoftmaxV2"]) == {"float32"} and "LayerNorm" not in summ
    assert summ["AddLayerNormCast"] == {"float32": 1}
    assert out.dtype == torch.float32
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert 0 < err < tol


def test_mix_precision_cnn_bf16():
    torch.manual_seed(0)
    model, x = _cnn(), torch.randn(2, 4, 8, 8)
    ref = model(x)
    out, summ = _run(model, x, "allow_mix_precision_bf16")
    # both convolutions lowered, then fused into oneDNN's bf16 convolution (where oneDNN
    # has bf16 kernels on this CPU; else ATen's bf16 Conv2D)
    from opencann.devices.cpu import onednn_bf16_available
    conv = "ConvBiasAct" if onednn_bf16_available() else "Conv2D"
    assert summ[conv] == {"bfloat16": 2} and ({"ConvBiasAct", "Conv2D"} - {conv}).isdisjoint(summ)
    assert set(summ["SoftmaxV2"]) == {"float32"}
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 3e-2


def test_keep_list_is_user_modifiable_and_keep_modes():
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 8, 32)
    ref = model(x)
    out, summ = _run(model, x, "allow_mix_precision_bf16", keep_fp32=["BatchMatMul"])
    assert set(summ["BatchMatMul"]) == {"float32"} and set(summ["LinearAct"]) == {"bfloat16"}
    for mode in ("must_keep_origin_dtype", "allow_fp32_to_fp16", "force_fp32"):
        out, summ = _run(model, x, mode)
        assert "Cast" not in summ
        assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5
    assert "SoftmaxV2" in default_keep_fp32() and "Relu" not in default_keep_fp32()
    with pytest.raises(ValueError, match="unknown precision_mode"):
        low_dtype("fp8_please")


def test_keep_fp32_default_comes_from_the_opdef_column(monkeypatch):
    """MixedPrecision's default keep-list is the ops whose OpDef says keep_fp32; the
    ``keep_fp32`` argument still replaces it."""
    from opencann.ops import get_op
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 8, 32)
    ref = model(x)
    monkeypatch.setattr(get_op("BatchMatMul"), "keep_fp32", True)
    assert "BatchMatMul" in MixedPrecision().keep_fp32
    out, summ = _run(model, x, "allow_mix_precision_bf16")
    assert set(summ["BatchMatMul"]) == {"float32"} and set(summ["LinearAct"]) == {"bfloat16"}
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 3e-2
    assert MixedPrecision(keep_fp32=["Exp"]).keep_fp32 == {"Exp"}


def test_force_fp16_lowers_everything():
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 8, 32)
    ref = model(x)
    out, summ = _run(model, x, "force_fp16")
    assert set(summ["SoftmaxV2"]) == {"float16"} and set(summ["LayerNorm"]) == {"float16"}
    assert out.dtype == torch.float32
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 2e-2


@pytest.mark.parametrize("norm", ["layer", "group"])
def test_bf16_autocast_inference_with_norms(norm):
    """LayerNorm/GroupNorm on a bf16 input under autocast: their CPU kernels keep the
    statistics in bf16 where ATen's meta kernel (and so the .out overload) says fp32;
    such nodes allocate their own outputs instead of writing into the arena."""
    import opencann  # noqa: F401 - registers the backend
    torch.manual_seed(0)
    if norm == "layer":
        m, x = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)), torch.randn(2, 16)
    else:
        m = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.GroupNorm(2, 8), torch.nn.ReLU())
        x = torch.randn(2, 4, 8, 8)
    cm = torch.compile(m, backend="opencann", dynamic=False)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = cm(x), m(x)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref.float(), atol=1e-2)


@pytest.mark.parametrize("dt,mode", [(torch.bfloat16, "allow_mix_precision"),
                                     (torch.float16, "allow_mix_precision_bf16")])
def test_low_precision_model_under_another_low_mode(dt, mode):
    """A bf16 (fp16) model under an fp16 (bf16) mode: ops kept in fp32 get all their float
    inputs in fp32, the model's own weights included (ATen wants one dtype)."""
    import torch.nn as nn

    import opencann
    torch.manual_seed(0)
    for m, x in ((nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), torch.randn(2, 8)),
                 (nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), torch.randn(1, 3, 6, 6))):
        m, x = m.eval().to(dt), x.to(dt)
        out = opencann.compile(m, (x,), options={"precision_mode": mode})(x)
        assert out.dtype == dt and torch.allclose(out.float(), m(x).float(), atol=3e-2)


class _SdpaHeads(torch.nn.Module):
    """Multi-head attention as transformers writes it: SDPA's output (whose traced strides
    are the flash kernel's [B, S, H, D] layout) transposed and viewed back to [B, S, H*D]."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.out = torch.nn.Linear(32, 32)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(a.transpose(1, 2).reshape(b, s, 32)), a.transpose(1, 2)


@pytest.mark.parametrize("mode", ["allow_mix_precision_bf16", "allow_mix_precision_fp16",
                                  "force_fp32"])
@pytest.mark.parametrize("keep", [["Reshape"], ["Reshape", "Transpose"], []])
def test_casts_keep_the_traced_layout_views_rely_on(mode, keep):
    """A Cast a precision mode inserts stands for its input: it keeps that value's traced
    strides, so a view after it (kept in fp32) can still be taken and a returned view has
    eager's strides. Regression: MiniLM under bf16 with keep_fp32=["Reshape"] failed with
    "view size is not compatible with input tensor's size and stride"."""
    import opencann
    torch.manual_seed(0)
    model = _SdpaHeads().eval()
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        ref = model(x)
    c = opencann.compile(model, (x,), options={"precision_mode": mode, "keep_fp32": keep})
    for _ in range(2):
        out = c(x)
        for o, r in zip(out, ref):
            assert o.dtype == r.dtype and o.shape == r.shape
            assert o.stride() == r.stride()
            assert (o - r).abs().max() / r.abs().max() < 3e-2
    x2 = x.clone()
    x2[0, 1, 3] = float("nan")
    with torch.no_grad():
        ref2 = model(x2)
    out2 = c(x2)
    for o, r in zip(out2, ref2):
        assert torch.equal(o.isnan(), r.isnan())


def test_keep_fp32_names_fused_ops_as_the_report_shows_them():
    """keep_fp32 takes the fused op names the compile report shows (LinearAct, ConvBiasAct):
    mixed precision runs before fusion, so it keeps the ops they are formed from
    (``OpDef.fused_from``); a fused op whose parts also run unfused is one clear error."""
    import opencann
    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(2, 8, 32)
    ref = model(x)
    cm = opencann.compile(model, x, options={"precision_mode": "allow_mix_precision_bf16",
                                             "keep_fp32": ["LinearAct"]})
    summ = precision_summary(cm.graph)
    assert "LinearAct" in summ and set(summ["LinearAct"]) == {"float32"}
    assert set(summ["BatchMatMul"]) == {"bfloat16"}
    out = cm(x)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 3e-2
    cnn, xc = _cnn().eval(), torch.randn(2, 4, 8, 8)
    cm = opencann.compile(cnn, xc, options={"precision_mode": "allow_mix_precision_bf16",
                                            "keep_fp32": ["ConvBiasAct"]})
    summ = precision_summary(cm.graph)
    convs = {op: set(d) for op, d in summ.items() if op.startswith("Conv")}
    assert convs and all(d == {"float32"} for d in convs.values()), summ
    with pytest.raises(ValueError, match="FusedElementwise is formed by fusion"):
        opencann.compile(model, x, options={"precision_mode": "allow_mix_precision_bf16",
                                            "keep_fp32": ["FusedElementwise"]})


def test_bisect_candidates_are_pre_fusion_types():
    """compare --bisect's keep_fp32 candidates name what the precision pass sees: a fused
    layer as its ``fused_from`` types, a FusedElementwise never."""
    from types import SimpleNamespace as NS
    from opencann.tools import bisect

    class T:
        def search(self, what, option, names):
            return names
    layers = [NS(op="LinearAct", dtype="bfloat16"), NS(op="FusedElementwise", dtype="bfloat16"),
              NS(op="BatchMatMul", dtype="bfloat16"), NS(op="SoftmaxV2", dtype="float32"),
              NS(op="ConvAddAct", dtype="bfloat16")]
    assert bisect._narrow_precision(T(), NS(layers=layers)) == ["BatchMatMul", "Conv2D", "MatMul",
                                                                "MatMulV2"]


@pytest.mark.parametrize("mode", ["allow_mix_precision_bf16", "allow_mix_precision_fp16"])
@pytest.mark.parametrize("views", ["slice", "chunk", "transpose_slice"])
def test_outputs_that_are_views_of_another_output_alias_it_as_in_eager(mode, views):
    """A model returning y and views of y: under a low-precision mode each output was cast
    back on its own, two tensors where eager's alias; a view of an output is now the same
    view of that output's cast (values equal eager's to the mode's rounding, and writing
    into y shows through the views, as in eager)."""
    import opencann

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 6)

        def forward(self, x):
            y = self.lin(x)
            if views == "slice":
                return y, y[:1]
            if views == "chunk":
                a, b = y.chunk(2, dim=1)
                return y, a, b
            return y, y.t()[1:3]
    torch.manual_seed(0)
    m = M().eval()
    x = torch.randn(4, 8)
    cm = opencann.compile(m, (x,), options={"precision_mode": mode})
    with torch.no_grad():
        ref = m(x)
    out = cm(x)
    for o, r in zip(out, ref):
        assert o.dtype == r.dtype and o.shape == r.shape and o.stride() == r.stride()
        assert (o - r).abs().max().item() < 0.05
    out[0].fill_(7.0)                                   # a write into y shows in every view
    assert all(bool((o == 7.0).all()) for o in out[1:])
    again = cm(x)                                        # and not in the next call's outputs
    assert not bool((again[0] == 7.0).any())


@pytest.mark.parametrize("mode,dt", [("force_fp16", torch.float32), ("allow_mix_precision", torch.float32),
                                     ("allow_mix_precision_bf16", torch.float32),
                                     ("force_fp32", torch.float16), ("force_fp16", torch.bfloat16)])
def test_outputs_that_are_views_of_an_input_alias_it_as_in_eager(mode, dt):
    """A model returning its input and views of it (``y, x, x[:2]``, a transpose, a
    chunk, a view of a view): force_fp16 sliced the input's fp16 cast and cast the slice
    back, a rounded copy where eager returns a view of the caller's tensor. Such an
    output never passes through a cast, in any mode: the same values, NaN and ±inf
    included, bit for bit, in the caller's memory (a write through the returned input
    shows in every view, as in eager), call after call."""
    import opencann

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            a, b = x.chunk(2)
            return self.lin(x), x, x[:2], x.t(), x[1:3][:, 2:5], a, b
    torch.manual_seed(0)
    m = M().eval().to(dt)
    cm = opencann.compile(m, (torch.randn(4, 16, dtype=dt),), options={"precision_mode": mode})
    for _ in range(2):
        x = torch.randn(4, 16, dtype=dt)
        x[0, 1], x[1, 3], x[3, 5] = float("nan"), float("inf"), float("-inf")
        with torch.no_grad():
            ref = m(x)
        out = cm(x)
        assert out[0].dtype == ref[0].dtype
        for o, r in zip(out[1:], ref[1:]):
            assert o.dtype == r.dtype and o.shape == r.shape and o.stride() == r.stride()
            assert o.data_ptr() == r.data_ptr()          # a view of the caller's x, as eager's
            bits = torch.int32 if dt == torch.float32 else torch.int16
            assert torch.equal(o.view(bits), r.view(bits))     # bit for bit, NaN included
        out[1].fill_(7.0)                                # a write into x shows in every view
        assert all(bool((o == 7.0).all()) for o in out[2:])
