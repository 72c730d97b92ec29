"""NaN/Inf semantics of fused kernels match eager PyTorch.

Every fused kernel opencann owns or calls (oneDNN conv post-ops, Conv+Add in place,
BatchNorm folding, GEMM + in-place activation, FlashAttention: numba, Triton under
the interpreter, float64 reference, and the compiled SDPA / spelled-out attention
paths) must give eager's values, including where NaN and +-inf sit. Inputs carry one
special value each (NaN, +-inf, +-1e30) so that the rest of the output stays finite
and is checked too. Comparisons: ``torch.testing.assert_close(equal_nan=True)`` plus
an explicit check that NaN positions are equal; infinities must match exactly.

Eager semantics pinned here (torch's CPU SDPA): a row that sees no key (all False /
all -inf) gives 0; a NaN or +inf score (NaN in q or a visible key, NaN or +inf in the
mask) makes its row NaN; a NaN key hidden by the causal mask stays out; a row of
``finfo(float32).min`` mask entries is the uniform average of v. The spelled-out
``softmax(q kᵀ s + mask) v`` gives NaN for a row that sees no key (softmax of -inf).
Sequence lengths are multiples of 16: torch's CPU flash kernel drops a NaN from its
row max in its scalar tail loop (S not a multiple of the vector width), a quirk not
copied.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import opencann
from opencann.devices import cpu as cpu_device
from opencann.ops.kernels import cpu as cpu_kernels
from opencann.ops.flash_attention import flash_attention, flash_attention_forward
from helpers import REPO

NAN, INF = float("nan"), float("inf")
FMIN = torch.finfo(torch.float32).min
SPECIALS = {"nan": NAN, "inf": INF, "-inf": -INF, "big": 1e30, "-big": -1e30}


def check(got, want, rtol=1e-4, atol=1e-4):
    """Same NaN positions, same infinities, close elsewhere."""
    assert torch.equal(torch.isnan(got), torch.isnan(want)), \
        f"NaN positions differ: {torch.isnan(got).sum()} NaN here, {torch.isnan(want).sum()} in eager"
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)


def with_special(shape, where, value, seed=0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    x[where] = value
    return x


def run_compiled(model, inputs_list, options=None):
    """Compile on the first inputs; check every input set against eager, twice (a second
    call), and that an earlier output is not overwritten by a later call."""
    model = model.eval()
    cm = opencann.compile(model, inputs_list[0], options=options)
    kept = []
    with torch.no_grad():
        for inputs in inputs_list + inputs_list[:1]:
            want = model(*inputs)
            got = cm(*inputs)
            check(got, want)
            kept.append((got, want.clone()))
        for got, want in kept[:-1]:
            check(got, want)
    return cm


# -- convolution + activation (oneDNN post-ops) -------------------------------------

class ConvAct(torch.nn.Module):
    def __init__(self, act, bn=False):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8) if bn else torch.nn.Identity()
        if bn:
            with torch.no_grad():
                self.bn.running_mean.uniform_(-0.5, 0.5)
                self.bn.running_var.uniform_(0.5, 2.0)
                self.bn.weight.uniform_(-2, 2)
                self.bn.bias.uniform_(-1, 1)
        self.act = act

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


def _image_inputs(shape=(1, 3, 8, 8)):
    return [(with_special(shape, (0, i % shape[1], 3, 4), v, seed=i),)
            for i, v in enumerate(SPECIALS.values())]


@pytest.mark.parametrize("act", ["relu", "gelu", "silu", "sigmoid", "tanh"])
def test_conv_activation_keeps_nan_and_inf(act):
    fn = {"relu": torch.relu, "gelu": F.gelu, "silu": F.silu, "sigmoid": torch.sigmoid,
          "tanh": torch.tanh}[act]
    cm = run_compiled(ConvAct(fn), _image_inputs())
    assert "ConvBiasAct" in cm.graph.op_counts()


def test_conv_bn_relu_keeps_nan_and_inf():
    cm = run_compiled(ConvAct(torch.relu, bn=True), _image_inputs())
    assert "BatchNorm" not in cm.graph.op_counts()


def test_folded_batchnorm_with_nan_statistics():
    """NaN in running_var / weight / mean of one channel: that channel is NaN, as eager."""
    model = ConvAct(torch.relu, bn=True)
    with torch.no_grad():
        model.bn.running_var[2] = NAN
        model.bn.weight[3] = NAN
        model.bn.running_mean[5] = NAN
    run_compiled(model, [(torch.randn(1, 3, 8, 8),)])


class ConvAddRelu(torch.nn.Module):
    """relu(conv(x) + r): r a graph input (out-of-place sum) or a conv output (in place)."""

    def __init__(self, inplace_addend):
        super().__init__()
        torch.manual_seed(0)
        self.c0 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.c1 = torch.nn.Conv2d(8, 8, 1)
        self.inplace_addend = inplace_addend

    def forward(self, x):
        r = self.c1(x) if self.inplace_addend else x
        return torch.relu(self.c0(x) + r)


@pytest.mark.parametrize("inplace_addend", [True, False])
def test_conv_add_relu_keeps_nan_and_inf(inplace_addend):
    cm = run_compiled(ConvAddRelu(inplace_addend), _image_inputs((1, 8, 6, 6)))
    nodes = [n for n in cm.graph.nodes if n.op == "ConvAddAct"]
    assert nodes and nodes[0].attrs["act"] == "relu"
    assert nodes[0].attrs["inplace"] is inplace_addend


# -- linear + activation (GEMM, activation in place) --------------------------------

@pytest.mark.parametrize("kernel", ["addmm", "mkl_packed", "onednn_packed", "onednn_plain", "gemv"])
@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh"])
def test_linear_activation_keeps_nan_and_inf(act, kernel, monkeypatch):
    if kernel == "mkl_packed" and not cpu_device.mkl_packed_available():
        pytest.skip("MKL packed GEMM not in this torch build")
    if kernel.startswith("onednn") and not cpu_device.onednn_linear_available():
        pytest.skip("oneDNN prepacked inner product not in this torch build")
    fn = {"relu": torch.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
          "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh}[act]
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 24)
    model = torch.nn.Sequential(lin, type("Act", (torch.nn.Module,), {"forward": lambda s, t: fn(t)})())
    from helpers import ForcedGemmChoice   # here: a subprocess test imports this module alone
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", ForcedGemmChoice(kernel))
    rows = 5                               # the decode GEMV serves 1..8 rows: its 8-row tile
    inputs = [(with_special((rows, 16), (2, 7), v, seed=i),) for i, v in enumerate(SPECIALS.values())]
    cm = run_compiled(model, inputs)
    assert "LinearAct" in cm.graph.op_counts()
    assert [n.meta["kernel"] for n in cm.graph.nodes if n.op == "LinearAct"] == [kernel]


# -- FlashAttention -----------------------------------------------------------------

B, H, S, D = 1, 2, 64, 16


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=g) for _ in range(3)]


def _set(t, idx, val):
    t = t.clone()
    t[idx] = val
    return t


def _mask(rows=None, cols=None, value=0.0, dtype=torch.float32):
    if dtype == torch.bool:
        m = torch.ones(S, S, dtype=torch.bool)
        m[rows if rows is not None else slice(None), cols if cols is not None else slice(None)] = value
        return m
    m = torch.zeros(S, S)
    m[rows if rows is not None else slice(None), cols if cols is not None else slice(None)] = value
    return m


def _attention_cases():
    q, k, v = _qkv()
    yield "nan_q", dict(q=_set(q, (0, 0, 5, 3), NAN), k=k, v=v)
    yield "nan_q_row0_causal", dict(q=_set(q, (0, 1, 0, 3), NAN), k=k, v=v, causal=True)
    yield "nan_k", dict(q=q, k=_set(k, (0, 0, 40, 3), NAN), v=v)
    yield "nan_k_hidden_by_causal", dict(q=q, k=_set(k, (0, 0, 40, 3), NAN), v=v, causal=True)
    yield "inf_k", dict(q=q, k=_set(k, (0, 1, 9, 0), INF), v=v)
    yield "nan_v", dict(q=q, k=k, v=_set(v, (0, 0, 0, 3), NAN), causal=True)
    yield "huge_q_row", dict(q=_set(q, (0, 0, 5), q[0, 0, 5] * 1e4), k=k, v=v)
    for name, val in (("nan", NAN), ("inf", INF), ("-inf", -INF), ("finfo_min", FMIN)):
        yield f"mask_entry_{name}", dict(q=q, k=k, v=v, mask=_mask(5, 7, val))
        yield f"mask_row_{name}", dict(q=q, k=k, v=v, mask=_mask(5, None, val))
    yield "mask_finfo_min_half", dict(q=q, k=k, v=v, mask=_mask(None, slice(S // 2, None), FMIN))
    yield "mask_finfo_min_causal", dict(q=q, k=k, v=v, mask=_mask(7, None, FMIN), causal=True)
    yield "bool_row_masked", dict(q=q, k=k, v=v, mask=_mask(5, None, False, torch.bool))
    yield "bool_row_masked_causal", dict(q=q, k=k, v=v, mask=_mask(20, None, False, torch.bool),
                                         causal=True)


CASES = list(_attention_cases())


def _eager(c):
    return F.scaled_dot_product_attention(c["q"], c["k"], c["v"], attn_mask=c.get("mask"),
                                          is_causal=c.get("causal", False))


@pytest.mark.parametrize("tiles", [(16, 16), None])
@pytest.mark.parametrize("backend", ["numba", "reference"])
@pytest.mark.parametrize("name,case", CASES, ids=[c[0] for c in CASES])
def test_flash_attention_matches_sdpa(name, case, backend, tiles):
    want = _eager(case)
    got = flash_attention(case["q"], case["k"], case["v"], attn_mask=case.get("mask"),
                          causal=case.get("causal", False), backend=backend, tiles=tiles)
    check(got, want)
    if name in ("mask_row_finfo_min",):  # uniform average over the keys
        torch.testing.assert_close(got[0, :, 5], case["v"][0].mean(1))
    if name.startswith("bool_row_masked") or name == "mask_row_-inf":
        assert (got[..., 5 if "causal" not in name else 20, :] == 0).all()


def test_flash_attention_forward_lse_nan_and_masked():
    q, k, v = _qkv()
    m = _mask(5, None, False, torch.bool)
    out, lse = flash_attention_forward(_set(q, (0, 0, 9, 0), NAN), k, v, attn_mask=m, tiles=(16, 16))
    assert torch.isnan(lse[0, 0, 9]) and torch.isnan(out[0, 0, 9]).all()
    assert (lse[:, :, 5] == -INF).all() and (out[:, :, 5] == 0).all()
    assert torch.isfinite(lse[0, 1]).sum() == S - 1


class SDPA(torch.nn.Module):
    def __init__(self, causal=False):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)


class SpelledOut(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return torch.softmax(q @ k.transpose(-2, -1) * D ** -0.5 + mask, dim=-1) @ v


OPTS = {"enable": ["fuse_flash_attention"]}


@pytest.mark.parametrize("causal,mask_dtype", [(False, None), (True, None),
                                                (False, torch.float32), (False, torch.bool)])
def test_compiled_sdpa_flash_attention_matches_eager(causal, mask_dtype):
    def keep(c):
        m = c.get("mask")
        same_mask = (m is None) if mask_dtype is None else (m is not None and m.dtype == mask_dtype)
        return c.get("causal", False) == causal and same_mask
    cases = [c for _, c in CASES if keep(c)]
    assert cases
    inputs = [tuple(c[n] for n in ("q", "k", "v", "mask") if n in c) for c in cases]
    cm = run_compiled(SDPA(causal), inputs, options=OPTS)
    assert "FlashAttention" in cm.graph.op_counts(), str(cm.graph)


def test_compiled_spelled_out_attention_fully_masked_row_is_nan():
    """softmax of an all -inf row is NaN in eager; the fused node keeps that."""
    q, k, v = _qkv()
    inputs = [(q, k, v, c["mask"]) for n, c in CASES
              if n.startswith("mask_") and not c.get("causal")]
    assert len(inputs) == 9
    cm = run_compiled(SpelledOut(), inputs, options=OPTS)
    fa = [n for n in cm.graph.nodes if n.op == "FlashAttention"]
    assert fa and fa[0].attrs["masked_rows"] == "nan", str(cm.graph)
    with torch.no_grad():
        assert torch.isnan(cm(q, k, v, _mask(5, None, -INF))[0, :, 5]).all()


def test_spelled_out_attention_with_bool_addend_is_not_fused():
    """scores + bool tensor adds 0/1 in eager: not a keep mask, so no FlashAttention."""
    q, k, v = _qkv()
    m = torch.rand(S, S, generator=torch.Generator().manual_seed(1)) > 0.5
    cm = opencann.compile(SpelledOut().eval(), (q, k, v, m), options=OPTS)
    assert "FlashAttention" not in cm.graph.op_counts()
    assert any("bool" in s["reason"] for s in cm.report.skipped if s["pass"] == "fuse_flash_attention")
    with torch.no_grad():
        check(cm(q, k, v, m), SpelledOut()(q, k, v, m))


TRITON_SCRIPT = r"""
import json, sys, torch
import torch.nn.functional as F
sys.path[:0] = [".", "tests"]
import tests.unit.test_nan_semantics as t
from opencann.ops.flash_attention import flash_attention
from opencann.ops.flash_attention import triton_kernels  # noqa: F401 (interpreted)
res = {}
for name, c in t.CASES:
    if name not in sys.argv[1].split(","):
        continue
    want = t._eager(c)
    got = flash_attention(c["q"], c["k"], c["v"], attn_mask=c.get("mask"),
                          causal=c.get("causal", False), backend="triton", tiles=(16, 16))
    try:
        t.check(got, want)
        res[name] = "ok"
    except AssertionError as e:
        res[name] = str(e)[:300]
print("RESULT" + json.dumps(res))
"""
TRITON_CASES = ["nan_q_row0_causal", "nan_k_hidden_by_causal", "mask_entry_nan", "mask_row_inf",
                "mask_row_finfo_min", "bool_row_masked"]


def test_triton_flash_attention_matches_sdpa_interpreted():
    pytest.importorskip("triton")
    root = str(REPO)
    p = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, ",".join(TRITON_CASES)],
                       env=dict(os.environ, TRITON_INTERPRET="1"), cwd=root,
                       capture_output=True, text=True, timeout=600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
    assert p.returncode == 0 and lines, f"interpreter run failed:\n{p.stdout}\n{p.stderr[-3000:]}"
    res = json.loads(lines[-1][len("RESULT"):])
    assert res == {n: "ok" for n in TRITON_CASES}
