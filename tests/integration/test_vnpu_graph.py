"""vnpu as a compile target: NPU formats, TransData insertion/elimination, numerics
against the CPU compile, and `estimate` (costs, fusion traffic, HBM check, roofline)."""
import pytest
import torch

import opencann
from opencann.ir import Format
from opencann.tools.estimate import estimate

DEV = "vnpu:ascend910b"


def _rel(a, b) -> float:
    """max|a-b| / max|ref|"""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _outs(o):
    return o.to_tuple() if hasattr(o, "to_tuple") else (o if isinstance(o, tuple) else (o,))


def _formats(cm):
    return {v.desc.format for n in cm.graph.nodes for v in n.outputs} | \
        {c.desc.format for c in cm.graph.constants}


def _resnet(depths=None, size=64):
    from transformers import ResNetConfig, ResNetModel
    torch.manual_seed(0)
    cfg = ResNetConfig() if depths is None else ResNetConfig(depths=depths)
    m = ResNetModel(cfg).eval()
    x = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(1))
    return m, x


@pytest.mark.full   # make test: the unfolded-BN ResNet below, the vnpu fuzz campaign, test_vnpu_epilogue
def test_resnet50_vnpu_matches_cpu():
    m, x = _resnet()
    ref = opencann.compile(m, (x,))(x)
    cm = opencann.compile(m, (x,), device=DEV, options={"verify": True})
    out = cm(x)
    for a, b in zip(_outs(out), _outs(ref)):
        assert a.shape == b.shape
        assert _rel(a, b) < 1e-4
    counts = cm.graph.op_counts()
    assert counts.get("TransData", 0) >= 2          # in at the input, out at each output
    assert {Format.NC1HWC0, Format.FRACTAL_Z} <= _formats(cm)
    assert "ConvBiasAct" not in counts and "ConvAddAct" not in counts   # no oneDNN fusions on vnpu
    elim = [a for a in cm.report.applied if a["detail"] == "TransData elimination"]
    assert len(elim) > 0
    assert all(n.device == DEV for n in cm.graph.nodes)
    conv = next(n for n in cm.graph.nodes if n.op == "Conv2D")
    d = conv.outputs[0].desc
    assert d.format == Format.NC1HWC0 and len(d.shape) == 5 and len(d.origin_shape) == 4
    for v in cm.graph.outputs:                        # outputs come back in the origin format
        assert v.desc.format in (Format.ND, Format.NCHW)


def test_resnet_unfolded_batchnorm_runs_in_nc1hwc0():
    m, x = _resnet(depths=[1, 1, 1, 1], size=48)
    with torch.no_grad():
        ref = m(x)
    cm = opencann.compile(m, (x,), device=DEV, options={"disable": ["fold_batchnorm"]})
    bn = [n for n in cm.graph.nodes if n.op == "BatchNorm"]
    assert bn and all(n.outputs[0].desc.format == Format.NC1HWC0 for n in bn)
    for a, b in zip(_outs(cm(x)), _outs(ref)):
        assert _rel(a, b) < 1e-4


def test_bert_layer_vnpu_matches_cpu():
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    m = BertModel(BertConfig(num_hidden_layers=1, attn_implementation="sdpa")).eval()
    ids = torch.randint(0, 30000, (1, 32), generator=torch.Generator().manual_seed(1))
    ref = opencann.compile(m, (ids,))(ids)
    cm = opencann.compile(m, (ids,), device=DEV)
    for a, b in zip(_outs(cm(ids)), _outs(ref)):
        assert _rel(a, b) < 1e-4
    # 910B reads matmul operands in ND (issue 17): no FRACTAL_NZ, no TransData around MatMulV2
    mm = [n for n in cm.graph.nodes if n.op == "MatMulV2"]
    assert mm and all(n.outputs[0].desc.format == Format.ND for n in mm)
    assert not any(v.producer is not None and v.producer.op == "TransData" for n in mm for v in n.inputs)
    assert Format.FRACTAL_NZ not in _formats(cm)
    skipped = [s for s in cm.report.skipped if s["pass"] == "npu_layout"]
    assert all(s["reason"] for s in skipped)


@pytest.mark.full   # make test: test_vnpu_epilogue's small ResNet (fused < unfused HBM)
def test_estimate_resnet50_fusion_saves_hbm_and_plots(tmp_path):
    rep = estimate("resnet50", device=DEV, size=64)
    assert rep.hbm_bytes_fused < rep.hbm_bytes_unfused
    assert rep.total_time_us > 0 and rep.rows
    conv = [r for r in rep.rows if r.op == "Conv2D"]
    assert conv and all(r.flops > 0 and r.bound in ("cube", "memory", "mte", "launch") for r in conv)
    assert not rep.fallbacks
    text = rep.to_text()
    assert "Conv2D" in text and "HBM traffic" in text
    assert '"hbm_bytes_fused"' in rep.to_json()
    png = rep.roofline_plot(str(tmp_path / "roofline.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.full   # make test: the memory-fit findings of tests/integration/test_readiness.py
def test_estimate_oversized_batch_raises_with_numbers():
    with pytest.raises(ValueError, match=r"GiB too much.*smaller batch.*about \d+ fits") as e:
        estimate("resnet50", device="vnpu:ascend310", batch=2048, size=224)
    assert "ascend310" in str(e.value) and "8.00 GiB of HBM" in str(e.value)


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="known presets"):
        estimate("resnet50", device="vnpu:ascend999")
