"""The GEMM race's copy rule (`cpu._pick`: a kernel keeping a copy of the weight must be 3%
faster than the fastest copy-free one) depends on the weight's layout: the GEMV and
``onednn_plain`` read nn.Linear's [n, k] weight in place but copy a contiguous [k, n] one
(``x @ W``). The race's cache (`LINEAR_CHOICES`) is keyed apart for the two layouts of one
shape, so a model compiled after another of the same GEMM shape gets its own layout's
choice, in either order (it had got the first one's: the panel GEMM's copy of an
nn.Linear weight where the GEMV was within 3%, or the GEMV on a [k, n] weight where the
panel GEMM was faster and both copy). Given times, so the host's load decides nothing;
values checked against eager."""
import pytest
import torch

import opencann
from opencann.ops.kernels import cpu as cpu_kernels

COST_US = {"addmm": 200.0, "gemv": 100.0, "panel": 98.0}   # others: 300


class KN(torch.nn.Module):
    """x @ W with a constant [k, n] weight: the GEMV would copy it."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32, 64))

    def forward(self, x):
        return x @ self.w


class NK(torch.nn.Module):
    """nn.Linear's [n, k] weight: the GEMV reads it in place."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 64, bias=False)

    def forward(self, x):
        return self.lin(x)


@pytest.fixture
def timed_race(monkeypatch):
    """The race's timer answering `COST_US` by the kernel that ran last."""
    ran = []
    real = cpu_kernels._packed_kernel

    def packed(kernel, *args, **kw):
        run = real(kernel, *args, **kw)

        def tagged(*a, **k):
            ran.append(kernel)
            return run(*a, **k)
        return tagged

    def timed(fn, **_):
        ran.append("addmm")       # addmm's run is not tagged
        fn()
        return COST_US.get(ran[-1], 300.0)
    monkeypatch.setattr(cpu_kernels, "_packed_kernel", packed)
    monkeypatch.setattr(cpu_kernels, "best_time_us", timed)
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", {})


@pytest.mark.parametrize("order", [(KN, NK), (NK, KN)])
def test_each_weight_layout_gets_its_own_choice_in_either_order(timed_race, order):
    if not cpu_kernels._available("panel", 64, None, 8, torch.float32, False):
        pytest.skip("the panel GEMM does not race on this host")
    want = {KN: "panel", NK: "gemv"}    # both copy a [k, n] weight: the faster; else the free one
    torch.manual_seed(0)
    for cls in order:
        m = cls().eval()
        x = torch.randn(8, 32)
        cm = opencann.compile(m, (x,))
        kernels = [n.meta.get("kernel") for n in cm.graph.nodes if n.op == "LinearAct"]
        assert kernels == [want[cls]], (cls.__name__, kernels)
        x = torch.randn(8, 32)
        x[7, 3] = float("nan")
        with torch.no_grad():
            ref = m(x)
        out = cm(x)
        assert torch.equal(torch.isnan(out), torch.isnan(ref))
        assert torch.allclose(out.nan_to_num(), ref.nan_to_num(), rtol=1e-5, atol=1e-5)
    keys = [k for k in cpu_kernels.LINEAR_CHOICES if k[:3] == (8, 32, 64)]
    assert len(keys) == 2 and sum("weight [k, n]" in k for k in keys) == 1
