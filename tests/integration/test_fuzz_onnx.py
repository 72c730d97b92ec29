"""``opencann fuzz --backend onnx``: random ONNX graphs checked against ONNX Runtime."""
from __future__ import annotations

import pytest

pytest.importorskip("onnxruntime")


from opencann.tools import fuzz_onnx  # noqa: E402


def test_generation_is_deterministic_and_valid():
    a, b = fuzz_onnx.generate_onnx(7), fuzz_onnx.generate_onnx(7)
    assert a[0].SerializeToString() == b[0].SerializeToString()
    assert (a[1]["x"].tobytes() == b[1]["x"].tobytes())
    import onnx
    onnx.checker.check_model(a[0])


def test_short_campaign_finds_nothing():
    res = fuzz_onnx.run_onnx_fuzz(cases=6, seed=0)
    assert res.cases + res.skipped == 6 and res.cases >= 5
    assert res.failures == [], res.summary()


def test_a_wrong_converter_is_caught(monkeypatch):
    """A converter that gives a wrong value (Relu as Neg) is reported as a 'values' failure."""
    from opencann.frontend.onnx import convert, nn  # noqa: F401
    import torch

    def wrong(cv, n):
        return [cv.call(torch.ops.aten.neg.default, n.x(0))]
    monkeypatch.setitem(convert.CONVERTERS, "Relu", wrong)
    model, feeds, _ = fuzz_onnx.generate_onnx(1, ops=["Relu"])
    assert [n.op_type for n in model.graph.node][0] == "Relu"
    checks = {c for c, _ in fuzz_onnx.check_onnx(model, feeds)}
    assert checks & {"values", "nan"}


def test_unknown_op_is_one_clear_error():
    with pytest.raises(ValueError, match="unknown ONNX fuzz op"):
        fuzz_onnx.generate_onnx(0, ops=["NoSuchOp"])


def test_cli_backend_onnx(capsys):
    from opencann.cli import main
    assert main(["fuzz", "--backend", "onnx", "--cases", "2", "--seed", "3"]) == 0
    assert "graphs vs ONNX Runtime, 0 failing" in capsys.readouterr().out
