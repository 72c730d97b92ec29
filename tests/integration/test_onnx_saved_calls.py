"""An ONNX model saved and loaded (`opencann.save` / `opencann.load`, `opencann atc`) is
called as the live one: inputs bound by their ONNX names whatever the keywords' order,
unknown / missing / repeated names refused in one line, no host-autocast guard; every
calling-convention field survives the file (ONNX Runtime is the reference)."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper  # noqa: E402

import opencann  # noqa: E402
from opencann.runtime import model_file  # noqa: E402


def _sub_model():
    """y = a - b (float32[2, 3]), z = b * c: three inputs, order matters."""
    g = helper.make_graph(
        [helper.make_node("Sub", ["a", "b"], ["y"]), helper.make_node("Mul", ["b", "c"], ["z"])],
        "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in "abc"],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in "yz"])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _inputs():
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(2, 3, generator=g) for n in "abc"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    m = _sub_model()
    live = opencann.compile(m)
    path = str(tmp_path_factory.mktemp("ocm") / "sub.ocm")
    opencann.save(live, path)
    feeds = {k: v.numpy() for k, v in _inputs().items()}
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    return live, opencann.load(path), ref


@pytest.mark.parametrize("which", ["live", "loaded"])
def test_keywords_bind_by_name_in_any_order(models, which):
    cm = models[0] if which == "live" else models[1]
    x = _inputs()
    a, b, c = x["a"], x["b"], x["c"]
    for call in (lambda: cm(a, b, c), lambda: cm(a=a, b=b, c=c), lambda: cm(c=c, b=b, a=a),
                 lambda: cm(a, c=c, b=b)):
        y, z = call()
        np.testing.assert_array_equal(y.numpy(), models[2][0])
        np.testing.assert_array_equal(z.numpy(), models[2][1])


@pytest.mark.parametrize("which", ["live", "loaded"])
@pytest.mark.parametrize("args, kwargs, problem", [
    ((), {"a": 0, "b": 0, "x": 0}, r"unknown input name\(s\) \['x'\]"),
    ((), {"x": 0, "y": 0, "z": 0}, r"unknown input name\(s\) \['x', 'y', 'z'\]"),
    ((0,), {"a": 0, "b": 0, "c": 0}, r"\['a'\] given both positionally and by name"),
    ((0,), {"c": 0}, r"\['b'\] missing"),
    ((0, 0, 0, 0), {}, "4 positional inputs for 3"),
])
def test_bad_names_are_one_line(models, which, args, kwargs, problem):
    cm = models[0] if which == "live" else models[1]
    t = torch.zeros(2, 3)
    args = tuple(t for _ in args)
    kwargs = {k: t for k in kwargs}
    with pytest.raises(ValueError, match=r"takes inputs \['a', 'b', 'c'\]") as e:
        cm(*args, **kwargs)
    assert "\n" not in str(e.value)
    assert re.search(problem, str(e.value))


def test_calling_convention_survives_the_file(models):
    live, loaded, _ = models
    want, got = live.calling_convention(), loaded.calling_convention()
    assert want["onnx_inputs"] == ["a", "b", "c"]
    assert got == want


def test_loaded_model_runs_under_host_autocast_as_the_live_one(models):
    """An ONNX graph has no capture autocast state: neither model checks the host's."""
    x = _inputs()
    with torch.autocast("cpu", torch.bfloat16):
        for cm in models[:2]:
            np.testing.assert_array_equal(cm(**x)[0].numpy(), models[2][0])


def test_file_without_onnx_inputs_binds_by_the_graph_signature(models, tmp_path, monkeypatch):
    """Files written before ``metadata`` held ``onnx_inputs`` keep the names in the graph
    signature (``input_names``): those bind calls."""
    real = model_file._metadata

    def old_metadata(*a, **k):
        meta = real(*a, **k)
        meta.pop("onnx_inputs")
        return meta

    monkeypatch.setattr(model_file, "_metadata", old_metadata)
    path = str(tmp_path / "old.ocm")
    opencann.save(models[0], path)
    monkeypatch.undo()
    cm = opencann.load(path)
    x = _inputs()
    np.testing.assert_array_equal(cm(c=x["c"], b=x["b"], a=x["a"])[0].numpy(), models[2][0])
    with pytest.raises(ValueError, match="unknown input name"):
        cm(x=x["a"], b=x["b"], c=x["c"])


def test_torch_model_file_has_no_onnx_inputs(tmp_path):
    """A torch model is bound by its forward's parameters: ``onnx_inputs`` stays None."""
    class M(torch.nn.Module):
        def forward(self, x, y):
            return x - y

    x, y = torch.randn(3), torch.randn(3)
    cm = opencann.compile(M(), (x, y))
    opencann.save(cm, str(tmp_path / "m.ocm"))
    loaded = opencann.load(str(tmp_path / "m.ocm"))
    assert loaded.calling_convention()["onnx_inputs"] is None
    torch.testing.assert_close(loaded(y=y, x=x), x - y, rtol=0, atol=0)
