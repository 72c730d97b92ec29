"""``opencann atc`` (ATC's flag names) and CANN's fusion switch file: ONNX and
file.py:factory models to .ocm files, loaded and compared with ONNX Runtime / eager;
--input_shape for symbolic dims; --soc_version to vnpu presets; fusion switch files
(CANN and opencann pass names, ALL, errors); --dump_graph per-stage files; bad flags."""
from __future__ import annotations

import json
import os

import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import opencann  # noqa: E402
from opencann.engine.options import read_fusion_switch  # noqa: E402
from opencann.runtime.model_file import describe  # noqa: E402
from helpers import run_cli


class ConvBnRelu(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        with torch.no_grad():   # non-trivial statistics so that folding matters
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-1, 1)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


@pytest.fixture(scope="module")
def conv_onnx(tmp_path_factory):
    """A Conv+BatchNormalization+Relu ONNX model (built with onnx.helper: the TorchScript
    exporter would fold the BN itself) with a symbolic batch dim, and its torch module."""
    from onnx import TensorProto, helper, numpy_helper
    torch.manual_seed(0)
    m = ConvBnRelu().eval()
    c, b = m.conv, m.bn
    inits = [numpy_helper.from_array(t.detach().numpy(), n) for n, t in (
        ("w", c.weight), ("cb", c.bias), ("g", b.weight), ("beta", b.bias),
        ("mean", b.running_mean), ("var", b.running_var))]
    g = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "cb"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("BatchNormalization", ["c", "g", "beta", "mean", "var"], ["n"],
                          epsilon=b.eps),
         helper.make_node("Relu", ["n"], ["y"])], "convbn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, 8, 8])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path = str(tmp_path_factory.mktemp("atc") / "conv.onnx")
    onnx.save(model, path)
    return path, m


def _one_error(argv, capsys, *needles):
    rc, _, err = run_cli(argv, capsys)
    assert rc == 2, (rc, err)
    assert len(err) == 1, err
    for n in needles:
        assert n in err[0], err[0]
    return err[0]


def _switch(tmp_path, doc, name="fs.json"):
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return str(p)


def test_atc_onnx_to_ocm_matches_ort_and_eager(conv_onnx, tmp_path, capsys):
    path, m = conv_onnx
    out = str(tmp_path / "m")
    rc, stdout, err = run_cli(["atc", "--model", path, "--framework", "5", "--output", out,
                            "--input_shape", "x:2,3,8,8", "--soc_version", "cpu"], capsys)
    assert rc == 0, err
    assert os.path.isfile(out + ".ocm") and "ATC run success" in stdout
    cm = opencann.load(out + ".ocm")
    x = torch.randn(2, 3, 8, 8)
    x[0, 0, 0, 0] = float("nan")
    y = cm(x)[0]
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    torch.testing.assert_close(y, torch.from_numpy(ref), rtol=1e-4, atol=1e-5, equal_nan=True)
    with torch.no_grad():
        torch.testing.assert_close(y, m(x), rtol=1e-4, atol=1e-5, equal_nan=True)
    x2 = torch.randn(2, 3, 8, 8)   # a second call: fresh values, first output untouched
    y_before = y.clone()
    y2 = cm(x2)[0]
    with torch.no_grad():
        torch.testing.assert_close(y2, m(x2), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y, y_before, equal_nan=True)
    assert tuple(y.shape) == (2, 8, 8, 8)


def test_symbolic_dim_needs_input_shape(conv_onnx, tmp_path, capsys):
    path, _ = conv_onnx
    _one_error(["atc", "--model", path, "--framework", "5", "--output", str(tmp_path / "m")],
               capsys, "batch")


def test_soc_version_maps_to_vnpu_device(conv_onnx, tmp_path, capsys):
    path, m = conv_onnx
    out = str(tmp_path / "npu.ocm")
    rc, _, err = run_cli(["atc", "--model", path, "--framework", "5", "--output", out,
                       "--input_shape", "x:1,3,8,8", "--soc_version", "Ascend910B2"], capsys)
    assert rc == 0, err
    assert not os.path.exists(out + ".ocm")   # .ocm given: not appended again
    assert describe(out)["metadata"]["device"] == "vnpu:ascend910b"
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():   # ATC's default for an NPU: force_fp16
        torch.testing.assert_close(opencann.load(out)(x)[0], m(x), rtol=2e-2, atol=2e-2)


def test_soc_version_mapping():
    from opencann.tools.atc import soc_version
    assert soc_version("cpu") == "cpu"
    assert soc_version("Ascend910B") == soc_version("Ascend910B4") == "vnpu:ascend910b"
    assert soc_version("Ascend910A") == soc_version("Ascend910") == "vnpu:ascend910"
    assert soc_version("Ascend310P3") == "vnpu:ascend310"


def test_fusion_switch_file_turns_conv_bn_fold_off(conv_onnx, tmp_path, capsys):
    path, m = conv_onnx
    for i, name in enumerate(("ConvBatchnormFusionPass", "fold_batchnorm")):
        fs = _switch(tmp_path, {"Switch": {"GraphFusion": {name: "off"}, "UBFusion": {}}})
        cm = opencann.compile(path, input_shapes={"x": (1, 3, 8, 8)},
                              options={"fusion_switch_file": fs})
        rec = {p.name: p for p in cm.report.passes}
        assert not rec["fold_batchnorm"].enabled and rec["fuse_conv_act"].enabled
        assert any("fold_batchnorm" in ln and "(disabled)" in ln
                   for ln in cm.report.to_text().splitlines())
        assert "BatchNorm" in " ".join(cm.report.op_counts_after)
        x = torch.randn(1, 3, 8, 8)
        with torch.no_grad():
            torch.testing.assert_close(cm(x)[0], m(x), rtol=1e-4, atol=1e-5)
    on = opencann.compile(path, input_shapes={"x": (1, 3, 8, 8)})
    assert {p.name: p for p in on.report.passes}["fold_batchnorm"].enabled
    assert not any("BatchNorm" in k for k in on.report.op_counts_after)
    # through atc: the summary line names the pass switched off
    rc, stdout, err = run_cli(["atc", "--model", path, "--output", str(tmp_path / "f"),
                            "--input_shape", "x:1,3,8,8", "--fusion_switch_file", fs], capsys)
    assert rc == 0, err
    assert "passes off: fold_batchnorm" in stdout


def test_fusion_switch_all_and_overrides(tmp_path):
    off, on = read_fusion_switch(_switch(tmp_path, {"Switch": {"UBFusion": {
        "ALL": "off", "fuse_conv_act": "on"}}}))
    assert "fuse_linear_act" in off and "fuse_conv_add_act" in off and "fuse_conv_act" in on
    assert "fuse_conv_act" not in off and "fold_batchnorm" not in off
    off, on = read_fusion_switch(_switch(tmp_path, {"Switch": {"GraphFusion": {"ALL": "off"}}}))
    assert off == ["fold_batchnorm", "fuse_silu", "fuse_gelu_tanh", "fuse_gelu_erf",
                   "fuse_rms_norm", "fuse_layer_norm", "fuse_gated_mlp", "fuse_qkv_linear",
                   "fuse_add_layer_norm_cast", "fuse_add_layer_norm", "fuse_add_rms_norm", "fuse_rotary_mul",
                   "fuse_decode_kv_update", "fuse_apply_rotary_pos_emb", "fuse_decode_rope"] and on == []
    # merged with the given disable list
    from opencann.engine.options import check_options
    o = check_options({"disable": ["cse"], "fusion_switch_file": _switch(
        tmp_path, {"Switch": {"GraphFusion": {"ConvBatchnormFusionPass": "off"}}})})
    assert o["disable"] == ["cse", "fold_batchnorm"] and "fusion_switch_file" not in o


#: CANN's names (its fusion pattern reference, fe's fusion_pass_name.h, msprof-analyze's
#: rules) -> the opencann pass each switches
CANN_NAMES = {"ConvBatchnormFusionPass": "fold_batchnorm", "LayerNormFusionPass": "fuse_layer_norm",
              "GeluFusionPass": "fuse_gelu_tanh", "TbeConv2DReluv2Pass": "fuse_conv_act",
              "TbeConvDoubleInFusionPass": "fuse_conv_add_act",
              "MatMulBiasAddFusionPass": "fuse_linear_act",
              "ATbeMatMulElemwiseFusionPass": "fuse_linear_act",
              "TbeEltwiseFusionPass": "fuse_elementwise", "AutomaticUbFusion": "fuse_elementwise",
              "FlashAttentionFusionPass": "fuse_flash_attention"}


@pytest.mark.parametrize("cann,ours", sorted(CANN_NAMES.items()))
def test_fusion_switch_cann_names(cann, ours, tmp_path):
    """Each CANN name switches its opencann equivalent off, and on (a pass off by default)."""
    for val, where in (("off", 0), ("on", 1)):
        got = read_fusion_switch(_switch(tmp_path, {"Switch": {"GraphFusion": {cann: val}}}))
        assert got[where] == [ours] and got[1 - where] == []


def test_unknown_cann_name_is_a_warning_not_a_failed_compile(conv_onnx, tmp_path, capsys, caplog):
    """A CANN pass without an opencann equivalent (CANN has hundreds) is one WARNING
    listing the known names; the other entries still apply and the compile succeeds."""
    import logging
    fs = _switch(tmp_path, {"Switch": {"GraphFusion": {"SoftmaxFusionPass": "off",
                                                        "ConvBatchnormFusionPass": "off"},
                                       "UBFusion": {"TbeConv3dElemwisePass": "on"}}})
    with caplog.at_level(logging.WARNING, logger="opencann"):
        rc, stdout, err = run_cli(["atc", "--model", conv_onnx[0], "--output", str(tmp_path / "w"),
                                "--input_shape", "x:1,3,8,8", "--fusion_switch_file", fs], capsys)
    assert rc == 0, err
    assert "passes off: fold_batchnorm" in stdout
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for name in ("GraphFusion.SoftmaxFusionPass", "UBFusion.TbeConv3dElemwisePass"):
        line = next(w for w in warned if name in w)
        assert "no opencann equivalent" in line and "\n" not in line
        assert all(c in line for c in CANN_NAMES), line
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(opencann.load(str(tmp_path / "w.ocm"))(x)[0], conv_onnx[1](x),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("doc,needle", [
    ({"Switch": {"GraphFusion": {"fold_batchnrom": "off"}}},
     "unknown pass 'fold_batchnrom' in GraphFusion; known: ALL, ATbeMatMulElemwiseFusionPass"),
    ({"Switch": {"GraphFusion": {"fold_batchnorm": "disabled"}}}, 'use "on" or "off"'),
    ({"Switch": {"OtherFusion": {}}}, "expected {\"Switch\""),
    ({"GraphFusion": {}}, "expected {\"Switch\""),
])
def test_fusion_switch_errors(doc, needle, tmp_path, conv_onnx, capsys):
    fs = _switch(tmp_path, doc)
    with pytest.raises(ValueError) as e:
        opencann.compile(conv_onnx[0], input_shapes={"x": (1, 3, 8, 8)},
                         options={"fusion_switch_file": fs})
    assert needle in str(e.value) and "\n" not in str(e.value)
    _one_error(["atc", "--model", conv_onnx[0], "--output", str(tmp_path / "m"),
                "--input_shape", "x:1,3,8,8", "--fusion_switch_file", fs], capsys, needle)


def test_fusion_switch_file_missing_or_not_json(tmp_path):
    with pytest.raises(ValueError, match="is not a file"):
        read_fusion_switch(str(tmp_path / "none.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{Switch")
    with pytest.raises(ValueError, match="not JSON"):
        read_fusion_switch(str(bad))


def test_dump_graph_writes_each_stage(conv_onnx, tmp_path, capsys):
    d = tmp_path / "dump"
    rc, _, err = run_cli(["atc", "--model", conv_onnx[0], "--output", str(tmp_path / "m"),
                       "--input_shape", "x:1,3,8,8", "--dump_graph", str(d)], capsys)
    assert rc == 0, err
    names = sorted(os.listdir(d))
    stems = sorted({n.rsplit(".", 1)[0] for n in names})
    assert stems[0] == "00_input" and any(s.endswith("_fusion") for s in stems)
    assert any(s.endswith("_schedule") for s in stems)
    assert all(s + ".dot" in names and s + ".json" in names for s in stems)
    first = json.loads((d / "00_input.json").read_text())
    ops0 = {n["op"] for n in first["nodes"]}
    assert any("BatchNorm" in o for o in ops0)
    fusion_json = json.loads((d / ([s for s in stems if s.endswith("_fusion")][0] + ".json")).read_text())
    assert not any("BatchNorm" in n["op"] for n in fusion_json["nodes"])
    assert (d / "00_input.dot").read_text().startswith("digraph")


def test_atc_pytorch_factory(tmp_path, capsys, monkeypatch):
    (tmp_path / "f.py").write_text(
        "import torch\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU()).eval(), "
        "(torch.randn(2, 4),)\n")
    monkeypatch.chdir(tmp_path)
    rc, _, err = run_cli(["atc", "--model", "f.py:make", "--framework", "pytorch",
                       "--output", "lin"], capsys)
    assert rc == 0, err
    import importlib.util
    spec = importlib.util.spec_from_file_location("f_user", tmp_path / "f.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model, (x,) = mod.make()
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(opencann.load("lin.ocm")(x), model(x))


@pytest.mark.parametrize("extra,needle", [
    (["--framework", "3"], "framework 3 (TensorFlow) is not supported"),
    (["--soc_version", "Ascend999"], "unknown soc_version 'Ascend999'"),
    (["--input_shape", "x=1,3"], "is not name:sizes"),
    (["--log", "loud"], "invalid choice: 'loud'"),
    (["--precision_mode", "fastest"], "unknown precision_mode 'fastest'"),
    (["--framework", "pytorch"], "--framework pytorch takes --model file.py:factory"),
])
def test_bad_flags_are_one_line(extra, needle, conv_onnx, tmp_path, capsys):
    _one_error(["atc", "--model", conv_onnx[0], "--output", str(tmp_path / "m"),
                "--input_shape", "x:1,3,8,8"] + extra, capsys, needle)


def test_bad_paths_are_one_line(conv_onnx, tmp_path, capsys):
    _one_error(["atc", "--model", str(tmp_path / "no.onnx"), "--output", str(tmp_path / "m")],
               capsys, "no such ONNX file")
    _one_error(["atc", "--model", conv_onnx[0], "--output", str(tmp_path / "nodir" / "m"),
                "--input_shape", "x:1,3,8,8"], capsys, "does not exist")
    _one_error(["atc", "--output", str(tmp_path / "m")], capsys, "--model")
