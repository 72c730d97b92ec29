"""int8 post-training quantization (`opencann.quantize`, the ``quantize_int8`` pass, oneDNN's
int8 kernels): quantize → compile → run against eager fp32 within int8 rounding, the
kernels against an exact dequantized reference, skip_layers, dynamic linears, the model
file round trip, a second call, output independence, saturation of NaN/±inf, and one-line
errors (docs/guide/quantization.md)."""
import pytest
import torch

import opencann
from opencann.devices.cpu import int8_weight_qmax, mkldnn_available
from opencann.ops.kernels.int8_cpu import dynamic_params, quantize_u8
from opencann.passes.fusion.quantize_int8 import quantize_weight
from opencann.tools.quantize import create_quant_config, quant_report

pytestmark = pytest.mark.skipif(not (mkldnn_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")),
                                reason="no oneDNN int8 kernels in this torch")


class Net(torch.nn.Module):
    """Conv-BN-ReLU, a residual block (conv-BN-ReLU, conv-BN + x, ReLU), global mean, then
    Linear-GELU-Linear: every int8 kernel (QuantConvBiasAct, QuantConvAddAct, QuantLinearAct)."""

    def __init__(self):
        super().__init__()
        c = 16
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, c, 3, padding=1), torch.nn.BatchNorm2d(c),
                                        torch.nn.ReLU())
        self.a, self.bn_a = torch.nn.Conv2d(c, c, 3, padding=1), torch.nn.BatchNorm2d(c)
        self.b, self.bn_b = torch.nn.Conv2d(c, c, 3, padding=1), torch.nn.BatchNorm2d(c)
        self.fc1, self.fc2 = torch.nn.Linear(c, 64), torch.nn.Linear(64, 10)
        for bn in (self.stem[1], self.bn_a, self.bn_b):
            with torch.no_grad():
                bn.running_mean.normal_(0, 0.1)
                bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        y = self.stem(x)
        z = torch.relu(self.bn_b(self.b(torch.relu(self.bn_a(self.a(y))))) + y)
        return self.fc2(torch.nn.functional.gelu(self.fc1(z.mean((2, 3)))))


def _model():
    torch.manual_seed(0)
    return Net().eval()


def _cal(n=4):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 3, 16, 16, generator=g) for _ in range(n)]


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), 0).item()


def test_static_quantization_runs_int8_kernels_close_to_eager():
    m = _model()
    q = opencann.quantize(m, _cal())
    ops = q.report.op_counts_after
    assert ops.get("QuantConvBiasAct") == 2 and ops.get("QuantConvAddAct") == 1
    # 5 int8 layers, 2 AscendQuant (the input, the mean's result): stem → a, the residual
    # block (its result dequantized once for the fp32 mean: the chain's end) and fc1 → fc2
    # write uint8 (fuse_requant)
    assert ops.get("QuantLinearAct") == 2 and ops.get("AscendQuant", 0) == 2 and ops.get("AscendDequant") == 1
    assert sorted(e["nodes"] for e in q.report.applied if e["pass"] == "fuse_requant") == \
        sorted(n.name for n in q.graph.nodes if n.op.startswith("Quant") and n.outputs[0].desc.dtype.torch == torch.uint8)
    assert not {"ConvBiasAct", "ConvAddAct", "LinearAct"} & set(ops)
    assert all(c.desc.dtype.torch != torch.float32 or c.desc.rank < 2 for c in q.graph.constants
               if c.desc.rank == 4), "fp32 conv weights were left in the graph"
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = m(x)
    y = q(x)
    assert _cos(y, ref) >= 0.999
    assert (y - ref).abs().max().item() <= 0.05 * ref.abs().max().item()
    y2 = q(x)                           # a second call: same bits, its own tensor
    assert torch.equal(y, y2) and y.data_ptr() != y2.data_ptr()
    y2.fill_(0)
    assert torch.equal(q(x), y)
    rows = quant_report(q)
    assert sum(r["int8"] for r in rows) == 5
    assert all("scale_d=" in r["detail"] for r in rows if r["int8"])


def test_requantized_layers_match_the_unfused_graph_within_one_step():
    """fuse_requant (uint8 written by the layer at its reader's scale) against the same
    model with the pass off (fp32 out, then AscendQuant): the int8 readers see values at
    most one uint8 step apart, so the outputs agree closely; fewer nodes run."""
    m = _model()
    on = opencann.quantize(m, _cal())
    off = opencann.quantize(m, _cal(), options={"disable": ["fuse_requant"]})
    assert off.report.op_counts_after["AscendQuant"] == 5 and on.report.op_counts_after["AscendQuant"] == 2
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(9))
    a, b = on(x), off(x)
    assert a.dtype == torch.float32 and _cos(a, b) >= 0.9999
    with torch.no_grad():
        assert _cos(a, m(x)) >= 0.999


class Blocks(torch.nn.Module):
    """A stem conv, two identity residual blocks (conv-ReLU, conv + x, ReLU), a head conv:
    ResNet's residual chain, where the block outputs can stay uint8."""

    def __init__(self, c=8, cin=3):
        super().__init__()
        self.stem = torch.nn.Conv2d(cin, c, 3, padding=1)
        self.convs = torch.nn.ModuleList(torch.nn.Conv2d(c, c, 3, padding=1) for _ in range(4))
        self.head = torch.nn.Conv2d(c, 4, 1)

    def forward(self, x):
        y = torch.relu(self.stem(x))
        for i in (0, 2):
            y = torch.relu(self.convs[i + 1](torch.relu(self.convs[i](y))) + y)
        return self.head(y).mean((2, 3))


def test_residual_chain_stays_uint8():
    """fuse_requant on a residual chain: each block's sum is written uint8 into the uint8
    addend (oneDNN's sum post-op with an int8 accumulator), so only the model input is
    quantized by an AscendQuant; results close to the unfused graph and to eager."""
    torch.manual_seed(5)
    m = Blocks().eval()
    cal = [torch.randn(2, 3, 12, 12) for _ in range(3)]
    on = opencann.quantize(m, cal)
    off = opencann.quantize(m, cal, options={"disable": ["fuse_requant"]})
    ops = on.report.op_counts_after
    assert ops.get("QuantConvAddAct") == 2 and ops.get("AscendQuant") == 1, ops
    adds = [n for n in on.graph.nodes if n.op == "QuantConvAddAct"]
    assert all(n.outputs[0].desc.dtype.torch == torch.uint8 and n.inputs[n.attrs["other"].index].desc.dtype.torch
               == torch.uint8 for n in adds)
    x = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(2))
    a, b = on(x), off(x)
    assert _cos(a, b) >= 0.999 and torch.equal(on(x), a)
    with torch.no_grad():
        assert _cos(a, m(x)) >= 0.998
    x[0, 0, 1, 1] = float("nan")
    assert torch.isfinite(on(x)).all()     # saturated at the input's quantization


def test_uint8_residual_sums_run_in_place_with_the_same_bits(monkeypatch):
    """Each identity block's uint8 sum is written in place into its uint8 addend (nothing
    reads the addend after it): the same bits as the sum into a per-call copy (the
    placement before the fix), over two calls and fresh random inputs, and the caller's
    input is left unchanged."""
    from opencann.passes.fusion import conv_add_act
    torch.manual_seed(6)
    m = Blocks().eval()
    cal = [torch.randn(2, 3, 12, 12) for _ in range(3)]
    on = opencann.quantize(m, cal)
    adds = [n for n in on.graph.nodes if n.op == "QuantConvAddAct"]
    assert len(adds) == 2 and all(n.attrs["inplace"] is True for n in adds)
    monkeypatch.setattr(conv_add_act, "_why_not_in_place", lambda *a, **k: "forced out of place")
    copy = opencann.quantize(m, cal)
    assert all(n.attrs["inplace"] is False for n in copy.graph.nodes if n.op == "QuantConvAddAct")
    g = torch.Generator().manual_seed(4)
    for _ in range(2):
        x = torch.randn(2, 3, 12, 12, generator=g) * 2
        x0 = x.clone()
        a = on(x)
        assert torch.equal(a, copy(x)) and torch.equal(x, x0)
        with torch.no_grad():
            assert _cos(a, m(x)) >= 0.998


class DownBlock(torch.nn.Module):
    """ResNet's stage-first block: conv-ReLU, conv + downsample(x) (a strided 1x1 conv
    read by the sum alone), ReLU; then an identity block and a head conv."""

    def __init__(self, c=8):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, c, 3, padding=1)
        self.a, self.b = torch.nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), torch.nn.Conv2d(2 * c, 2 * c, 3, padding=1)
        self.down = torch.nn.Conv2d(c, 2 * c, 1, stride=2)
        self.tail = Blocks(2 * c, cin=2 * c)

    def forward(self, x):
        y = torch.relu(self.stem(x))
        y = torch.relu(self.b(torch.relu(self.a(y))) + self.down(y))
        return self.tail(y)


def test_downsample_addend_is_calibrated_and_stays_uint8():
    """The downsample output has no int8 reader: calibration records its range ("accum")
    and fuse_requant quantizes it there, so the downsample convolution writes uint8 and
    every residual sum runs on uint8 (one AscendQuant: the model input)."""
    torch.manual_seed(8)
    m = DownBlock().eval()
    cal = [torch.randn(1, 3, 16, 16) for _ in range(3)]
    on = opencann.quantize(m, cal)
    off = opencann.quantize(m, cal, options={"disable": ["fuse_requant"]})
    ops = on.report.op_counts_after
    assert ops.get("AscendQuant") == 1 and ops.get("QuantConvAddAct") == 3, ops
    assert all(n.outputs[0].desc.dtype.torch == torch.uint8 for n in on.graph.nodes
               if n.op.startswith("QuantConv") and n.scope != "tail.head")
    x = torch.randn(1, 3, 16, 16)
    assert _cos(on(x), off(x)) >= 0.999
    with torch.no_grad():
        assert _cos(on(x), m(x)) >= 0.998


def test_uint8_layers_survive_the_model_file(tmp_path):
    """uint8 outputs, a uint8 addend and QuantMaxPool are saved and loaded: same bits."""
    torch.manual_seed(6)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                            Blocks(8, cin=8)).eval()
    cal = [torch.randn(1, 3, 24, 24) for _ in range(2)]
    q = opencann.quantize(m, cal)
    ops = q.report.op_counts_after
    assert ops.get("QuantMaxPool") == 1 and ops.get("QuantConvAddAct") == 2, ops
    path = str(tmp_path / "u8.ocm")
    opencann.save(q, path)
    x = torch.randn(1, 3, 24, 24)
    assert torch.equal(opencann.load(path)(x), q(x))


def test_maxpool_between_int8_layers_runs_on_uint8():
    """conv-ReLU → MaxPool → conv (ResNet's stem): the pool runs on uint8 (QuantMaxPool,
    planes over 255 elements, where ATen's uint8 max_pool2d refuses) and equals the
    graph with fuse_requant off within int8 rounding."""
    torch.manual_seed(4)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                            torch.nn.MaxPool2d(3, 2, 1), torch.nn.Conv2d(8, 4, 3)).eval()
    cal = [torch.randn(1, 3, 40, 40) for _ in range(2)]
    on = opencann.quantize(m, cal)
    off = opencann.quantize(m, cal, options={"disable": ["fuse_requant"]})
    ops = on.report.op_counts_after
    assert ops.get("QuantMaxPool") == 1 and ops.get("AscendQuant") == 1 and "MaxPool" not in ops
    x = torch.randn(1, 3, 40, 40)
    a, b = on(x), off(x)
    assert _cos(a, b) >= 0.9999 and torch.equal(on(x), a)
    with torch.no_grad():
        assert _cos(a, m(x)) >= 0.999


def test_quant_linear_kernel_is_exact_int8_arithmetic():
    """QuantLinearAct's result equals the fp32 GEMM of the dequantized operands (integer
    products are exact; only the fp32 rescale rounds)."""
    torch.manual_seed(3)
    lin = torch.nn.Linear(32, 24).eval()
    x = torch.randn(5, 32)
    q = opencann.quantize(lin, [x])
    rec = next(r for r in quant_report(q) if r["int8"])
    assert "static" in rec["detail"]
    step, off = dynamic_params(x)     # the calibration of one batch spans x's own range
    xq = quantize_u8(x, step, off)
    wq, ws = quantize_weight(lin.weight.t(), 1, int8_weight_qmax())   # the range the pass takes here
    ref = torch.nn.functional.linear((xq.float() - off) * step, (wq.float() * ws).t(), lin.bias)
    torch.testing.assert_close(q(x), ref, rtol=1e-5, atol=1e-5)


def test_skip_layers_keep_fp32_with_reason():
    m = _model()
    q = opencann.quantize(m, _cal(2), config=create_quant_config(skip_layers=["fc2", "stem.0"]))
    ops = q.report.op_counts_after
    assert ops.get("LinearAct") == 1 and ops.get("ConvBiasAct") == 1
    assert ops.get("QuantLinearAct") == 1 and ops.get("QuantConvBiasAct") == 1
    kept = [r for r in quant_report(q) if not r["int8"]]
    assert len(kept) == 2 and all("skip_layers" in r["reason"] for r in kept)


@pytest.mark.parametrize("keep, layers", [(["convolution_2", "addmm"], {"convolution_2_1_add_relu", "addmm_gelu"}),
                                          (["convolution"], {"convolution_relu"})])
def test_keep_dtype_keeps_fused_layers_out_of_int8(keep, layers):
    """keep_dtype names pre-fusion nodes (CANN's --keep_dtype): the fused layer standing for
    one (a ConvAddAct, a LinearAct with GELU) stays fp32, with its reason; the others are int8."""
    m = _model()
    q = opencann.quantize(m, _cal(2), options={"keep_dtype": keep})
    rows = quant_report(q)
    kept = {r["layer"]: r["reason"] for r in rows if not r["int8"]}
    assert set(kept) == layers and all("keep_dtype" in why for why in kept.values())
    assert len(rows) - len(kept) == 5 - len(layers)
    x = _cal(1)[0]
    with torch.no_grad():
        ref = m(x)
    first = q(x)
    assert _cos(first, ref) >= 0.999 and torch.equal(q(x), first)


def test_dynamic_linears_only():
    m = _model()
    q = opencann.quantize(m, _cal(1), config=create_quant_config(mode="dynamic"))
    ops = q.report.op_counts_after
    assert ops.get("QuantLinearAct") == 2 and "AscendQuant" not in ops and ops.get("ConvBiasAct") == 2
    x = _cal(1)[0] * 3
    with torch.no_grad():
        ref = m(x)
    assert _cos(q(x), ref) >= 0.999


def test_model_file_round_trip(tmp_path):
    m = _model()
    q = opencann.quantize(m, _cal(2))
    x = torch.randn(2, 3, 16, 16)
    path = str(tmp_path / "q.ocm")
    opencann.save(q, path)
    loaded = opencann.load(path)
    assert torch.equal(loaded(x), q(x))
    assert [r["detail"] for r in quant_report(loaded) if r["int8"]] == \
        [r["detail"] for r in quant_report(q) if r["int8"]]


def test_quantize_saturates_nan_and_inf():
    """AscendQuant: round half to even, then saturate; NaN → 0 (uint8's minimum, as ONNX
    Runtime), +inf → 255, -inf → 0."""
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, 1000.0, -1000.0, float("nan"), float("inf"), float("-inf")])
    assert quantize_u8(x, 1.0, 10).tolist() == [10, 12, 12, 10, 255, 0, 0, 255, 0]
    nchw = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    assert quantize_u8(nchw, 0.1, 128).is_contiguous(memory_format=torch.channels_last)


def test_nan_input_gives_finite_saturated_output():
    """A NaN in the input is quantized (to 0's level), not propagated: documented behaviour."""
    m = _model()
    q = opencann.quantize(m, _cal(2))
    x = torch.randn(2, 3, 16, 16)
    x[0, 0, 3, 3] = float("nan")
    x[1, 1, 5, 5] = float("inf")
    y = q(x)
    assert torch.isfinite(y).all()
    with torch.no_grad():
        assert not torch.isfinite(m(x)).all()   # eager propagates them


def test_calibration_ignores_non_finite_values():
    lin = torch.nn.Linear(8, 4).eval()
    x = torch.randn(3, 8)
    bad = x.clone()
    bad[0, 0] = float("inf")
    a, b = opencann.quantize(lin, [x]), opencann.quantize(lin, [bad])
    assert [r["detail"] for r in quant_report(a)] == [r["detail"] for r in quant_report(b)]


def test_errors_are_one_line():
    lin = torch.nn.Linear(8, 4).eval()
    with pytest.raises(ValueError, match="calibration_inputs is empty"):
        opencann.quantize(lin, [])
    with pytest.raises(ValueError, match="mode 'weird'"):
        create_quant_config(mode="weird")
    with pytest.raises(ValueError, match="skip_layers takes a list"):
        create_quant_config(skip_layers="fc")
    with pytest.raises(ValueError, match="option 'quant_config'"):
        opencann.compile(lin, torch.randn(2, 8), options={"quant_config": {"layers": {"a": {"scale_d": -1}}}})
    with pytest.raises(ValueError, match=r"calibration batch #1 is float32\[3, 8\] but batch #0 is float32\[2, 8\]"):
        opencann.quantize(lin, [torch.randn(2, 8), torch.randn(3, 8)])
    with pytest.raises(ValueError, match="calibration saw no finite value"):
        opencann.quantize(lin, [torch.full((2, 8), float("nan")), torch.full((2, 8), float("inf"))])
    with pytest.raises(ValueError, match="lowers layers to fp16/bf16"):
        opencann.quantize(lin, [torch.randn(2, 8)], options={"precision_mode": "allow_mix_precision"})
    x = [torch.randn(2, 8)]
    for kw, match in ((dict(options="allow_mix_precision_bf16"), "options must be a dict"),
                      (dict(options={"precision_mode": "bogus"}), "unknown precision_mode 'bogus'"),
                      (dict(config={"mode": "bogus"}), "config: mode 'bogus' is not one of"),
                      (dict(config={"mode": "static", "activation": "kl"}), "activation 'kl'"),
                      (dict(config={"mode": "static", "skip_layers": 5}), r"config\['skip_layers'\] takes a list of layer names"),
                      (dict(config={"mode": "static", "skip": ["fc"]}), r"unknown key\(s\) \['skip'\]"),
                      (dict(config={"mode": "static", "dynamic_linear": "yes"}), r"config\['dynamic_linear'\] takes True or False"),
                      (dict(config="static"), "config must come from")):
        with pytest.raises(ValueError, match=match) as e:
            opencann.quantize(lin, x, **kw)
        assert "\n" not in str(e.value)
    assert create_quant_config(skip_layers=None)["skip_layers"] == []


def test_a_hand_written_config_is_completed_as_create_quant_config_makes_it():
    """``{"mode": "dynamic"}`` without ``dynamic_linear`` quantizes the linears (as
    create_quant_config(mode="dynamic") does); a config of a few keys takes the defaults."""
    lin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    x = [torch.randn(2, 8)]
    for cfg in ({"mode": "dynamic"}, {"mode": "static"}):
        rows = quant_report(opencann.quantize(lin, x, config=cfg))
        assert len(rows) == 2 and all(r["int8"] for r in rows), (cfg, rows)


def test_pass_says_why_it_did_not_apply():
    lin = torch.nn.Linear(8, 4).eval()
    cm = opencann.compile(lin, torch.randn(2, 8), options={"quant_config": {"layers": {}}})
    assert cm.report.op_counts_after.get("LinearAct") == 1
    skip = [s for s in cm.report.skipped if s["pass"] == "quantize_int8"]
    assert skip and "no calibration record" in skip[0]["reason"]


class _Unquantized(torch.nn.Module):
    """Layers the int8 rewrite does not take: Conv1d, ConvTranspose2d, Conv3d, and a
    batched matmul with a constant operand; one Conv2d that it does."""

    def __init__(self):
        super().__init__()
        self.c1, self.ct = torch.nn.Conv1d(4, 8, 3), torch.nn.ConvTranspose2d(8, 4, 2)
        self.c3, self.c2 = torch.nn.Conv3d(4, 4, 1), torch.nn.Conv2d(4, 4, 3, padding=1)
        self.w = torch.nn.Parameter(torch.randn(3, 4, 5))

    def forward(self, x):
        y = self.c1(x)                                              # [B, 8, L]
        z = self.c2(self.ct(y.unsqueeze(-1)))                       # [B, 4, L + 1, 2]
        z = self.c3(z.unsqueeze(2)).squeeze(2)
        return torch.bmm(z.flatten(2)[:3, :, :4].transpose(1, 2), self.w)


def test_every_layer_left_in_float_has_a_report_row():
    torch.manual_seed(0)
    m = _Unquantized().eval()
    cal = [torch.randn(3, 4, 10, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    q = opencann.quantize(m, cal)
    rows = {r["where"].split(" ")[0]: r for r in quant_report(q)}
    assert rows["c2"]["int8"]
    for name, kind in (("c1", "1-D convolution"), ("ct", "transposed convolution"), ("c3", "3-D convolution")):
        assert not rows[name]["int8"] and kind in rows[name]["reason"], rows[name]
    assert any(not r["int8"] and "BatchMatMul with a constant operand" in r["reason"] for r in rows.values())
    x = torch.randn(3, 4, 10)
    assert _cos(q(x), m(x)) > 0.999


@pytest.mark.parametrize("dynamic", [False, True])
def test_fp32_emulation_agrees_with_the_onednn_kernels(monkeypatch, dynamic):
    """Where oneDNN's uint8 x int8 products are not exact for a layer's weight (x86 without
    VNNI: int16 saturation beyond |w| = 64), the int8 ops run their arithmetic in fp32
    (`int8_emulated`); where they are exact (VNNI, or 7-bit weights without it) both agree
    to fp32 rounding on the same weights, uint8 residual chains and all, and both stay
    close to eager on inputs of full 8-bit range (the saturation case)."""
    import opencann.ops.kernels.int8_cpu as int8_cpu
    from opencann.devices.cpu import int8_weight_bound
    m, cal = _model(), [c * 3 for c in _cal()]
    cfg = create_quant_config(mode="dynamic") if dynamic else None
    native = opencann.quantize(m, cal, config=cfg)
    monkeypatch.setattr(int8_cpu, "int8_weight_bound", lambda: None)   # the kernels only: same weights
    emulated = opencann.quantize(m, cal, config=cfg)
    for seed in (7, 8):
        x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(seed)) * 3
        with torch.no_grad():
            ref = m(x)
        y = emulated(x)
        assert _cos(y, ref) >= 0.999
        if int8_weight_bound() is not None:
            torch.testing.assert_close(y, native(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_range_below_float32_normals_keeps_its_levels(dynamic):
    """Activations of magnitude ~1e-38 (range / 255 below float32's smallest normal): the
    step is floored at 2**-126 (`uint8_params`), so x · (1 / step) stays finite and the
    layer computes what its record says (a float64 recomputation of the integer arithmetic);
    a step of ~1e-40 made 1 / step overflow float32, every value saturated and the result
    was cosine 0.78 with eager's (no warning)."""
    import warnings
    from opencann.ops.kernels.int8_quantize import MIN_STEP
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(16, 8, bias=False).eval()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(8, 16, generator=g) * 1e36)
    x = torch.randn(4, 16, generator=g) * 1e-38
    cfg = create_quant_config(mode="dynamic") if dynamic else None
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)       # no overflow in a cast
        q = opencann.quantize(lin, [x], config=cfg)
        y = q(x)
    step, off = dynamic_params(x)
    assert step == MIN_STEP
    if not dynamic:
        assert "scale_d=1.175e-38" in quant_report(q)[0]["detail"]
    xq = (torch.clamp(torch.round(x.double() / step) + off, 0, 255) - off) * step
    wq, ws = quantize_weight(lin.weight, 0, int8_weight_qmax())
    ref = xq @ (wq.double() * ws.double()[:, None]).t()
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-6 * float(ref.abs().max()))
    with torch.no_grad():
        assert _cos(y, lin(x)) > 0.85 and torch.isfinite(y).all()


def test_calibration_of_only_zeros_is_a_warning_naming_the_layers(caplog):
    """A layer whose calibration saw only zeros (an empty range: scale_d 1) quantizes every
    later input under 0.5 to 0: one WARNING line names it and the fix; real data gives none."""
    import logging
    m = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4)).eval()
    with caplog.at_level(logging.WARNING, logger="opencann"):
        q = opencann.quantize(m, [torch.zeros(2, 8)])
    lines = [r.getMessage() for r in caplog.records if "only zeros" in r.getMessage()]
    assert len(lines) == 1 and "1 layer(s) (addmm_relu)" in lines[0] and "skip_layers" in lines[0], lines
    with torch.no_grad():
        torch.testing.assert_close(q(torch.zeros(2, 8)), m(torch.zeros(2, 8)), rtol=0, atol=1e-2)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="opencann"):
        opencann.quantize(m, [torch.randn(2, 8)])
        opencann.quantize(m, [torch.zeros(2, 8)], config=create_quant_config(skip_layers=["0"]))
    assert not [r for r in caplog.records if "only zeros" in r.getMessage()]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_a_float64_or_float16_model_is_kept_with_its_dtype_named(dtype):
    """int8 quantizes fp32 (and bf16) layers: those of a float64 / float16 model stay in
    their dtype, each row saying so and how to quantize them (was: "not a Linear's weight")."""
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                            torch.nn.Linear(4 * 6 * 6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).eval().to(dtype)
    x = torch.randn(2, 3, 8, 8, dtype=dtype)
    q = opencann.quantize(m, [x])
    rows = quant_report(q)
    assert len(rows) == 3 and all(not r["int8"] and f"a {str(dtype)[6:]} layer" in r["reason"]
                                  and "model.float()" in r["reason"] for r in rows), rows
    with torch.no_grad():
        torch.testing.assert_close(q(x), m(x))


def test_a_record_with_a_denormal_scale_is_one_error_line_naming_the_layer():
    """A hand-written ``quant_config`` record whose scale_d is under 2**-126 (its reciprocal
    overflows float32: every value saturated, results off by the output's size) is a bad
    record: one ValueError line naming the layer, the field and the floor (every bad record
    raises: tests/unit/test_quant_records_and_candidates.py), not a layer kept fp32."""
    lin, x = torch.nn.Linear(8, 4).eval(), torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"^option 'quant_config': layer 'addmm_none': scale_d = 1e-45; "
                                         r"give a finite float >= 2\*\*-126") as e:
        opencann.compile(lin, x, options={"quant_config": {"layers": {"addmm_none": {"scale_d": 1e-45, "offset_d": 0}}}})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_a_one_row_example_under_dynamic_shapes_names_the_calibration_batch(mode):
    """Under ``dynamic_shapes`` the largest calibration batch is the compiled example: when
    export refuses it (a dynamic dim of size 1), the one line says that batch is the example
    (the caller passed no example); two rows compile and serve one."""
    m = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4)).eval()
    cfg = create_quant_config(mode=mode)
    with pytest.raises(ValueError, match=r"^with dynamic_shapes the largest calibration batch is the compiled "
                                         r"example \(float32\[1, 8\]\): .*at least 2") as e:
        opencann.quantize(m, [torch.randn(1, 8)], config=cfg, dynamic_shapes={"input": {0: "b"}})
    assert "\n" not in str(e.value)
    g = torch.Generator().manual_seed(4)
    cal = [torch.randn(1, 8, generator=g), torch.randn(2, 8, generator=g)]
    q = opencann.quantize(m, cal, config=cfg, dynamic_shapes={"input": {0: "b"}})
    x = cal[0]     # a row inside the calibrated range
    with torch.no_grad():
        assert _cos(q(x), m(x)) > 0.99
