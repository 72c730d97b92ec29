"""``opencann run`` and ``opencann bench`` run what the CLI builds (issue #29 item 5): ``.ocm``
model files (random inputs of the recorded shapes, on the device they were compiled for;
a dynamic model's dims from ``--input-shape``), ONNX files (``--input-shape`` for symbolic
dims, ONNX Runtime as the reference), ``--device``; each prints what it ran on, and bad
input is one line."""
from __future__ import annotations

import pytest
import torch

import opencann
from helpers import run_cli
from opencann.tools.run_inputs import call_args, input_specs, random_inputs, same_outputs

FACTORY = '''
import torch

class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x)) * 2

def make():
    torch.manual_seed(0)
    return M().eval(), (torch.randn(2, 3, 8, 8),)
'''


def _one_error(argv, capsys, *needles):
    rc, _, err = run_cli(argv, capsys)
    assert rc == 2 and len(err) == 1, (rc, err)
    for n in needles:
        assert n in err[0], err[0]


@pytest.fixture(scope="module")
def ocm(tmp_path_factory):
    """conv.ocm (a Conv+ReLU factory model compiled for cpu, static [2, 3, 8, 8]), the
    factory file and its eager model."""
    d = tmp_path_factory.mktemp("run")
    (d / "f.py").write_text(FACTORY)
    ns: dict = {}
    exec(FACTORY, ns)
    model, ex = ns["make"]()
    opencann.save(opencann.compile(model, ex), str(d / "conv.ocm"))
    return d, model


def test_run_and_bench_an_ocm_file(ocm, capsys, monkeypatch):
    d, _ = ocm
    monkeypatch.chdir(d)
    rc, out, err = run_cli(["run", "conv.ocm", "--trace", "t.json"], capsys)
    assert rc == 0, err
    assert "ran conv.ocm on cpu, random inputs x float32[2,3,8,8]: outputs float32[2,4,8,8]; " \
           "all finite; a second call gives the same outputs" in out
    assert (d / "t.json").exists() and "ConvBiasAct" in out
    rc, out, err = run_cli(["bench", "conv.ocm", "--runs", "2", "--threads", "1"], capsys)
    assert rc == 0, err
    assert "conv.ocm on cpu, random inputs x float32[2,3,8,8]: opencann " in out
    assert "median of 2, 1 threads" in out


def test_ocm_inputs_reach_the_model_as_compiled(tmp_path):
    """The random inputs (recorded shapes and dtypes, never all zeros) go through the saved
    calling convention, baked non-tensor arguments included: eager's result, NaN where
    eager has it; a second call equal and the first call's outputs untouched."""
    class M(torch.nn.Module):
        def forward(self, x, ids, scale: float):
            return torch.tanh(x) * scale + ids.float().sum()

    ex = (torch.randn(3, 5), torch.tensor([1, 0, 1]), 1.5)
    path = str(tmp_path / "m.ocm")
    opencann.save(opencann.compile(M().eval(), ex), path)
    cm = opencann.load(path)
    specs = input_specs(cm, None, "m.ocm")
    assert [(s, dt) for _, s, dt in specs] == [((3, 5), torch.float32), ((3,), torch.int64)]
    x, ids = random_inputs(specs)
    assert x.abs().sum() > 0 and set(ids.tolist()) <= {0, 1}
    x[0, 0] = float("nan")
    a, kw = call_args(cm, [x, ids])
    y = cm(*a, **kw)
    ref = M()(x, ids, 1.5)
    torch.testing.assert_close(y, ref, equal_nan=True)
    y_before = y.clone()
    x2, ids2 = random_inputs(specs, seed=1)
    a2, kw2 = call_args(cm, [x2, ids2])
    torch.testing.assert_close(cm(*a2, **kw2), M()(x2, ids2, 1.5))
    assert same_outputs(y, y_before)


def test_device_and_input_shape_errors_are_one_line(ocm, capsys, monkeypatch):
    d, _ = ocm
    monkeypatch.chdir(d)
    _one_error(["run", "conv.ocm", "--device", "vnpu:ascend910b"], capsys,
               "conv.ocm was compiled for cpu", "drop --device vnpu:ascend910b", "--soc_version")
    _one_error(["run", "conv.ocm", "--input-shape", "x:3,3,8,8"], capsys,
               "dim 0 is fixed at 2 in conv.ocm, got 3: give x:2,3,8,8")
    _one_error(["bench", "conv.ocm", "--input_shape", "y:2,3,8,8"], capsys,
               "names ['y'], not inputs of conv.ocm; its inputs: x:2,3,8,8")
    _one_error(["run", "conv.ocm", "--input-shape", "x:2,3,8"], capsys, "gives x 3 dims but it has 4")
    _one_error(["run", "conv.ocm", "--input-shape", "x:-1,3,8,8"], capsys, "--input-shape", "has -1")
    _one_error(["run", "f.py:make", "--input-shape", "x:2,3,8,8"], capsys,
               "--input-shape is for .onnx and .ocm models")
    _one_error(["run", "nothere.ocm"], capsys, "nothere.ocm: no such model file")
    _one_error(["compile", "conv.ocm"], capsys, "is a compiled model file", "opencann run")
    _one_error(["run", "f.py:make", "--device", "tpu"], capsys, "device 'tpu'", "cpu", "vnpu")


def test_run_a_factory_on_the_vnpu(ocm, capsys, monkeypatch):
    d, _ = ocm
    monkeypatch.chdir(d)
    rc, out, err = run_cli(["run", "f.py:make", "--device", "vnpu:ascend910b"], capsys)
    assert rc == 0, err
    assert "ran make on vnpu:ascend910b, its example inputs: max |compiled - eager| = " in out


@pytest.fixture
def onnx_files(tmp_path, monkeypatch):
    """m.onnx (static [2, 4]) and dyn.onnx (symbolic batch n): x -> Relu(x), Sign(x)."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper
    monkeypatch.chdir(tmp_path)
    for name, dims in (("m.onnx", [2, 4]), ("dyn.onnx", ["n", 4])):
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
        outs = [helper.make_tensor_value_info(y, TensorProto.FLOAT, dims) for y in ("y", "z")]
        g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"]),
                               helper.make_node("Sign", ["x"], ["z"])], "g", [x], outs)
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), name)
    return tmp_path


def test_onnx_run_with_input_shape_and_bench(onnx_files, capsys):
    pytest.importorskip("onnxruntime")
    rc, out, err = run_cli(["run", "dyn.onnx", "--input-shape", "x:3,4"], capsys)
    assert rc == 0, err
    assert "ran dyn.onnx on cpu, random inputs x float32[3,4]: max |compiled - onnxruntime| = " \
           "0.00e+00" in out
    rc, out, err = run_cli(["bench", "m.onnx", "--runs", "2", "--threads", "1"], capsys)
    assert rc == 0, err
    assert "m.onnx on cpu, random inputs x float32[2,4]: onnxruntime " in out
    assert "opencann/onnxruntime" in out
    _one_error(["bench", "dyn.onnx"], capsys, "input x has symbolic dims", "--input-shape x:1,4")
    _one_error(["run", "dyn.onnx", "--input-shape", "y:3,4"], capsys, "'y'")
