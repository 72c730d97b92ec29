"""Recomputation policy and budgets (Chen et al. 2016): cheap ops only by default,
budgets that shrink the planned peak, a clear error when a budget cannot be met."""
import copy

import pytest
import torch

from opencann.dynamo.training import make_training_backend
from opencann.dynamo.partition import MemoryBudgetError, is_cheap, is_random, last_partition_report


def _fx_node(fn, *args):
    gm = torch.fx.symbolic_trace(fn)
    return [n for n in gm.graph.nodes if n.op == "call_function"][0]


def test_cheap_policy():
    aten = torch.ops.aten
    g = torch.fx.Graph()
    x = g.placeholder("x")
    mk = lambda t, *a: g.call_function(t, (x,) + a)  # noqa: E731
    assert is_cheap(mk(aten.relu.default)) and is_cheap(mk(aten.mul.Tensor, 2.0))
    assert is_cheap(mk(aten.view.default, [4])) and is_cheap(mk(aten._to_copy.default))
    for t in (aten.mm.default, aten.convolution.default, aten.bmm.default,
              aten.native_layer_norm.default, aten._softmax.default):
        assert not is_cheap(mk(t))
    drop = mk(aten.native_dropout.default, 0.1, True)
    assert is_random(drop) and not is_cheap(drop)


class MLP(torch.nn.Module):
    def __init__(self, width=256, depth=6):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(width) for _ in range(depth))

    def forward(self, x):
        for lin, ln in zip(self.layers, self.norms):
            x = x + torch.nn.functional.gelu(lin(ln(x)))
        return x


def _step(budget, batch=64):
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    x = torch.randn(batch, 256)
    cm = torch.compile(model, backend=make_training_backend(memory_budget=budget))
    cm(x).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max() / q.grad.abs().max() < 1e-5
    return last_partition_report()


@pytest.fixture(scope="module")
def base():
    """The unbudgeted step's partition report (its gradients checked against eager in
    `_step`), shared by the tests below: one training compile instead of three."""
    return _step(None)


def test_min_cut_recomputes_only_cheap_ops_and_reports(base):
    rep = base
    assert rep["recomputed"], "the GELU/view chain should be recomputed"
    assert not any(n.startswith(("addmm", "mm", "native_layer_norm")) for n in rep["recomputed"])
    assert rep["peak_min_cut"] <= rep["peak_without_recompute"]
    assert rep["saved_bytes"] < rep["saved_bytes_without_recompute"]
    assert rep["saved"] and all(s["bytes"] > 0 for s in rep["saved"])


@pytest.mark.parametrize("frac", [0.85])
def test_budget_fraction_fits_and_costs_flops(frac, base):
    rep = _step(frac)
    assert rep["peak"] <= frac * rep["peak_without_recompute"]
    assert rep["recompute_flops"] > base["recompute_flops"]
    assert rep["budget_search_steps"] > 0


def test_budget_in_bytes_and_impossible_budget(base):
    rep = _step(int(0.85 * base["peak_without_recompute"]))
    assert rep["peak"] <= 0.85 * base["peak_without_recompute"]
    with pytest.raises(Exception, match="cannot be met: the smallest planned peak") as e:
        _step(1000)
    assert "MemoryBudgetError" in str(e.value) or isinstance(e.value, MemoryBudgetError)
    for bad in (-1, 0, "half", True, float("nan"), float("inf"), 1.5):
        with pytest.raises(ValueError, match="memory_budget must be"):
            make_training_backend(memory_budget=bad)  # at once, not at the first step
    with pytest.raises(ValueError, match=r"unknown option.*training options: \['memory_budget'\]"):
        make_training_backend(memry_budget=0.5)


def test_budget_with_training_batchnorm_does_not_recompute_stateful_ops():
    """BatchNorm in training reads running statistics that the step overwrites after the
    forward: recomputing it in the backward failed autograd's version check. Stateful ops
    are never recomputed; convolutions between them may be."""
    import copy

    from opencann.dynamo.training import make_training_backend
    from opencann.dynamo.partition import last_partition_report
    torch.manual_seed(0)
    layers = []
    for cin in (3, 16, 16):
        layers += [torch.nn.Conv2d(cin, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16), torch.nn.ReLU()]
    m = torch.nn.Sequential(*layers, torch.nn.Flatten(), torch.nn.Linear(16 * 16 * 16, 10)).train()
    ref = copy.deepcopy(m)
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    c = torch.compile(m, backend=make_training_backend(memory_budget=0.85))
    c(x).square().mean().backward()
    ref(x).square().mean().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item() < 1e-5
    rep = last_partition_report()
    assert rep["recomputed"] and rep["peak"] < rep["peak_without_recompute"]
    assert not any("batch_norm" in r for r in rep["recomputed"])
    assert torch.allclose(m[1].running_mean, ref[1].running_mean, atol=1e-6)


def _conv_bn_relu(cin, cout):
    return [torch.nn.Conv2d(cin, cout, 3, padding=1, bias=False), torch.nn.BatchNorm2d(cout),
            torch.nn.ReLU()]


class _Block(torch.nn.Module):
    """A ResNet basic block: the residual stream skips the convolutions, so checkpoints
    must sit on the stream (its articulation points), not on the convolutions."""

    def __init__(self, c):
        super().__init__()
        self.body = torch.nn.Sequential(*_conv_bn_relu(c, c)[:3],
                                        torch.nn.Conv2d(c, c, 3, padding=1, bias=False),
                                        torch.nn.BatchNorm2d(c))

    def forward(self, x):
        return torch.relu(self.body(x) + x)


def _train_steps(model, budget, steps=2):
    """Compiled and eager training side by side (SGD, 2 steps): returns the last
    partition report and both models after asserting gradient and running-stat parity."""
    from opencann.dynamo import COMPILED_GRAPHS
    ref = copy.deepcopy(model)
    cm = torch.compile(model, backend=make_training_backend(memory_budget=budget), dynamic=False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref)]
    n0 = len(COMPILED_GRAPHS)
    for step in range(steps):
        x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(step))
        for m, f, o in ((model, cm, opts[0]), (ref, ref, opts[1])):
            o.zero_grad()
            f(x).square().mean().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item() < 1e-5
        for o in opts:
            o.step()
    for b, rb in zip(model.buffers(), ref.buffers()):
        assert torch.allclose(b.float(), rb.float(), atol=1e-5)
    return last_partition_report(), COMPILED_GRAPHS[n0:]


def test_batchnorm_outputs_recomputed_from_saved_statistics():
    """Under a budget, the cut saves each BatchNorm's input (its backward reads it
    anyway) and recomputes output and ReLU in the backward from the saved mean/rstd;
    the forward keeps the op's own output. Without a budget the outputs are saved."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(*_conv_bn_relu(3, 16), *_conv_bn_relu(16, 16), *_conv_bn_relu(16, 16),
                            torch.nn.Flatten(), torch.nn.Linear(16 * 16 * 16, 10)).train()
    rep, _ = _train_steps(copy.deepcopy(m), None)
    assert not rep["batch_norm_outputs_recomputable"]
    assert any(s["name"].startswith("relu") for s in rep["saved"])
    rep, graphs = _train_steps(m, 0.8)
    assert len(rep["batch_norm_outputs_recomputable"]) == 3 and rep["budget_search_steps"] == 0
    assert sum(r.startswith("addcmul") for r in rep["recomputed"]) == 3
    assert not any(s["name"].startswith("relu") for s in rep["saved"])
    assert rep["saved_bytes"] <= 0.6 * rep["saved_bytes_without_recompute"], rep
    assert rep["peak"] <= 0.8 * rep["peak_without_recompute"]
    fw, bw = graphs[0], graphs[1]
    assert "training graph: forward" in fw.notes and "Addcmul" not in fw.op_counts_before
    assert bw.op_counts_before.get("Addcmul") == 3
    assert {"BatchNormGrad", "ReluGrad", "Conv2DBackprop"} <= set(bw.op_counts_before)
    assert not fw.host_fallbacks
    assert not bw.host_fallbacks


def test_budget_checkpoints_the_residual_stream(frac=0.5):
    torch.manual_seed(0)
    m = torch.nn.Sequential(*_conv_bn_relu(3, 16), *[_Block(16) for _ in range(6)],
                            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                            torch.nn.Linear(16, 10)).train()
    rep, _ = _train_steps(m, frac)
    assert rep["peak"] <= frac * rep["peak_without_recompute"]
    assert any(r.startswith("convolution") for r in rep["recomputed"])


def test_batchnorm_rewrite_skips_low_precision_and_says_why():
    """A bf16 model's BatchNorms keep their outputs (the rewrite is fp32/fp64 only); the
    report names each one and the reason. (Also: the bf16 training BatchNorm compiles,
    its statistics' dtype differing between ATen's meta and CPU kernels.)"""
    torch.manual_seed(0)
    m = torch.nn.Sequential(*_conv_bn_relu(3, 8), *_conv_bn_relu(8, 8), torch.nn.Flatten(),
                            torch.nn.Linear(8 * 64, 2)).train().bfloat16()
    cm = torch.compile(m, backend=make_training_backend(memory_budget=0.95), dynamic=False)
    cm(torch.randn(4, 3, 8, 8, dtype=torch.bfloat16)).float().sum().backward()
    rep = last_partition_report()
    assert not rep["batch_norm_outputs_recomputable"]
    assert len(rep["batch_norm_outputs_kept"]) == 2
    assert all("fp32/fp64 only" in why for why in rep["batch_norm_outputs_kept"].values())
