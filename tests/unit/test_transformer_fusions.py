"""Transformer fusions end to end (issue #11 item 5): `fuse_qkv_linear` (Q/K/V Linears on
one input as one GEMM, three StridedSlice views) and `fuse_add_layer_norm` (residual Add
+ LayerNorm as one kernel) fire on small modules shaped like a BERT layer, and the
compiled model matches eager PyTorch: values within 1e-5, NaN at eager's positions, the
same strides, a second call that leaves the first call's results alone, outputs that do
not alias each other. Near misses leave the graph alone (golden tests in
test_pass_golden.py give their reasons)."""
import pytest
import torch
import torch.nn as nn

import opencann

G = torch.Generator().manual_seed(0)


class SelfAttention(nn.Module):
    """BERT's self-attention: Q, K, V Linears on x [B, S, H], SDPA over 2 heads, the
    output Linear, residual Add and LayerNorm. ``ret_q`` also returns q (a graph output
    read from the merged buffer, and a second user of q's Linear)."""

    def __init__(self, h=16, heads=2, ret_q=False, q_input=False, scale_q=False):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.ln = nn.LayerNorm(h)
        self.heads, self.ret_q, self.q_input, self.scale_q = heads, ret_q, q_input, scale_q

    def forward(self, x, y):
        b, s, h = x.shape

        def split(t):
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        q = self.q(y if self.q_input else x)
        if self.scale_q:   # an elementwise op on one slice while the others are live
            q = torch.tanh(q * 0.5) + q
        a = nn.functional.scaled_dot_product_attention(split(q), split(self.k(x)), split(self.v(x)))
        a = a.transpose(1, 2).reshape(b, s, h)
        out = self.ln(self.o(a) + x)
        return (out, q) if self.ret_q else out


def _inputs(nan: bool):
    x = torch.randn(2, 5, 16, generator=G) * 2
    y = torch.randn(2, 5, 16, generator=G)
    if nan:
        x[1, 3, 7] = float("nan")
    return x, y


def _flat(o):
    return list(o) if isinstance(o, (tuple, list)) else [o]


def _check(model, options=None):
    model.eval()
    x, y = _inputs(False)
    cm = opencann.compile(model, (x, y), options={"verify": True, **(options or {})})
    firsts = []
    for nan in (False, True, False):
        xs = _inputs(nan)
        with torch.no_grad():
            ref = _flat(model(*xs))
        got = _flat(cm(*xs))
        for a, b in zip(got, ref):
            assert torch.equal(torch.isnan(a), torch.isnan(b)), "NaN positions differ"
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)
            assert a.stride() == b.stride()
        firsts.append(([t.clone() for t in got], got))
    for keep, got in firsts:   # later calls left earlier results alone
        for a, b in zip(keep, got):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    if len(firsts[0][1]) > 1:   # outputs do not share memory
        a, b = firsts[0][1][:2]
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    return cm


def _applied(cm, name):
    return [a["detail"] for a in cm.report.applied if a["pass"] == name]


@pytest.mark.parametrize("ret_q", [False, True], ids=["out", "out_and_q"])
def test_qkv_linears_become_one_gemm_and_match_eager(ret_q):
    """Returned q (a graph output) is left out, with its reason: eager returns it
    contiguous, in memory of its own; K and V still share one GEMM."""
    cm = _check(SelfAttention(ret_q=ret_q))
    n = 2 if ret_q else 3
    assert _applied(cm, "fuse_qkv_linear") == [f"{n} Linears on one input as one GEMM [.., {16 * n}]"]
    ops = cm.graph.op_counts()
    assert ops["LinearAct"] == 5 - n and ops["StridedSlice"] == n
    why = [s["reason"] for s in cm.report.skipped if s["pass"] == "fuse_qkv_linear"]
    assert len(why) == ret_q and all("is a graph output" in w for w in why)


def test_qkv_elementwise_ops_on_a_slice_do_not_overwrite_the_others():
    cm = _check(SelfAttention(scale_q=True))
    assert _applied(cm, "fuse_qkv_linear") == ["3 Linears on one input as one GEMM [.., 48]"]


def test_qkv_with_q_on_another_input_merges_k_and_v_only():
    cm = _check(SelfAttention(q_input=True))
    assert _applied(cm, "fuse_qkv_linear") == ["2 Linears on one input as one GEMM [.., 32]"]


def test_qkv_switched_off_keeps_three_gemms():
    cm = _check(SelfAttention(), options={"disable": ["fuse_qkv_linear"]})
    assert cm.graph.op_counts()["LinearAct"] == 4 and "StridedSlice" not in cm.graph.op_counts()


def test_add_layer_norm_fuses_the_residual_and_matches_eager():
    cm = _check(SelfAttention(), options={"enable": ["fuse_add_layer_norm"]})
    assert _applied(cm, "fuse_add_layer_norm") == ["residual Add + LayerNorm"]
    assert "LayerNorm" not in cm.graph.op_counts()


class Residual(nn.Module):
    """LayerNorm(x + y) with x, y [B, S, H]."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(16)

    def forward(self, x, y):
        return self.ln(x + y)


@pytest.mark.parametrize("special", [float("nan"), float("inf"), -float("inf"), 1e-40])
def test_add_layer_norm_special_values_at_eager_positions(special):
    m = Residual().eval()
    x, y = _inputs(False)
    cm = opencann.compile(m, (x, y), options={"enable": ["fuse_add_layer_norm"]})
    assert _applied(cm, "fuse_add_layer_norm")
    x = x.clone()
    x[0, 2, 3] = special
    with torch.no_grad():
        ref = m(x, y)
    got = cm(x, y)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_add_layer_norm_on_strided_inputs_and_float64():
    """A non-contiguous addend at run time takes ATen's add + layer_norm; float64 too."""
    m = Residual().eval()
    x, y = _inputs(False)
    cm = opencann.compile(m, (x, y), options={"enable": ["fuse_add_layer_norm"]})
    yt = y.transpose(0, 1).contiguous().transpose(0, 1)   # same values, other strides
    with torch.no_grad():
        torch.testing.assert_close(cm(x, yt), m(x, yt), rtol=1e-5, atol=1e-5)
        md = Residual().double().eval()
        cmd = opencann.compile(md, (x.double(), y.double()),
                               options={"enable": ["fuse_add_layer_norm"]})
        torch.testing.assert_close(cmd(x.double(), y.double()), md(x.double(), y.double()))
