"""``opencann atc`` with ATC's shape-profile flags (issue #29 item 5): --dynamic_batch_size,
--dynamic_image_size, --dynamic_dims and --input_format mapped onto opencann's gears, the
.ocm they write checked against eager at every gear and between gears, run through
``opencann run --input-shape``; each of ATC's rules broken gives one line."""
from __future__ import annotations

import pytest
import torch

import opencann
from helpers import run_cli

FACTORIES = '''
import torch

class Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x)) * 2

def conv():
    torch.manual_seed(0)
    return Conv().eval(), (torch.randn(2, 3, 8, 8),)

class Text(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, ids, mask):
        return torch.tanh(self.lin(self.emb(ids))) * mask[..., None]

def text():
    torch.manual_seed(0)
    return Text().eval(), (torch.randint(0, 10, (1, 6)), torch.ones(1, 6))
'''


def _one_error(argv, capsys, *needles):
    rc, _, err = run_cli(argv, capsys)
    assert rc == 2 and len(err) == 1, (rc, err)
    for n in needles:
        assert n in err[0], err[0]


@pytest.fixture
def factories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "f.py").write_text(FACTORIES)
    ns: dict = {}
    exec(FACTORIES, ns)
    return tmp_path, ns


def test_dynamic_batch_size(factories, capsys):
    d, ns = factories
    rc, out, err = run_cli(["atc", "--model", "f.py:conv", "--output", "b",
                         "--input_shape", "x:-1,3,8,8", "--dynamic_batch_size", "1,2,4"], capsys)
    assert rc == 0, err
    assert "gears dynamic_batch_size=[1, 2, 4] over batch" in out
    cm = opencann.load("b.ocm")
    assert cm.report.dynamic["gears"]["values"] == [[1], [2], [4]]
    model, _ = ns["conv"]()
    for n in (1, 2, 3, 4):   # 3: served by the batch-4 gear, padded
        x = torch.randn(n, 3, 8, 8)
        x[0, 0, 0, 0] = float("nan")
        with torch.no_grad():
            torch.testing.assert_close(cm(x), model(x), equal_nan=True, rtol=1e-4, atol=1e-5)
    rc, out, err = run_cli(["run", "b.ocm", "--input-shape", "x:4,3,8,8"], capsys)
    assert rc == 0, err
    assert "ran b.ocm on cpu, random inputs x float32[4,3,8,8]: outputs float32[4,4,8,8]" in out
    _one_error(["run", "b.ocm", "--input-shape", "x:5,3,8,8"], capsys,
               "batch=5 is not one of the gears compiled with dynamic_batch_size=[1, 2, 4]")


def test_dynamic_image_size(factories, capsys):
    d, ns = factories
    rc, out, err = run_cli(["atc", "--model", "f.py:conv", "--output", "i", "--input_format", "nchw",
                         "--input_shape", "x:2,3,-1,-1", "--dynamic_image_size", "8,8;16,12"],
                        capsys)
    assert rc == 0, err
    assert "gears dynamic_image_size=[[8, 8], [16, 12]] over height, width" in out
    cm = opencann.load("i.ocm")
    model, _ = ns["conv"]()
    for hw in ((8, 8), (16, 12)):
        x = torch.randn(2, 3, *hw)
        with torch.no_grad():
            torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-5)


def test_dynamic_dims_two_inputs_one_dim(factories, capsys):
    """ids and mask each have a -1; their values agree in every gear, so they are one
    dim (torch.export sees the two equal)."""
    d, ns = factories
    rc, out, err = run_cli(["atc", "--model", "f.py:text", "--output", "t", "--input_format", "ND",
                         "--input_shape", "ids:1,-1;mask:1,-1", "--dynamic_dims", "4,4;6,6;12,12"],
                        capsys)
    assert rc == 0, err
    assert "gears dynamic_dims=[4, 6, 12] over dim0" in out
    cm = opencann.load("t.ocm")
    model, _ = ns["text"]()
    for s in (4, 6, 12):
        ids, mask = torch.randint(0, 10, (1, s)), torch.rand(1, s)
        with torch.no_grad():
            torch.testing.assert_close(cm(ids, mask), model(ids, mask), rtol=1e-4, atol=1e-5)
    rc, out, err = run_cli(["run", "t.ocm", "--input-shape", "ids:1,12"], capsys)
    assert rc == 0, err
    assert "random inputs ids int64[1,12], mask float32[1,12]" in out


def test_gear_mapping_of_dynamic_dims():
    from opencann.tools.atc_gears import check_profile, gear_options
    gears = [(1, 16, 16), (2, 32, 32)]
    spec = check_profile("dynamic_dims", gears, {"a": (-1, -1), "b": (-1,)}, "ND")
    assert spec == {"a": {0: "dim0", 1: "dim1"}, "b": {0: "dim1"}}
    assert gear_options("dynamic_dims", gears, spec) == {"dynamic_dims": [[1, 16], [2, 32]]}


CONV = ["atc", "--model", "f.py:conv", "--output", "m"]


@pytest.mark.parametrize("extra,needles", [
    (["--input_shape", "x:-1,3,8,8"], ["has -1 at dim 0", "--dynamic_batch_size"]),
    (["--dynamic_batch_size", "1,2"], ["needs --input_shape with -1", "x:-1,3,224,224"]),
    (["--input_shape", "x:2,3,8,8", "--dynamic_batch_size", "1,2"], ["needs --input_shape with -1"]),
    (["--input_shape", "x:2,-1,8,8", "--dynamic_batch_size", "1,2"],
     ["fills dim 0 (N) only", "x:2,-1,8,8", "--dynamic_dims"]),
    (["--input_shape", "x:2,3,-1,8", "--dynamic_image_size", "8,8;16,16"],
     ["fills H and W (dims 2 and 3 of NCHW)", "at dim(s) [2]"]),
    (["--input_shape", "x:2,3,-1,-1", "--dynamic_image_size", "8,8;16,16", "--input_format", "NHWC"],
     ["dims 1 and 2 of NHWC"]),
    (["--input_shape", "x:2,3,-1,-1", "--dynamic_image_size", "8,8;16,16", "--input_format", "ND"],
     ["--input_format is ND: give NCHW or NHWC"]),
    (["--input_shape", "x:2,3,-1,-1", "--dynamic_dims", "8;16"],
     ["1 value(s) per gear but --input_shape has 2 -1(s) (x dim 2, x dim 3)"]),
    (["--input_shape", "x:2,3,-1,-1", "--dynamic_dims", "8,8;16,16", "--input_format", "NCHW"],
     ["ND-format gears", "--input_format ND"]),
    (["--input_shape", "x:-1,3,8,8", "--dynamic_batch_size", "4"], ["has 1 gear(s); ATC takes 2 to 100"]),
    (["--input_shape", "x:-1,3,8,8", "--dynamic_batch_size", ",".join(map(str, range(1, 102)))],
     ["has 101 gear(s)"]),
    (["--input_shape", "x:-1,3,8,8", "--dynamic_batch_size", "1,2,2"], ["gear(s) [2] twice"]),
    (["--input_shape", "x:-1,3,8,8", "--dynamic_batch_size", "1,0"], ["at least 1"]),
    (["--input_shape", "x:2,3,-1,-1", "--dynamic_image_size", "8,8;16"], ["every gear takes 2 value(s)"]),
    (["--input_shape", "x:-1,3,8,8", "--dynamic_batch_size", "1,2", "--dynamic_dims", "1;2"],
     ["not allowed with argument --dynamic_batch_size"]),
    (["--input_format", "NC1HWC0"], ["unknown input_format 'NC1HWC0'", "NCHW, NHWC, ND"]),
    (["--input_shape", "x:-1,4,8,8", "--dynamic_batch_size", "1,2"],
     ["x:-1,4,8,8 does not match the example input x:2,3,8,8"]),
    (["--input_shape", "y:-1,3,8,8", "--dynamic_batch_size", "1,2"],
     ["'y', not a tensor input of the model; its inputs: x:2,3,8,8"]),
    (["--input_shape", "x:1~4,3,8,8"], ["shape ranges", "dim_ranges"]),
])
def test_atc_profile_rules_are_one_line(extra, needles, factories, capsys):
    _one_error(CONV + extra, capsys, *needles)


def test_gears_on_an_onnx_model_are_one_line(tmp_path, capsys):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    path = str(tmp_path / "r.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    _one_error(["atc", "--model", path, "--output", str(tmp_path / "r"), "--input_shape",
                "x:-1,4", "--dynamic_batch_size", "1,2"], capsys,
               "--dynamic_batch_size with an ONNX model", "--framework pytorch")


def test_gears_for_the_vnpu(factories, capsys):
    """--soc_version Ascend910B with gears: each gear compiled for the vnpu, saved, run
    there (a bare ``--device vnpu`` names the same chip). Unset, --precision_mode is CANN
    ATC's default for an NPU, force_fp16 (fp16 tolerance of eager, fp32 outputs);
    must_keep_origin_dtype keeps fp32 tolerance."""
    d, ns = factories
    model, _ = ns["conv"]()
    for mode, tol in ((None, 2e-2), ("must_keep_origin_dtype", 1e-4)):
        rc, out, err = run_cli(["atc", "--model", "f.py:conv", "--output", "v", "--soc_version",
                                "Ascend910B2", "--input_shape", "x:-1,3,8,8", "--dynamic_batch_size",
                                "1,2"] + (["--precision_mode", mode] if mode else []), capsys)
        assert rc == 0, err
        cm = opencann.load("v.ocm")
        for n in (1, 2):
            x = torch.randn(n, 3, 8, 8)
            with torch.no_grad():
                got, want = cm(x), model(x)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            if mode is None:
                assert not torch.equal(got, want)   # really computed in fp16
    rc, out, err = run_cli(["run", "v.ocm", "--device", "vnpu", "--input-shape", "x:1,3,8,8"], capsys)
    assert rc == 0, err
    assert "ran v.ocm on vnpu:ascend910b, random inputs x float32[1,3,8,8]" in out
    _one_error(["run", "v.ocm", "--device", "vnpu:ascend310"], capsys, "compiled for vnpu:ascend910b")
