"""The call-time guards (`opencann.engine.guards`): which guards a compiled model gets
(only those it needs), and that each still raises its one-line error."""
import pytest
import torch

import opencann
from opencann.engine.guards import (BakedValues, Call, FrozenWeights, InputTensors,
                                    UnrecordedWrites, WeightChanged)
from opencann.runtime.weight_watch import WeightWatch


class _Scale(torch.nn.Module):
    """A linear layer and a plain attribute read in forward."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.scale = 2.0

    def forward(self, x):
        return self.lin(x) * self.scale


class _Plain(torch.nn.Module):
    """No parameters, no plain attribute but ``training``."""

    def forward(self, x, k: int):
        return x * k


class _Writes(torch.nn.Module):
    def forward(self, x, y):
        x.add_(1)
        return x * y


class _AsksLayout(torch.nn.Module):
    def forward(self, x):
        return x * 2 if x.is_contiguous() else x * 3


def _names(cm):
    return [g.name for g in cm.guards]


def _error(fn, *args):
    with pytest.raises(ValueError) as e:
        fn(*args)
    return str(e.value)


def test_a_module_with_weights_gets_the_weight_guards_and_no_others():
    m = _Scale().eval()
    x = torch.randn(2, 4)
    cm = opencann.compile(m, (x,))
    assert _names(cm) == ["frozen_weights", "autocast_state", "unrecorded_writes",
                          "module_attributes", "input_tensors"]
    torch.testing.assert_close(cm(x), m(x).detach())
    torch.testing.assert_close(cm(x), m(x).detach())          # a second call


def test_no_weight_guards_without_weights_and_baked_values_only_when_baked():
    x = torch.randn(3)
    cm = opencann.compile(_Plain().eval(), (x, 3))
    names = _names(cm)
    assert names[0] == "baked_values"
    assert "frozen_weights" not in names and "unrecorded_writes" not in names
    assert "input_overlap" not in names and "input_layout" not in names
    assert torch.equal(cm(x, 3), x * 3)
    msg = _error(cm, x, 4)
    assert msg.startswith("non-tensor input 'k' (argument #1) was 3 when the model was "
                          "compiled and is 4 now")


def test_the_overlap_guard_only_for_a_model_that_writes_an_input():
    x, y = torch.randn(4), torch.randn(4)
    cm = opencann.compile(_Writes().eval(), (x.clone(), y))
    assert "input_overlap" in _names(cm)
    a = torch.randn(4)
    msg = _error(cm, a, a)
    assert "are the same tensor, and the model writes into" in msg
    want = a.clone().add_(1) * y
    got = cm(a, y)
    torch.testing.assert_close(got, want)
    assert "input_overlap" not in _names(opencann.compile(_Scale().eval(), (torch.randn(2, 4),)))


def test_the_layout_guard_only_when_the_model_reads_a_layout():
    x = torch.randn(4, 4)
    cm = opencann.compile(_AsksLayout().eval(), (x,))
    assert _names(cm)[-1] == "input_layout"
    msg = _error(cm, x.t())
    assert "reads its memory layout" in msg and "has strides (1, 4)" in msg
    torch.testing.assert_close(cm(x), x * 2)


def test_each_guard_raises_its_error():
    m = _Scale().eval()
    x = torch.randn(2, 4)
    cm = opencann.compile(m, (x,))
    assert "the shape differs" in _error(cm, torch.randn(3, 4))
    assert "the dtype differs" in _error(cm, x.double())
    assert "requires grad" in _error(cm, x.clone().requires_grad_())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "called inside autocast(cpu, bfloat16)" in _error(cm, x)
    m.scale = 3.0
    assert _error(cm, x).startswith("module attribute 'scale' was 2.0 when the model was "
                                    "compiled and is 3.0 now")
    m.scale = 2.0
    m.lin.bias.data.copy_(torch.randn(3))          # not counted in _version
    assert "modified in place after compiling (without a version bump" in _error(cm, x)
    cm = opencann.compile(m, (x,))
    with torch.no_grad():
        m.lin.weight.mul_(2)
    assert _error(cm, x).startswith("parameter or buffer 'lin.weight' was modified in place "
                                    "after compiling")


def test_guard_classes_on_their_own():
    label = lambda i: f"input {i}"  # noqa: E731
    with pytest.raises(ValueError, match="non-tensor input input 0 was 1.0"):
        BakedValues({0: 1.0}, label).check(Call([-0.0 + 2], []))
    BakedValues({0: float("nan")}, label).check(Call([float("nan")], []))
    w = torch.randn(5)
    frozen = FrozenWeights([("w", w)])
    frozen.check(Call([], []))
    assert frozen.holds((w,)) and not frozen.holds((w.clone(),))
    w.add_(1)
    assert not frozen.holds((w,))
    assert frozen.changes((w,)) == {0: "was modified in place (version 0 -> 1)"}
    with pytest.raises(ValueError, match="'w' was modified in place after compiling"):
        frozen.check(Call([], []))
    v = torch.randn(4)
    writes = UnrecordedWrites(WeightWatch([v], ["v"]))
    writes.check(Call([], []))
    v.data[0] += 1
    assert writes.changed()
    with pytest.raises(ValueError, match="'v' was modified in place after compiling"):
        writes.check(Call([], []))

    class _Desc:
        shape, dtype = (2, 3), type("D", (), {"torch": torch.float32, "value": "float32"})()
    inp = type("V", (), {"desc": _Desc(), "name": "x"})()
    guard = InputTensors([inp], label, lambda d: "float32[2, 3]")
    guard.check(Call([], [torch.randn(2, 3)]))
    with pytest.raises(ValueError, match=r"expected 1 tensor inputs, got 2"):
        guard.check(Call([], [torch.randn(2, 3)] * 2))
    with pytest.raises(ValueError, match=r"input 0 is on meta"):
        guard.check(Call([], [torch.empty(2, 3, device="meta")]))
    with pytest.raises(ValueError, match=r"input 0 must be a tensor, got int"):
        guard.check(Call([], [3]))


def test_weight_guards_say_what_a_share_weights_model_holds():
    """With the option share_weights the weights are not a snapshot: the message says the
    packed copies are stale; the error is a WeightChanged carrying the name and how."""
    lin = torch.nn.Linear(8, 4).eval()
    x = torch.randn(3, 8)
    cm = opencann.compile(lin, (x,), options={"share_weights": True})
    torch.testing.assert_close(cm(x), lin(x))
    with torch.no_grad():
        lin.weight.mul_(2)
    with pytest.raises(WeightChanged, match=r"^parameter or buffer 'weight' was modified in place "
                       r"after compiling: the compiled model reads the module's weight memory "
                       r"\(option share_weights\) but its packed .* Recompile after changing "
                       r"weights$") as e:
        cm(x)
    assert (e.value.name, e.value.how, e.value.shared) == ("weight", "was modified in place", True)
    w = torch.randn(5)
    guard = FrozenWeights([("w", w)])
    w.add_(1)
    with pytest.raises(WeightChanged, match="'w' was modified in place after compiling: the "
                       "compiled model holds a snapshot of the weights"):
        guard.check(Call([], []))


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x, cache):
        cache.add_(1.0)               # an input written in place (as a KV cache)
        return x @ self.w + cache


def test_call_unguarded_equals_a_guarded_call_and_plain_forms_only():
    m = _Scaled().eval()
    x, cache = torch.randn(2, 8), torch.randn(2, 8)
    cm = opencann.compile(m, (x, cache.clone()))
    c1, c2 = cache.clone(), cache.clone()
    for _ in range(2):                # a second call: the cache written again, in place
        x = torch.randn(2, 8)
        want = cm(x, c1)
        got = cm.call_unguarded(x, c2)
        assert torch.equal(got, want) and torch.equal(c1, c2)
    with torch.no_grad():
        ref = x @ m.w + c1
    torch.testing.assert_close(got, ref)
    with torch.no_grad():
        m.w.mul_(2.0)
    with pytest.raises(WeightChanged):
        cm(x, c1)                     # the guarded call sees the change
    with pytest.raises(ValueError, match="unexpected positional"):
        cm.call_unguarded(x, c2, 1)   # not the plain form: bound and checked as a call
