"""fast_call: a kernel is bound to torch's public function only where that function was
seen to dispatch to exactly the node's overload; results stay eager's."""
import torch

import opencann
from opencann.runtime import fast_call

aten = torch.ops.aten


def test_public_function_only_when_it_reaches_the_same_overload():
    x, out = torch.randn(4), torch.empty(4)
    assert fast_call.fast_callable(aten.add.out, [x, 0.5], {"out": out}) is torch.add
    assert fast_call.fast_callable(aten.tanh.out, [x], {"out": out}) is torch.tanh
    # view has no torch.* function: the Tensor method is the candidate
    assert fast_call.fast_callable(aten.view.default, [x, [2, 2]], {}) is torch._C.TensorBase.view
    # torch.relu takes no out=: the overload stays
    assert fast_call.fast_callable(aten.relu.out, [x], {"out": out}) is aten.relu.out
    # creation ops (no tensor argument) keep their overload
    assert fast_call.fast_callable(aten.full.default, [[2], 1.0], {}) is aten.full.default


def test_disabled_binds_overloads():
    x, out = torch.randn(4), torch.empty(4)
    fast_call.ENABLED = False
    try:
        assert fast_call.fast_callable(aten.add.out, [x, 0.5], {"out": out}) is aten.add.out
    finally:
        fast_call.ENABLED = True


class _Mix(torch.nn.Module):
    def forward(self, x, y, i):
        a = (x + 2) * y - 1          # int and float scalars, tensor operands
        b = torch.tanh(a).view(2, -1).transpose(0, 1).sum(0)
        c = (i * 3 + 1) // 2          # integer ops: floor division, int scalars
        return b, torch.where(a > 0, a, x.nan_to_num()), c


def test_compiled_results_are_eager_values_nan_and_second_call():
    x = torch.randn(6)
    x[1] = float("nan")
    y, i = torch.randn(6), torch.arange(6)
    m = _Mix()
    cm = opencann.compile(m, (x, y, i))
    bound = [v for k, v in cm.executor._glb.items() if k.startswith("K")]
    assert any(not isinstance(k, torch._ops.OpOverload) for k in bound)
    for args in ((x, y, i), (torch.randn(6), torch.randn(6), torch.arange(6) * 5)):
        for got, want in zip(cm(*args), m(*args)):
            torch.testing.assert_close(got, want, equal_nan=True)
