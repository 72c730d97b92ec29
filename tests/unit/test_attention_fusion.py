"""FuseFlashAttention: SDPA and the spelled-out softmax(q kᵀ·s + mask)·v become a
FlashAttention node; unsupported cases are skipped with a reason in the report.

Relative error = max|a - b| / max|ref| against eager PyTorch; fp32 tolerance 1e-5.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import opencann
import opencann.ops.flash_attention.opdef  # noqa: F401  (registers FlashAttention; also in opencann.ops)
from opencann.ir import DataType, Graph, TensorDesc
from opencann.ops import get_op
from opencann.passes.fusion import attention as attn_pass

OPTS = {"enable": ["fuse_flash_attention"]}


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class SelfAttention(torch.nn.Module):
    """A transformer block's attention: fused qkv projection, heads, SDPA, out projection."""

    def __init__(self, dim=32, heads=4, causal=False, dropout_p=0.0, explicit=False):
        super().__init__()
        self.h, self.causal, self.p, self.explicit = heads, causal, dropout_p, explicit
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        B, S, C = x.shape
        q, k, v = self.qkv(x).reshape(B, S, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        if self.explicit:
            s = q @ k.transpose(-2, -1) / math.sqrt(C // self.h)
            if mask is not None:
                s = s + mask
            o = torch.softmax(s, dim=-1) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.p,
                                               is_causal=self.causal)
        return self.proj(o.transpose(1, 2).reshape(B, S, C))


def _inputs(seed=0, B=2, S=24, C=32, mask="bool"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, C, generator=g)
    if mask == "bool":
        m = torch.rand(B, 1, S, S, generator=g) > 0.3
        m[..., 0] = True  # no fully masked row (tested in test_nan_semantics.py)
        return x, m
    if mask == "float":
        return x, torch.randn(1, 1, S, S, generator=g)
    return (x,)


def _fa_nodes(cm):
    return [n for n in cm.graph.nodes if n.op == "FlashAttention"]


@pytest.mark.parametrize("causal,mask", [   # a float mask: test_spelled_out_attention_is_matched
    (False, "bool"), (True, None), pytest.param(False, "float", marks=pytest.mark.full)])
def test_sdpa_becomes_flash_attention(causal, mask):
    torch.manual_seed(0)
    model = SelfAttention(causal=causal).eval()
    inputs = _inputs(mask=mask)
    cm = opencann.compile(model, inputs, options=OPTS)
    assert len(_fa_nodes(cm)) == 1, str(cm.graph)
    assert "ScaledDotProductAttention" not in cm.graph.op_counts()
    assert _fa_nodes(cm)[0].attrs["causal"] is causal
    assert any(a["pass"] == "fuse_flash_attention" for a in cm.report.applied)
    with torch.no_grad():
        ref = model(*inputs)
    assert rel(first(cm(*inputs)), ref) < 1e-5


def test_off_by_default():
    model = SelfAttention().eval()
    cm = opencann.compile(model, _inputs())
    assert "FlashAttention" not in cm.graph.op_counts()
    assert cm.graph.op_counts().get("ScaledDotProductAttention") == 1


@pytest.mark.parametrize("mask", ["float", None])
def test_spelled_out_attention_is_matched(mask):
    torch.manual_seed(1)
    model = SelfAttention(explicit=True).eval()
    inputs = _inputs(seed=1, mask=mask)
    cm = opencann.compile(model, inputs, options=OPTS)
    counts = cm.graph.op_counts()
    assert counts.get("FlashAttention") == 1, str(cm.graph)
    assert "SoftmaxV2" not in counts and "BatchMatMul" not in counts
    with torch.no_grad():
        ref = model(*inputs)
    assert rel(first(cm(*inputs)), ref) < 1e-5


def test_dropout_is_skipped_with_reason():
    model = SelfAttention(dropout_p=0.1).eval()  # dropout_p passed explicitly: training-style
    cm = opencann.compile(model, _inputs(), options=OPTS)
    assert "FlashAttention" not in cm.graph.op_counts()
    reasons = [s["reason"] for s in cm.report.skipped if s["pass"] == "fuse_flash_attention"]
    assert reasons and "dropout" in reasons[0]


def test_head_dim_too_large_for_tile_plan_is_skipped(monkeypatch):
    # a 16 KiB "L2" cannot hold 16x16 tiles at head_dim 64 (needs ~17.5 KiB)
    monkeypatch.setattr(attn_pass, "cpu_l2", lambda: (16 * 1024, "test"))
    model = SelfAttention(dim=128, heads=2).eval()
    inputs = _inputs(C=128)
    cm = opencann.compile(model, inputs, options=OPTS)
    assert "FlashAttention" not in cm.graph.op_counts()
    reasons = [s["reason"] for s in cm.report.skipped if s["pass"] == "fuse_flash_attention"]
    assert reasons and "head dim 64" in reasons[0]
    with torch.no_grad():
        assert rel(first(cm(*inputs)), model(*inputs)) < 1e-5


def _vals(q, k, v, mask=None, dtype=DataType.from_torch(torch.float32)):
    g = Graph()
    vs = [g.add_input(TensorDesc(s, dtype)) for s in (q, k, v)]
    m = None if mask is None else g.add_input(TensorDesc(mask[0], DataType.from_torch(mask[1])))
    return vs + [m]


@pytest.mark.parametrize("args,needle", [
    (((2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 8, 16), ((2, 4, 8, 3), torch.bool)), "does not broadcast"),
    (((2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 8, 16), ((8, 8), torch.int64)), "bool or float mask"),
    (((2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 8, 16), None, DataType.from_torch(torch.float64)), "dtype"),
    (((4, 8, 16), (4, 8, 16), (4, 8, 16), None), "4-D"),
])
def test_check_reasons(args, needle):
    q, k, v, m = _vals(*args)
    why = attn_pass._check(q, k, v, m, 0.0, False, "cpu")
    assert why is not None and needle in why


def test_gqa_non_divisible_heads_reason():
    q, k, v, _ = _vals((1, 6, 8, 16), (1, 4, 8, 16), (1, 4, 8, 16))
    why = attn_pass._check(q, k, v, None, 0.0, True, "cpu")
    assert why is not None and "multiple" in why
    q, k, v, _ = _vals((1, 8, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16))
    assert attn_pass._check(q, k, v, None, 0.0, True, "cpu") is None


def test_cost_has_no_score_matrix_bytes():
    model = SelfAttention().eval()
    inputs = _inputs(S=64)
    fused = opencann.compile(model, inputs, options=OPTS)
    plain = opencann.compile(model, inputs)
    spelled = opencann.compile(SelfAttention(explicit=True).eval(), _inputs(S=64, mask="float"))
    fa = _fa_nodes(fused)[0]
    sdpa = next(n for n in plain.graph.nodes if n.op == "ScaledDotProductAttention")
    c_fa, c_sdpa = get_op("FlashAttention").cost(fa), get_op(sdpa.op).cost(sdpa)
    B, H, S, D = (int(s) for s in fa.inputs[0].desc.shape)
    assert c_fa.flops == 4 * B * H * S * S * D
    expect = sum(v.desc.numel * v.desc.dtype.itemsize for v in fa.inputs) + \
        fa.outputs[0].desc.numel * fa.outputs[0].desc.dtype.itemsize
    assert c_fa.bytes == expect  # q, k, v, mask, out: no B·H·S·S term
    assert c_fa.bytes <= c_sdpa.bytes
    # the unfused path reads and writes the (B, H, S, S) scores several times
    unfused = sum(get_op(n.op).cost(n).bytes for n in spelled.graph.nodes
                  if n.op in ("BatchMatMul", "SoftmaxV2", "Add", "Div", "Muls"))
    assert c_fa.bytes + 4 * B * H * S * S * 4 <= unfused


def test_vnpu_head_dim_check_uses_the_unified_buffer():
    """On vnpu the tile check uses the preset's Unified Buffer (Cube fractals), not the
    host's L2: D=4096 cannot tile in 192 KiB and is reported, D=64 fuses."""
    class A(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    for d, fused in ((64, True), (4096, False)):
        q = torch.randn(1, 1, 32, d)
        rep = opencann.compile(A(), (q, q, q), device="vnpu:ascend910b",
                               options={"enable": ["fuse_flash_attention"]}).report
        assert ("FlashAttention" in rep.op_counts_after) == fused
        if not fused:
            assert any("Unified Buffer" in s["reason"] for s in rep.skipped)
