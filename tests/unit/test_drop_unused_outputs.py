"""drop_unused_outputs: inference runs MaxPool (no argmax indices) and amax (no max.dim
indices) when nobody reads the indices; values and NaN positions are eager's; graphs that
read the indices (return_indices, AOTAutograd's forward for the backward) keep them."""
import copy

import pytest
import torch
import torch.nn.functional as F

import opencann
from opencann.dynamo import COMPILED_GRAPHS
from opencann.dynamo.training import opencann_training_backend
from opencann.ir import DataType, Graph, TensorDesc, TensorRef
from opencann.ops import infer
from opencann.engine.options import complete
from opencann.passes import PassContext, PassManager
from opencann.passes.prepare.drop_unused_outputs import DropUnusedOutputs
from opencann.report import CompileReport


def _nan_input(*shape, seed=0):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    x.view(-1)[::17] = float("nan")
    x.view(-1)[5] = float("-inf")
    return x


class _Pool(torch.nn.Module):
    def __init__(self, **pool):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.pool = pool

    def forward(self, x):
        y = F.max_pool2d(torch.relu(self.conv(x)), **self.pool)
        return y + 1, F.max_pool2d(x, **self.pool)   # after a conv (channels-last) and on the input


@pytest.mark.parametrize("pool", [dict(kernel_size=3, stride=2, padding=1),
                                  dict(kernel_size=2),
                                  dict(kernel_size=3, stride=2, ceil_mode=True),
                                  dict(kernel_size=3, stride=1, padding=1, dilation=2)],
                         ids=["k3s2p1", "k2", "ceil", "dilation"])
def test_maxpool_without_indices_matches_eager(pool):
    torch.manual_seed(0)
    m = _Pool(**pool).eval()
    x = _nan_input(2, 3, 15, 15)
    cm = opencann.compile(m, (x,))
    counts = cm.report.op_counts_after
    assert counts.get("MaxPool") == 2 and "MaxPoolWithArgmax" not in counts, counts
    assert any(a["detail"] == "MaxPoolWithArgmax→MaxPool" for a in cm.report.applied)
    first = cm(x)
    for got, want in zip(first, m(x)):
        torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-5, atol=1e-5)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert got.stride() == want.stride()
    x2 = _nan_input(2, 3, 15, 15, seed=1)   # a second call: new values, outputs independent
    saved = [t.clone() for t in first]
    for got, want in zip(cm(x2), m(x2)):
        torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-5, atol=1e-5)
    for a, b in zip(first, saved):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("keepdim", [False, True])
def test_max_dim_values_only_becomes_amax(keepdim):
    def f(x):
        return torch.max(x, dim=1, keepdim=keepdim)[0] * 2

    class M(torch.nn.Module):
        def forward(self, x):
            return f(x)
    x = _nan_input(4, 6, 5)
    cm = opencann.compile(M(), (x,))
    assert "ReduceMax" in cm.report.op_counts_after
    assert "ReduceMaxD" not in cm.report.op_counts_after
    for inp in (x, _nan_input(4, 6, 5, seed=3)):
        torch.testing.assert_close(cm(inp), f(inp), equal_nan=True)


def test_indices_read_keeps_the_op_and_says_why():
    class M(torch.nn.Module):
        def forward(self, x):
            y, i = F.max_pool2d(x, 2, return_indices=True)
            v, j = torch.max(x, dim=1)
            return y, i + 0, v, j
    x = _nan_input(1, 2, 6, 6)
    cm = opencann.compile(M(), (x,))
    assert cm.report.op_counts_after.get("MaxPoolWithArgmax") == 1
    assert cm.report.op_counts_after.get("ReduceMaxD") == 1
    reasons = [s["reason"] for s in cm.report.skipped if "→" in s["detail"]]
    assert len(reasons) == 2 and all("output 1 is" in r for r in reasons), reasons
    for got, want in zip(cm(x), M()(x)):
        torch.testing.assert_close(got, want, equal_nan=True)


def _pool_graph(indices_out: bool):
    g = Graph("pool")
    x = g.add_input(TensorDesc((1, 2, 4, 4), DataType.FLOAT))
    n = g.create_node("MaxPoolWithArgmax", [x], {"self": TensorRef(0), "kernel_size": [2, 2],
                                                  "stride": [2, 2]}, [])
    n.outputs = [g._value(d, producer=n) for d in infer(n)]
    r = g.create_node("Relu", [n.outputs[0]], {"self": TensorRef(0)}, [n.outputs[0].desc])
    g.outputs = [r.outputs[0]] + ([n.outputs[1]] if indices_out else [])
    return g


def _run(g, device="cpu"):
    ctx = PassContext(options=complete({}), report=CompileReport(model="t", device=device), device=device)
    PassManager([DropUnusedOutputs()]).run(g, ctx)
    return ctx.report.passes[0].changed, ctx


def test_before_expected_graph():
    g = _pool_graph(indices_out=False)
    changed, ctx = _run(g)
    assert changed == 1
    assert [n.op for n in g.nodes] == ["MaxPool", "Relu"]
    pool = g.nodes[0]
    assert pool.attrs == {"self": TensorRef(0), "kernel_size": [2, 2], "stride": [2, 2]}
    assert len(pool.outputs) == 1 and tuple(pool.outputs[0].desc.shape) == (1, 2, 2, 2)
    assert g.nodes[1].inputs == (pool.outputs[0],)


@pytest.mark.parametrize("device", ["cpu", "vnpu"])
def test_does_not_apply(device):
    g = _pool_graph(indices_out=device == "cpu")   # cpu: indices are a graph output
    changed, ctx = _run(g, device)
    assert changed == 0 and [n.op for n in g.nodes] == ["MaxPoolWithArgmax", "Relu"]
    if device == "cpu":
        assert "graph output" in ctx.report.skipped[0]["reason"]
    else:
        assert "cpu" in ctx.report.passes[0].note


def test_training_keeps_indices_for_the_backward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 4 * 4, 3)).train()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(2))
    n = len(COMPILED_GRAPHS)
    torch.compile(model, backend=opencann_training_backend)(x).sum().backward()
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    counts = [r.op_counts_after for r in COMPILED_GRAPHS[n:]]
    assert any("MaxPoolWithArgmax" in c for c in counts), counts
    assert any("MaxPoolGradWithArgmax" in c for c in counts), counts
