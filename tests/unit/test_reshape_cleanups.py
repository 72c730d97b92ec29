"""`fuse_consecutive_reshapes` (Reshape ∘ Reshape ⇒ Reshape) and `eliminate_nop_reshape`
(a Reshape to its input's own shape and strides ⇒ its input): golden before/expected
graphs of ≤ 10 nodes, the reasons each does not apply, and a compiled model with the
transformers' view chains (a fresh GEMM result sliced, split into heads, SDPA's result
viewed as itself, [S, F] → [1, S, F] → [S, F]) giving eager's values, NaN/Inf included,
with fewer Reshapes than with both passes off, on a second call too."""
import pytest
import torch
from torch import nn

import opencann
from opencann.ir import DataType, Graph, TensorDesc, TensorRef
from opencann.ir.dump import to_text
from opencann.passes import EliminateNopReshape, FuseConsecutiveReshapes

from helpers import run_pass, skipped

F = DataType.FLOAT


def d(*shape):
    return TensorDesc(tuple(shape), F)


run = run_pass


def reshape(g, x, shape, name=None, strides=None):
    n = g.create_node("Reshape", [x], {"self": TensorRef(0), "size": list(shape)}, [d(*[abs(s) for s in shape])], name)
    if strides is not None:
        n.meta["strides"] = [strides]
    return n.output


def neg(g, x, name=None):
    return g.create_node("Neg", [x], {"self": TensorRef(0)}, [x.desc], name).output


def test_fuse_consecutive_reshapes_golden():
    g = Graph()
    x = g.add_input(d(4, 6), "x")
    y = reshape(g, reshape(g, neg(g, x), [1, 4, 6], "r1"), [1, 4, 2, 3], "r2")
    g.outputs = [neg(g, y)]
    text, rep = run(FuseConsecutiveReshapes(), g)
    assert text == """graph(%x: float32[4,6]):
  %0: float32[4,6] = Neg(%x)
  %1: float32[1,4,2,3] = Reshape(%0; size=[1, 4, 2, 3])
  %2: float32[1,4,2,3] = Neg(%1)
  return %2"""
    assert [a["detail"] for a in rep.applied] == ["Reshape ∘ Reshape"]


def test_fuse_consecutive_reshapes_does_not_apply():
    # the first view is also returned: both stay
    g = Graph()
    x = g.add_input(d(4, 6), "x")
    mid = reshape(g, neg(g, x), [1, 4, 6], "r1")
    g.outputs = [neg(g, reshape(g, mid, [24], "r2")), mid]
    before = to_text(g)
    _, rep = run(FuseConsecutiveReshapes(), g)
    assert to_text(g) == before
    assert skipped(rep) == [("fuse_consecutive_reshapes", "the first Reshape's result is read "
                             "elsewhere (or returned): both views stay")]
    # eager's strides of the second view are not what one view of the input gives
    g = Graph()
    x = g.add_input(d(4, 6), "x")
    y = reshape(g, reshape(g, neg(g, x), [1, 4, 6], "r1"), [1, 24], "r2", strides=(7, 1))
    g.outputs = [neg(g, y)]
    before = to_text(g)
    _, rep = run(FuseConsecutiveReshapes(), g)
    assert to_text(g) == before
    assert skipped(rep) == [("fuse_consecutive_reshapes", "a view of the first Reshape's input "
                             "to [1, 24] would have strides (24, 1), eager's are (7, 1)")]


def test_eliminate_nop_reshape_golden():
    g = Graph()
    x = g.add_input(d(2, 3), "x")
    g.outputs = [neg(g, reshape(g, neg(g, x), [2, 3], "same"))]
    text, _ = run(EliminateNopReshape(), g)
    assert text == """graph(%x: float32[2,3]):
  %0: float32[2,3] = Neg(%x)
  %1: float32[2,3] = Neg(%0)
  return %1"""


def test_eliminate_nop_reshape_does_not_apply():
    g = Graph()
    x = g.add_input(d(2, 3), "x")
    g.outputs = [reshape(g, neg(g, x), [2, 3], "same")]
    before = to_text(g)
    _, rep = run(EliminateNopReshape(), g)
    assert to_text(g) == before
    assert skipped(rep) == [("eliminate_nop_reshape", "the view is a graph output (results "
                             "must not alias inputs or each other)")]
    g = Graph()
    x = g.add_input(d(2, 3), "x")
    g.outputs = [neg(g, reshape(g, neg(g, x), [2, 3], "same", strides=(1, 2)))]
    before = to_text(g)
    _, rep = run(EliminateNopReshape(), g)
    assert to_text(g) == before
    assert skipped(rep) == [("eliminate_nop_reshape", "eager's strides of the view (1, 2) "
                             "differ from its input's (3, 1)")]


def test_vnpu_keeps_the_views():
    g = Graph()
    x = g.add_input(d(4, 6), "x")
    g.outputs = [neg(g, reshape(g, reshape(g, neg(g, x), [1, 4, 6]), [24]))]
    before = to_text(g)
    run(FuseConsecutiveReshapes(), g, device="vnpu")
    assert to_text(g) == before


class Block(nn.Module):
    """A transformer block's view chains at batch 1: fused QKV sliced and split into
    heads, SDPA's result viewed as itself, the FFN's [S, F] → [1, S, F] → [S, F]."""

    def __init__(self, h=4, dh=8):
        super().__init__()
        self.h, self.dh = h, dh
        e = h * dh
        self.qkv, self.o = nn.Linear(e, 3 * e), nn.Linear(e, e)
        self.f1, self.f2 = nn.Linear(e, 2 * e), nn.Linear(2 * e, e)

    def forward(self, x):
        s, e = x.shape[1], self.h * self.dh
        qkv = self.qkv(x.view(s, e))
        q, k, v = (qkv[:, i * e:(i + 1) * e].view(1, s, e).view(1, s, -1, self.dh).transpose(1, 2)
                   for i in range(3))
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        a = a.view(1, self.h, s, self.dh).transpose(1, 2).reshape(1, s, -1).reshape(s, e)
        h = self.o(a).view(1, s, e) + x
        f = self.f1(h.view(s, e)).view(1, s, 2 * e)
        return self.f2(torch.relu(f).view(s, 2 * e)).view(1, s, e) + h


@pytest.mark.parametrize("precision", [None, "allow_mix_precision_bf16"])
def test_compiled_block_values_and_fewer_reshapes(precision):
    torch.manual_seed(0)
    m = Block().eval()
    x = torch.randn(1, 16, 32)
    opt = {"precision_mode": precision} if precision else {}
    on = opencann.compile(m, (x,), options=opt)
    off = opencann.compile(m, (x,), options={**opt, "disable": ["fuse_consecutive_reshapes",
                                                                "eliminate_nop_reshape"]})
    assert on.graph.op_counts()["Reshape"] < off.graph.op_counts()["Reshape"]
    names = [a["pass"] for a in on.report.applied]
    assert "fuse_consecutive_reshapes" in names and "eliminate_nop_reshape" in names
    for i in range(2):   # a second call, new inputs with NaN/Inf
        x = torch.randn(1, 16, 32)
        if i:
            x[0, 3, 5], x[0, 7, 1] = float("nan"), float("inf")
        got, want = on(x), off(x)
        assert torch.equal(got.nan_to_num(1.5, 2.5, -2.5), want.nan_to_num(1.5, 2.5, -2.5))
        assert torch.equal(got.isnan(), want.isnan())
        if precision is None:
            with torch.no_grad():
                torch.testing.assert_close(got, m(x), equal_nan=True, rtol=1e-5, atol=1e-5)
