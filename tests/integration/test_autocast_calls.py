"""Autocast around compiling and calling: a model compiled and called inside the same
autocast follows eager; another autocast state at call time (live, dynamic or loaded
model, old files without the state) is one error naming both states and the fix;
torch.compile follows autocast per call."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import opencann
from helpers import assert_close


# == B7-3 / B7-4: autocast ==================================================================
# opencann.compile's graph is captured once; torch.autocast around a call (B7-3) is neither
# followed nor refused: the outputs keep the graph's float32 where eager's are bfloat16
# (and some fused kernels still dispatch through autocast, so the dtype depends on which
# kernel ran). A model compiled inside autocast (B7-4) keeps autocast's casts when called
# outside it. Either eager's dtypes and values, or one clear error naming autocast.

class _MM(nn.Module):
    def forward(self, a, b):
        return (a @ b).exp().sum(-1), torch.bmm(a.unsqueeze(0), b.unsqueeze(0))


def _eager_or_clear_error(call, ref, tol):
    try:
        got = call()
    except Exception as e:  # noqa: BLE001 - a refusal is fine if it says why in one line
        assert "autocast" in str(e) and len(str(e).splitlines()) == 1, str(e)
        return
    assert_close(got, ref, strides=False, signed_zeros=True, rtol=tol, atol=tol)


def test_call_under_autocast_follows_eager_or_refuses():
    m = _MM()
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with torch.no_grad():
        cm = opencann.compile(m, (a, b))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = m(a, b)
            _eager_or_clear_error(lambda: cm(a, b), ref, 2e-2)


def test_compiled_under_autocast_called_outside_follows_eager_or_refuses():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    x = torch.randn(3, 8)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cm = opencann.compile(m, (x,))
        _eager_or_clear_error(lambda: cm(x), m(x), 1e-5)


def _autocast_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4), nn.Softmax(-1)).eval()


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_compiled_and_called_inside_the_same_autocast_follows_eager():
    m, x = _autocast_mlp(), torch.randn(3, 8)
    with torch.no_grad(), _bf16():
        cm = opencann.compile(m, (x,))
        ref = m(x)
        assert_close(cm(x), ref, strides=True, signed_zeros=True, rtol=2e-2, atol=2e-2)
        assert_close(cm(x), ref, strides=True, signed_zeros=True, rtol=2e-2, atol=2e-2)
    assert any("captured inside autocast(cpu, bfloat16)" in n for n in cm.report.notes)


def _refuses(call, compiled, called):
    with pytest.raises(ValueError) as e:
        call()
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and "torch.compile(model, backend='opencann')" in msg
    assert msg.startswith(f"compiled {compiled}; called {called}:"), msg


def test_compiled_under_one_autocast_dtype_called_under_another_refuses():
    m, x = _autocast_mlp(), torch.randn(3, 8)
    with torch.no_grad():
        with _bf16():
            cm = opencann.compile(m, (x,))
        with torch.autocast("cpu", dtype=torch.float16):
            _refuses(lambda: cm(x), "inside autocast(cpu, bfloat16)", "inside autocast(cpu, float16)")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
            _refuses(lambda: cm(x), "inside autocast(cpu, bfloat16)", "outside torch.autocast")


def test_dynamic_model_called_under_autocast_refuses():
    m, x = _autocast_mlp(), torch.randn(3, 8)
    with torch.no_grad():
        cm = opencann.compile(m, (x,), dynamic_shapes=({0: torch.export.Dim("n", min=2, max=8)},))
        with _bf16():
            _refuses(lambda: cm(torch.randn(5, 8)), "outside torch.autocast",
                     "inside autocast(cpu, bfloat16)")
        assert_close(cm(x), m(x), strides=True, signed_zeros=True)


@pytest.mark.parametrize("inside", [False, True], ids=["compiled_outside", "compiled_inside"])
def test_loaded_model_keeps_the_autocast_state_of_its_compile(tmp_path, inside):
    m, x = _autocast_mlp(), torch.randn(3, 8)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=inside):
            cm = opencann.compile(m, (x,))
            opencann.save(cm, tmp_path / "m.ocm")
            lm = opencann.load(tmp_path / "m.ocm")
            assert_close(lm(x), cm(x), strides=True, signed_zeros=True, rtol=0, atol=0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not inside):
            _refuses(lambda: lm(x), "inside autocast(cpu, bfloat16)" if inside
                     else "outside torch.autocast", "outside torch.autocast" if inside
                     else "inside autocast(cpu, bfloat16)")


def test_model_file_compiled_outside_autocast_refuses_calls_inside(tmp_path):
    # files written before the state was recorded: tests/integration/test_model_file_formats.py
    m, x = _autocast_mlp(), torch.randn(3, 8)
    with torch.no_grad():
        cm = opencann.compile(m, (x,))
        assert cm.graph.signature.autocast is None
        opencann.save(cm, tmp_path / "m.ocm")
        lm = opencann.load(tmp_path / "m.ocm")
        assert_close(lm(x), m(x), strides=True, signed_zeros=True)
        with _bf16():
            _refuses(lambda: lm(x), "outside torch.autocast", "inside autocast(cpu, bfloat16)")


def test_torch_compile_follows_autocast_per_call():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    x = torch.randn(3, 8)
    tm = torch.compile(m, backend="opencann")
    with torch.no_grad():
        assert_close(tm(x), m(x), strides=True, signed_zeros=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert_close(tm(x), m(x), strides=False, signed_zeros=True, rtol=2e-2, atol=2e-2)
        assert_close(tm(x), m(x), strides=True, signed_zeros=True)
