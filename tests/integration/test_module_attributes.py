"""Python attributes of the module that forward reads (a float, a flag, ``training``, a
submodule's attribute), changed after opencann.compile: eager's values or one error
naming the attribute and the fix (static and dynamic models); torch.compile follows."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import opencann
from helpers import assert_close


def _x(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) + 0.5
    flat = x.view(-1)
    flat[1] = float("nan")
    if flat.numel() > 5:
        flat[3], flat[5] = float("inf"), -0.0
    return x


# == B7-9: Python attributes of the module changed after opencann.compile are ignored ======
# A non-tensor *argument* with another value than at compile time is one clear error, and so
# is a weight written in place; a plain attribute that forward reads (a temperature, a flag,
# the `training` mode) keeps its compile-time value without a word.

class _Attrs(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale, self.negate = 2.0, False
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        y = self.drop(x * self.scale)
        return -y if self.negate else y


_ATTR_CHANGES = {
    "float_attribute": lambda m: setattr(m, "scale", 3.0),
    "bool_attribute": lambda m: setattr(m, "negate", True),
}
# changes eager follows too, where only a refusal is right for a compiled graph
_REFUSED_CHANGES = {
    "train_mode": lambda m: m.train(),
    "submodule_attribute": lambda m: setattr(m.drop, "p", 0.25),
    "deleted_attribute": lambda m: delattr(m, "negate"),
}


@pytest.mark.parametrize("change", sorted(_ATTR_CHANGES) + sorted(_REFUSED_CHANGES))
def test_module_attribute_changed_after_compile_follows_eager_or_refuses(change):
    m = _Attrs().eval()
    x = _x(3, 4)
    cm = opencann.compile(m, (x,))
    assert_close(cm(x), m(x), strides=True, signed_zeros=True)
    {**_ATTR_CHANGES, **_REFUSED_CHANGES}[change](m)
    if change in _REFUSED_CHANGES:
        with pytest.raises(ValueError, match="recompile"):
            cm(x)
        return
    try:
        with torch.no_grad():
            got = cm(x)
    except Exception as e:  # noqa: BLE001 - a refusal must say what changed, in one line
        assert len(str(e).splitlines()) == 1 and "recompile" in str(e).lower(), str(e)
        assert any(a in str(e) for a in ("scale", "negate", "training", "drop.p")), str(e)
        return
    with torch.no_grad():
        assert_close(got, m(x), strides=True, signed_zeros=True)


def test_torch_compile_follows_module_attributes():
    m = _Attrs().eval()
    x = _x(3, 4)
    tm = torch.compile(m, backend="opencann")
    with torch.no_grad():
        assert_close(tm(x), m(x), strides=True, signed_zeros=True)
        for change in _ATTR_CHANGES.values():
            change(m)
            assert_close(tm(x), m(x), strides=True, signed_zeros=True)


def test_module_attribute_restored_is_accepted_again_and_nan_attributes_are_stable():
    m = _Attrs().eval()
    m.scale = float("nan")          # a NaN attribute equals its own snapshot (identity)
    x = _x(3, 4)
    cm = opencann.compile(m, (x,))
    cm(x)
    m.scale = 2.0
    with pytest.raises(ValueError, match="'scale' was nan"):
        cm(x)
    m2 = _Attrs().eval()
    cm2 = opencann.compile(m2, (x,))
    m2.negate = True
    with pytest.raises(ValueError, match="negate"):
        cm2(x)
    m2.negate = False               # back to the compiled value: calls run again
    with torch.no_grad():
        assert_close(cm2(x), m2(x), strides=True, signed_zeros=True)


def test_dynamic_model_refuses_a_changed_attribute_too():
    m = _Attrs().eval()
    cm = opencann.compile(m, (_x(3, 4),), dynamic_shapes={"x": {0: "batch"}},
                          dim_ranges={"batch": (1, 8)})
    m.scale = 5.0
    with pytest.raises(ValueError, match="'scale' was 2.0"):
        cm(_x(5, 4))
