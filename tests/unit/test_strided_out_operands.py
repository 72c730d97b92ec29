"""Compiled vs eager on strided operands of the ops whose ATen ``.out`` overload mishandles
them (`OpDef.out_contiguous`; the audit is tests/unit/test_out_overload_layouts.py) and of
some whose overload is right: a transposed, permuted-and-sliced or expanded activation
into BatchNorm with batch statistics and no running ones (``track_running_stats=False``,
``F.batch_norm(x, None, None, training=True)``), softmax, log-softmax, GELU, BatchNorm
with running statistics, LayerNorm, GroupNorm, pooling, a reduction, an addition;
opencann.compile on the CPU and the vnpu, torch.compile(backend="opencann") at inference
and in training (gradients), and the gradient ops a training backward keeps whole
(BatchNormGrad, SoftmaxGrad, LogSoftmaxGrad, GeluGrad) on a transposed gradient."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import opencann
from opencann.dynamo.training import training_decompositions
from opencann.engine import compile_graph
from opencann.frontend.torch import from_fx_graph
from opencann.runtime import Executor

aten = torch.ops.aten
NAN = float("nan")


def _strided_ops(m: nn.Module, x2, x3, x4):
    """op name -> its result on a strided view: x2 [8, 6] (a Linear's output transposed),
    x3 [B, T, C] read as [B, C, T], x4 [N, H, W, C] read as NCHW (and sliced)."""
    t2 = m.lin(x2).t()
    t3 = (x3 * 1.5).transpose(1, 2)
    t4 = (x4 * 1.5).permute(0, 3, 1, 2)
    return {
        # BNTrainingUpdateNoStats: misbehaves
        "bn_no_stats_2d": m.bn2(t2), "bn_no_stats_3d": m.bn3(t3), "bn_no_stats_4d": m.bn4(t4[:, :, ::2]),
        "bn_no_stats_expanded": m.bn3((x3 * 1.5)[:, :1].expand(-1, 5, -1).transpose(1, 2)),
        "f_batch_norm": F.batch_norm(t3, None, None, training=True),
        # softmax, log-softmax, GELU: misbehave into non-contiguous buffers
        "softmax": F.softmax(t3, dim=1), "log_softmax": F.log_softmax(t4, dim=1), "gelu": F.gelu(t4),
        # right at any layout
        "bn_running_stats": m.bn_eval(t3), "layer_norm": F.layer_norm(t3, (5,)),
        "group_norm": F.group_norm(t4[:, :, ::2], 3), "max_pool": F.max_pool2d(t4, 2),
        "sum": t4.sum(dim=(2, 3)), "add": t3 + x3.transpose(1, 2),
    }


class StridedOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn2 = nn.BatchNorm1d(8, track_running_stats=False)
        self.bn3 = nn.BatchNorm1d(6, track_running_stats=False)
        self.bn4 = nn.BatchNorm2d(6, track_running_stats=False)
        self.bn_eval = nn.BatchNorm1d(6)
        with torch.no_grad():
            self.bn_eval.running_mean.uniform_(-1, 1)
            self.bn_eval.running_var.uniform_(0.5, 2)

    def forward(self, x2, x3, x4):
        return tuple(_strided_ops(self, x2, x3, x4).values())


OPS = list(_strided_ops(StridedOps(), torch.randn(8, 8), torch.randn(3, 5, 6), torch.randn(2, 8, 4, 6)))


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    x2, x3, x4 = torch.randn(8, 8, generator=g), torch.randn(3, 5, 6, generator=g), torch.randn(2, 8, 4, 6, generator=g)
    x3[0, 0, 0] = NAN          # one channel (and softmax row) NaN; the others must stay right
    x4[1, 1, 1, 1] = NAN
    return x2, x3, x4


@pytest.fixture(scope="module")
def results():
    """path -> (eager's results, the compiled ones) for two input draws each."""
    torch.manual_seed(0)
    m = StridedOps().eval()
    ex = _inputs(0)
    compiled = {"cpu": opencann.compile(m, ex), "vnpu": opencann.compile(m, ex, device="vnpu:ascend910b")}
    torch._dynamo.reset()
    compiled["torch.compile"] = torch.compile(copy.deepcopy(m), backend="opencann")
    out = {}
    with torch.no_grad():
        for path, c in compiled.items():
            pairs = [(m(*_inputs(s)), c(*_inputs(s))) for s in (1, 2)]
            out[path] = pairs
    return out


@pytest.mark.parametrize("path", ["cpu", "vnpu", "torch.compile"])
@pytest.mark.parametrize("op", OPS)
def test_strided_operand_gives_eagers_values(results, path, op):
    k = OPS.index(op)
    for eager, got in results[path]:
        torch.testing.assert_close(got[k], eager[k], rtol=1e-5, atol=1e-5, equal_nan=True,
                                   msg=lambda m: f"{op} on {path}: {m}")


class TrainBN(nn.Module):
    """A [B, T, C] activation normalised per channel as [B, C, T] (a speech / TCN block)."""

    def __init__(self, track: bool, dims: int):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.dims = dims
        self.bn = (nn.BatchNorm1d if dims < 4 else nn.BatchNorm2d)(6, track_running_stats=track)

    def forward(self, x):
        y = self.lin(x)
        if self.dims == 2:
            return self.bn(y.reshape(-1, 6)[::2])                  # every other row
        if self.dims == 3:
            return self.bn(y.transpose(1, 2))
        return self.bn(y.permute(0, 3, 1, 2)[:, :, ::2])


@pytest.mark.parametrize("track,dims", [(False, 2), (False, 4), (True, 3)])
def test_training_gradients_through_strided_batch_norm(track, dims):
    """Loss, input and parameter gradients of torch.compile(backend="opencann") training
    vs eager: BNTrainingUpdateNoStats forward (no running stats) or the functional
    training BatchNorm (running stats), BatchNormGrad backward, on strided activations."""
    torch.manual_seed(0)
    m = TrainBN(track, dims).train()
    mc = copy.deepcopy(m)
    c = torch.compile(mc, backend="opencann")
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randn(*((4, 5, 6) if dims < 4 else (2, 6, 4, 6)), generator=g)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yc = m(xe), c(xc)
        w = torch.randn(ye.shape, generator=g)
        le, lc = (ye * w).sum(), (yc * w).sum()
        le.backward()
        lc.backward()
        torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-4, atol=1e-5)
        for (name, pe), pc in zip(m.named_parameters(), mc.parameters()):
            torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-4, atol=1e-4, msg=lambda s: f"{name}: {s}")
        if track:
            torch.testing.assert_close(mc.bn.running_mean, m.bn.running_mean)


def _grad_of(name):
    """The gradient op ``name`` of a training backward on a transposed gradient
    (grad [B, C, T] read as [B, T, C]) and a contiguous saved value."""
    ops = {
        "LogSoftmaxGrad": lambda g, y: aten._log_softmax_backward_data(g, y, 2, torch.float32),
        "SoftmaxGrad": lambda g, y: aten._softmax_backward_data(g, y, 2, torch.float32),
        "GeluGrad": lambda g, y: aten.gelu_backward(g, y),
        "BatchNormGrad": lambda g, y: aten.native_batch_norm_backward(
            g, y, None, None, None, y.mean((0, 2)), y.var((0, 2)).add(1e-5).rsqrt(), True, 1e-5,
            [True, False, False])[0],
    }
    op = ops[name]
    return lambda g, y: op((g * 2).transpose(1, 2), y * 1) + 1


@pytest.mark.parametrize("name", ["LogSoftmaxGrad", "SoftmaxGrad", "GeluGrad", "BatchNormGrad"])
def test_gradient_op_on_a_transposed_gradient(name):
    """The ops a training backward keeps whole (`NATIVE_BACKWARD_OPS`), compiled as
    compile_fx compiles a backward graph, vs eager: LogSoftmaxGrad's traced result follows
    the transposed gradient's layout, which its .out overload wrote as if contiguous."""
    fn = _grad_of(name)
    g = torch.Generator().manual_seed(5)
    grad, y = torch.randn(3, 6, 5, generator=g), torch.randn(3, 5, 6, generator=g)
    grad[0, 1, 2] = NAN
    gm = make_fx(fn, decomposition_table=training_decompositions(), tracing_mode="fake")(grad, y)
    assert any(str(n.target).startswith(("aten._", "aten.gelu_backward", "aten.native_batch_norm_backward"))
               and "backward" in str(n.target) for n in gm.graph.nodes), gm.graph
    graph, plan, _ = compile_graph(from_fx_graph(gm, [grad, y]), "cpu", {"verify": True})
    out = Executor(graph, plan).run([grad, y])[0]
    torch.testing.assert_close(out, fn(grad, y), rtol=1e-5, atol=1e-5, equal_nan=True)
