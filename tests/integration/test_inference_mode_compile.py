"""``opencann.compile`` / ``opencann.load`` and a dynamic model's first call at a new shape
under ``torch.inference_mode()``: what the compiled model keeps (weight copies, arenas,
memory plans) is made of ordinary tensors, so it gives eager's values inside and outside
inference_mode afterwards and the module stays trainable. They used to fail inside
("Inference tensors do not track version counter"), or leave arenas that every later
call outside refused ("Inplace update to inference tensor outside InferenceMode")."""
import torch
from torch import nn

import opencann
from helpers import assert_close


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64)).eval()


def _x(rows, seed):
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed))
    x[0, 3] = float("nan")
    x[-1, 5] = float("inf")
    return x


def _trains(m):
    m.zero_grad()
    m(_x(4, 9).nan_to_num(0.0, 1.0, -1.0)).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


def _check(cm, m, rows, seed):
    x = _x(rows, seed)
    with torch.no_grad():
        assert_close(cm(x), m(x))


def test_compile_inside_inference_mode_then_calls_in_either_mode():
    m = _model()
    with torch.inference_mode():
        cm = opencann.compile(m, (_x(8, 1),))
        _check(cm, m, 8, 2)
    _check(cm, m, 8, 3)
    assert not any(p.is_inference() for p in m.parameters())
    _trains(m)


def test_load_inside_inference_mode_then_calls_outside(tmp_path):
    m = _model()
    opencann.save(opencann.compile(m, (_x(8, 1),)), str(tmp_path / "m.ocm"))
    with torch.inference_mode():
        cm = opencann.load(str(tmp_path / "m.ocm"))
        _check(cm, m, 8, 2)
    _check(cm, m, 8, 3)


def test_a_dynamic_shape_first_planned_inside_inference_mode_serves_outside():
    m = _model()
    cm = opencann.compile(m, (_x(8, 1),), dynamic_shapes={"input": {0: "rows"}},
                          dim_ranges={"rows": (2, 32)})
    with torch.inference_mode():
        _check(cm, m, 5, 2)      # a new shape: its memory plan and arena made here
    _check(cm, m, 5, 3)
    _check(cm, m, 8, 4)
