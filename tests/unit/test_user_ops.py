"""A user's op: an `OpDef` registered with its own kernels (``OpDef(kernels={"cpu": fn})``)
is run by the executor through that kernel, on the device it was given for; a kernel for
a device the model is not compiled for is not called; a kernel for an unknown device is
refused at registration with one clear line."""
import pytest
import torch

import opencann
from opencann.ops import OpDef, OpKind, get_op, register

G = torch.Generator().manual_seed(0)


@torch.library.custom_op("opencann_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return torch.tanh(x) * alpha


@scaled_tanh.register_fake
def _(x, alpha):
    return torch.empty_like(x)


@torch.library.custom_op("opencann_test::soft_shrink2", mutates_args=())
def soft_shrink2(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.softshrink(x, 0.5)


@soft_shrink2.register_fake
def _(x):
    return torch.empty_like(x)


CALLS = {"cpu": 0, "vnpu": 0}


def _counted_cpu(x, alpha):
    CALLS["cpu"] += 1
    return torch.tanh(x) * alpha


def _counted_vnpu(x):
    CALLS["vnpu"] += 1
    return torch.nn.functional.softshrink(x, 0.5)


register(OpDef("TestScaledTanh", OpKind.ELEMENTWISE, aten=torch.ops.opencann_test.scaled_tanh.default,
               kernels={"cpu": _counted_cpu}))
register(OpDef("TestSoftShrink2", OpKind.ELEMENTWISE, aten=torch.ops.opencann_test.soft_shrink2.default,
               kernels={"vnpu": _counted_vnpu}))


class ScaledTanh(torch.nn.Module):
    def forward(self, x):
        return torch.ops.opencann_test.scaled_tanh(x * 2.0, 0.5) + 1.0


class SoftShrink(torch.nn.Module):
    def forward(self, x):
        return torch.ops.opencann_test.soft_shrink2(x - 0.25) * 3.0


def _inputs(n):
    xs = []
    for _ in range(n):
        x = torch.randn(3, 5, generator=G)
        x[1, 2] = float("nan")
        xs.append(x)
    return xs


def test_user_cpu_kernel_is_called_once_per_call_and_matches_eager():
    m = ScaledTanh()
    cm = opencann.compile(m, (torch.randn(3, 5, generator=G),))
    assert "TestScaledTanh" in cm.graph.op_counts()
    CALLS["cpu"] = 0
    outs, kept = [], []
    for x in _inputs(3):
        out = cm(x)
        torch.testing.assert_close(out, m(x), equal_nan=True)
        assert torch.isnan(out[1, 2])
        outs.append(out)
        kept.append(out.clone())
    assert CALLS["cpu"] == 3
    for out, k in zip(outs, kept):                       # a later call leaves earlier outputs alone
        torch.testing.assert_close(out, k, equal_nan=True)


def test_user_kernel_for_another_device_is_not_called():
    """TestSoftShrink2 has a vnpu kernel only: a cpu compile runs the op's ATen overload;
    a vnpu compile runs the user's kernel (the node is placed on the vnpu)."""
    m = SoftShrink()
    x0 = torch.randn(3, 5, generator=G)
    cpu = opencann.compile(m, (x0,))
    vnpu = opencann.compile(m, (x0,), device="vnpu:ascend910b")
    CALLS["vnpu"] = 0
    for x in _inputs(2):
        torch.testing.assert_close(cpu(x), m(x), equal_nan=True)
    assert CALLS["vnpu"] == 0
    for x in _inputs(2):
        torch.testing.assert_close(vnpu(x), m(x), equal_nan=True)
    assert CALLS["vnpu"] == 2


def test_user_kernel_for_unknown_device_is_refused():
    with pytest.raises(ValueError, match=r"TestBad: kernels has device 'npu'; device kinds are "
                                         r"\['cpu', 'vnpu'\]"):
        register(OpDef("TestBad", OpKind.ELEMENTWISE, kernels={"npu": lambda x: x}))
    with pytest.raises(KeyError):
        get_op("TestBad")                                  # not half-registered


@torch.library.custom_op("opencann_test::triple", mutates_args=())
def _triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def test_refused_register_op_registers_nothing_and_can_be_retried():
    """A register_op refused for a bad column (a device key that is not a device kind,
    ``kernels`` not a dict) leaves no half-registration, not even the ``infer`` fake
    implementation; the corrected call then registers."""
    infer = lambda x: torch.empty_like(x)  # noqa: E731
    with pytest.raises(ValueError, match="kernels has device 'gpu'"):
        opencann.register_op("TestTriple", _triple, kernels={"gpu": lambda x: x * 3}, infer=infer)
    with pytest.raises(ValueError, match=r"^register_op: kernels is a str; give a dict"):
        opencann.register_op("TestTriple", _triple, kernels="cpu", infer=infer)
    with pytest.raises(KeyError):
        get_op("TestTriple")
    with pytest.raises(Exception):        # no fake implementation was registered
        _triple(torch.empty(3, device="meta"))
    opencann.register_op("TestTriple", _triple, kernels={"cpu": lambda x: x * 3}, infer=infer)
    assert _triple(torch.empty(3, device="meta")).shape == (3,)
    assert get_op("TestTriple").name == "TestTriple"


FOLD_CALLS = {"user": 0, "aten": 0}


@torch.library.custom_op("opencann_test::offset_cos", mutates_args=())
def offset_cos(x: torch.Tensor, offset: float) -> torch.Tensor:
    FOLD_CALLS["aten"] += 1
    return torch.cos(x) + offset


@offset_cos.register_fake
def _(x, offset):
    return torch.empty_like(x)


def _user_offset_cos(x, offset):
    FOLD_CALLS["user"] += 1
    return torch.cos(x) + offset


register(OpDef("TestOffsetCos", OpKind.ELEMENTWISE, aten=torch.ops.opencann_test.offset_cos.default,
               kernels={"cpu": _user_offset_cos}))


class FoldedOffsetCos(torch.nn.Module):
    """The custom op reads only a weight: constant folding evaluates it at compile time."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 5, generator=G))

    def forward(self, x):
        return x * torch.ops.opencann_test.offset_cos(self.w, 0.25)


def test_constant_folding_runs_the_user_cpu_kernel():
    """A user op whose inputs are all constants is folded with the user's cpu kernel
    (``get_op(op).kernel("cpu")``), not its ATen overload; the folded value is eager's."""
    m = FoldedOffsetCos()
    FOLD_CALLS.update(user=0, aten=0)
    with torch.no_grad():
        cm = opencann.compile(m, (torch.randn(3, 5, generator=G),))
    assert FOLD_CALLS == {"user": 1, "aten": 0}
    assert "TestOffsetCos" not in cm.graph.op_counts()          # folded at compile time
    assert any(r.name == "constant_folding" and r.changed for r in cm.report.passes)
    outs, kept = [], []
    for x in _inputs(2):                                         # NaN position, a second call
        with torch.no_grad():
            want = m(x)
        out = cm(x)
        torch.testing.assert_close(out, want, equal_nan=True)
        assert torch.isnan(out[1, 2])
        outs.append(out)
        kept.append(out.clone())
    assert FOLD_CALLS["user"] == 1                               # never called again at run time
    for out, k in zip(outs, kept):                               # outputs stay independent
        torch.testing.assert_close(out, k, equal_nan=True)
