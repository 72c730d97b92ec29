"""A LinearAct bound to a GEMM that computes into an allocation of its own (oneDNN's inner
product, MKL's packed GEMM: `cpu.fresh_result`) hands that result to its consumers: the
executor's code copies it into no planned buffer, and the views read from it (a fused
Q/K/V's slices, reshapes, transposes) fold onto it. Checked against eager on every such
kernel and addmm (which writes its buffer): values with NaN/Inf positions, a second call,
output independence, and which nodes the code copies."""
import pytest
import torch

import opencann
from opencann.devices import cpu as cpu_device
from opencann.ops.kernels import cpu as cpu_kernels
from helpers import ForcedGemmChoice


class SplitHeads(torch.nn.Module):
    """A fused projection read through three head views, a residual linear read twice,
    and a linear whose result is the graph's output."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.o, self.up = (torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d),
                                     torch.nn.Linear(d, 2 * d))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        h = self.o(a.transpose(1, 2).reshape(b, s, d))
        return self.up(h * torch.sigmoid(h) + h)


def _available(kernel: str) -> bool:
    if kernel == "mkl_packed":
        return cpu_device.mkl_packed_available()
    if kernel.startswith("onednn"):
        return cpu_device.onednn_linear_available()
    return True


@pytest.mark.parametrize("kernel", ["onednn_packed", "onednn_plain", "mkl_packed", "addmm"])
def test_a_fresh_gemm_result_is_read_where_the_kernel_made_it(kernel, monkeypatch):
    if not _available(kernel):
        pytest.skip(f"{kernel} not in this torch build")
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", ForcedGemmChoice(kernel))
    torch.manual_seed(0)
    m = SplitHeads().eval()
    x = torch.randn(2, 5, 32)
    cm = opencann.compile(m, (x,))
    linears = [n for n in cm.graph.nodes if n.op == "LinearAct"]
    assert {n.meta.get("kernel") for n in linears} == {kernel}
    # the kernel's own result is handed on (no ``out=``: no copy into a planned buffer);
    # addmm writes its planned buffer (one feeding the output has none: a fresh tensor)
    lines = cm.executor._src.splitlines()
    for i, n in enumerate(cm.graph.nodes):
        if n.op == "LinearAct" and n.outputs[0].id in cm.executor.plan.value_buffer:
            call = [ln for ln in lines if f"K{i}(" in ln or f"P{i}()" in ln]
            writes_buffer = [("out=" in ln or f"P{i}()" in ln) for ln in call]   # P: prebound to it
            want = kernel not in cpu_kernels.FRESH_RESULT_KERNELS
            assert call and writes_buffer == [want] * len(call), call
    for k in range(2):
        x = torch.randn(2, 5, 32)
        x[0, 1, 3] = float("nan")   # batch row 0 turns NaN through attention; row 1 stays finite
        x[0, 2, 4] = float("inf")
        with torch.no_grad():
            ref = m(x)
        out = cm(x)
        assert torch.equal(torch.isnan(out), torch.isnan(ref))
        assert torch.equal(torch.isinf(out), torch.isinf(ref))
        fin = torch.isfinite(ref)
        assert fin.any() and (out[fin] - ref[fin]).abs().max().item() < 1e-4
        again = cm(x)
        assert torch.equal(again.nan_to_num(), out.nan_to_num())    # same bits on a second call
        out.add_(1)                                                   # outputs are the caller's
        assert not torch.equal(again.nan_to_num(), out.nan_to_num())


@pytest.mark.parametrize("kernel", ["onednn_packed", "mkl_packed"])
def test_fresh_results_from_several_threads_stay_apart(kernel, monkeypatch):
    """Each call gets its own result: two threads calling one compiled model at once get
    their own values (a planned buffer would be shared by the executor's clones only)."""
    if not _available(kernel):
        pytest.skip(f"{kernel} not in this torch build")
    from helpers import run_threads
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", ForcedGemmChoice(kernel))
    torch.manual_seed(1)
    m = SplitHeads().eval()
    cm = opencann.compile(m, (torch.randn(2, 5, 32),))
    xs = [torch.randn(2, 5, 32) for _ in range(4)]
    with torch.no_grad():
        refs = [m(x) for x in xs]

    errors = []

    def work(i):
        for _ in range(20):
            err = (cm(xs[i]) - refs[i]).abs().max().item()
            if not err < 1e-4:
                errors.append((i, err))
    run_threads([(work, (i,)) for i in range(4)])
    assert errors == []
