"""Pattern fusions end to end (issue #16 item 2): SiLU, Linear+SiLU, spelled-out tanh and
erf GELU, Llama RMSNorm, hand-written LayerNorm and the gated MLP each fire on a small
module and the compiled model matches eager PyTorch: values within 1e-6 relative (plus
1e-6 absolute: the fused kernels round differently, see each pass's docstring), NaN and
±inf at eager's positions, the same result on a second call, outputs that do not alias
each other or the arena between calls. Near misses are checked in test_pass_golden.py."""
import math

import pytest
import torch

import opencann
from opencann.ops.parity import special_values_differ

G = torch.Generator().manual_seed(0)
# the formula each fusion rewrites to a kernel: skipped (with the probe's reason) on a CPU
# whose kernels of it put NaN/±inf elsewhere than the formula (oneDNN's AVX-512 GELU), or
# overflow elsewhere (a norm; tests/unit/test_norm_special_values.py)
ACT_OF = {"fuse_silu": "silu", "fuse_gelu_tanh": "gelu_tanh", "fuse_gelu_erf": "gelu",
          "fuse_rms_norm": "rms_norm", "fuse_layer_norm": "layer_norm"}


def kernel_differs(pass_name, dtype=torch.float32):
    """The probe's reason when ``pass_name`` must not fire on this CPU, else None."""
    return special_values_differ(ACT_OF[pass_name], dtype) if pass_name in ACT_OF else None


class Fn(torch.nn.Module):
    """``f(self, x)`` with a weight ``w`` and a bias ``b`` of the last dim (8)."""

    def __init__(self, f, d=8):
        super().__init__()
        self.f = f
        self.w = torch.nn.Parameter(torch.randn(d, generator=G))
        self.b = torch.nn.Parameter(torch.randn(d, generator=G))
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        return self.f(self, x)


def silu_ab(s, x):
    return x * torch.sigmoid(x)


def silu_ba(s, x):
    return torch.sigmoid(x) * x


def linear_silu(s, x):
    h = s.lin(x)
    return h * torch.sigmoid(h)


def gelu_tanh(s, x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_erf(s, x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def rms_norm(s, x):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return s.w * h.to(x.dtype)


def layer_norm(s, x):
    u = x.mean(-1, keepdim=True)
    v = (x - u).pow(2).mean(-1, keepdim=True)
    return s.w * ((x - u) / torch.sqrt(v + 1e-5)) + s.b


def gated_mlp(s, x):
    return torch.nn.functional.silu(x @ s.lin.weight.t()) * (x @ s.lin.weight)


CASES = [(silu_ab, "fuse_silu"), (silu_ba, "fuse_silu"), (linear_silu, "fuse_linear_act"),
         (gelu_tanh, "fuse_gelu_tanh"), (gelu_erf, "fuse_gelu_erf"), (rms_norm, "fuse_rms_norm"),
         (layer_norm, "fuse_layer_norm"), (gated_mlp, "fuse_gated_mlp")]


def close(got, want):
    """Values within 1e-6 relative + 1e-6 absolute; NaN and ±inf where eager has them."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN positions differ"
    inf = torch.isinf(want)
    assert torch.equal(torch.isinf(got), inf) and torch.equal(got[inf], want[inf]), "inf differs"
    ok = ~torch.isnan(want) & ~inf
    torch.testing.assert_close(got[ok], want[ok], rtol=1e-6, atol=1e-6)


def special(x):
    x = x.clone()
    x[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    x[1, 2, 4] = 1e-40
    return x


@pytest.mark.parametrize("f,pass_name", CASES, ids=[c[0].__name__ for c in CASES])
def test_pattern_fires_and_matches_eager(f, pass_name):
    m = Fn(f).eval()
    x = torch.randn(2, 3, 8, generator=G) * 3
    cm = opencann.compile(m, (x,), options={"verify": True})
    applied = [a for a in cm.report.applied if a["pass"] == pass_name]
    why = kernel_differs("fuse_silu" if f is linear_silu else pass_name)
    if why:
        assert not applied and f"{why}: the spelled-out form is kept" in \
            [s["reason"] for s in cm.report.skipped]
    else:
        assert applied, [(a["pass"], a["detail"]) for a in cm.report.applied]
    if f is linear_silu and not why:
        assert applied[0]["detail"] == "Linear+bias+silu"
    with torch.no_grad():
        for inp in (x, special(x), torch.randn(2, 3, 8, generator=G)):
            first = cm(inp)
            keep = first.clone()
            close(first, m(inp))
            second = cm(inp)
            close(second, m(inp))
            torch.testing.assert_close(first, keep, rtol=0, atol=0, equal_nan=True,
                                       msg="a later call changed an earlier result")


def test_fused_gelu_is_closer_to_the_formula_than_eager_spelled_out():
    x = torch.linspace(-8, 8, 4001).reshape(1, 1, -1)
    m = Fn(gelu_tanh, 4001).eval()
    cm = opencann.compile(m, (x,))
    ref = gelu_tanh(None, x.double())
    with torch.no_grad():
        assert (cm(x).double() - ref).abs().max() <= (m(x).double() - ref).abs().max()


def test_rms_norm_with_bfloat16_casts_matches_transformers():
    m = Fn(rms_norm).eval().to(torch.bfloat16)
    x = torch.randn(2, 3, 8, generator=G).to(torch.bfloat16)
    cm = opencann.compile(m, (x,))
    if not kernel_differs("fuse_rms_norm"):     # the norm computes in float32
        assert [a["detail"] for a in cm.report.applied if a["pass"] == "fuse_rms_norm"] == \
            ["Llama RMSNorm (float32 casts)"]
    with torch.no_grad():
        assert torch.equal(cm(x), m(x))


def test_each_pattern_can_be_switched_off():
    m = Fn(gelu_tanh).eval()
    x = torch.randn(2, 3, 8, generator=G)
    cm = opencann.compile(m, (x,), options={"disable": ["fuse_gelu_tanh"]})
    assert "Gelu" not in cm.report.op_counts_after and "Tanh" in cm.report.op_counts_after


def test_llama_config_compiles_with_the_fusions_and_matches_eager():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                   use_cache=False)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 50, (1, 8), generator=G)
    cm = opencann.compile(m, (ids,), options={"verify": True})
    fired = {a["pass"] for a in cm.report.applied}
    assert "fuse_gated_mlp" in fired
    for p in ("fuse_silu", "fuse_rms_norm"):
        assert (p in fired) is not bool(kernel_differs(p)), p
    with torch.no_grad():
        torch.testing.assert_close(cm(ids)[0], m(ids).logits, rtol=1e-4, atol=1e-5)


def test_gpt2_config_fuses_the_spelled_out_gelu_into_the_linear():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    m = transformers.GPT2Model(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2,
                                                       vocab_size=50, use_cache=False)).eval()
    ids = torch.randint(0, 50, (1, 8), generator=G)
    cm = opencann.compile(m, (ids,), options={"verify": True})
    if not kernel_differs("fuse_gelu_tanh"):
        assert [a["detail"] for a in cm.report.applied if a["pass"] == "fuse_gelu_tanh"]
        assert any(a["detail"] == "Linear+bias+gelu_tanh" for a in cm.report.applied)
        assert "Tanh" not in cm.report.op_counts_after
    with torch.no_grad():
        torch.testing.assert_close(cm(ids)[0], m(ids).last_hidden_state, rtol=1e-4, atol=1e-5)


class Near(torch.nn.Module):
    """``f(self, x)`` with buffers ``bufs`` (constants of any shape and dtype)."""

    def __init__(self, f, **bufs):
        super().__init__()
        self.f = f
        for k, v in bufs.items():
            self.register_buffer(k, v)

    def forward(self, x):
        return self.f(self, x)


def _sqrt2(s, x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


# Near misses whose fused op would give another shape, dtype or value than the matched
# product (review of #16): an x of int dtype (GELU), one-element constants that broadcast
# or promote (GELU's 0.5 or 1 or √2, RMSNorm's eps), γ/β of another dtype than x
# (ATen's LayerNorm takes x's), and float16 without the float32 casts (eager's x² overflows
# past 256 where ATen's norms accumulate in float32).
NEAR = [
    ("gelu_tanh_int", gelu_tanh, torch.randint(-3, 4, (2, 3, 8), generator=G), {}, "Gelu"),
    ("gelu_erf_int", gelu_erf, torch.randint(-3, 4, (2, 3, 8), generator=G), {}, "Gelu"),
    ("gelu_half_bcast", lambda s, x: s.h * x * (1.0 + torch.erf(x / math.sqrt(2.0))),
     torch.randn(8, generator=G), {"h": torch.full((1, 1), 0.5)}, "Gelu"),
    ("gelu_half_fp64", lambda s, x: s.h * x * (1.0 + torch.erf(x / math.sqrt(2.0))),
     torch.randn(8, generator=G), {"h": torch.full((1,), 0.5, dtype=torch.float64)}, "Gelu"),
    ("gelu_one_bcast", lambda s, x: 0.5 * x * (s.one + torch.tanh(math.sqrt(2.0 / math.pi) * (
        x + 0.044715 * torch.pow(x, 3.0)))), torch.randn(8, generator=G), {"one": torch.ones(1, 1)}, "Gelu"),
    ("gelu_sqrt2_bcast", lambda s, x: 0.5 * x * (1.0 + torch.erf(x / s.r)), torch.randn(8, generator=G),
     {"r": torch.full((1, 1), math.sqrt(2.0))}, "Gelu"),
    ("rms_eps_bcast", lambda s, x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + s.e),
     torch.randn(8, generator=G), {"e": torch.full((1, 1), 1e-6)}, "RmsNorm"),
    ("rms_fp16_no_casts", lambda s, x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),
     torch.randn(2, 3, 8, generator=G).half(), {}, "RmsNorm"),
    ("ln_fp16", lambda s, x: layer_norm(s, x), torch.randn(2, 3, 8, generator=G).half(),
     {"w": torch.randn(8, generator=G).half(), "b": torch.randn(8, generator=G).half()},
     "LayerNormFormula"),
    ("ln_gamma_int", lambda s, x: layer_norm(s, x), torch.randn(2, 3, 8, generator=G),
     {"w": torch.randint(1, 4, (8,), generator=G), "b": torch.randn(8, generator=G)}, None),
    ("ln_gamma_fp16", lambda s, x: layer_norm(s, x), torch.randn(2, 3, 8, generator=G),
     {"w": torch.randn(8, generator=G).half(), "b": torch.randn(8, generator=G)}, None),
    ("ln_beta_fp16", lambda s, x: layer_norm(s, x), torch.randn(2, 3, 8, generator=G),
     {"w": torch.randn(8, generator=G), "b": torch.randn(8, generator=G).half()}, None),
    ("ln_beta_bool", lambda s, x: layer_norm(s, x), torch.randn(2, 3, 8, generator=G),
     {"w": torch.randn(8, generator=G), "b": torch.rand(8, generator=G) > 0.5}, None),
]


def _specials(x):
    if not x.is_floating_point():
        return [x]
    y = x.clone().reshape(-1)
    y[0], y[-1] = float("nan"), -float("inf")
    big = x.clone().reshape(-1)
    big[1] = 300.0            # past float16's √65504: eager's x² is inf
    return [x * 3, y.reshape(x.shape), big.reshape(x.shape)]


@pytest.mark.parametrize("name,f,x,bufs,op", NEAR, ids=[c[0] for c in NEAR])
def test_near_miss_is_not_fused_into_another_result(name, f, x, bufs, op):
    m = Near(f, **bufs).eval()
    cm = opencann.compile(m, (x,), options={"verify": True})
    if op is not None:
        assert op not in cm.report.op_counts_after, cm.report.op_counts_after
    with torch.no_grad():
        for inp in _specials(x):
            want = m(inp)
            first = cm(inp)
            keep = first.clone()
            tol = 1e-2 if want.dtype == torch.float16 else 1e-6
            assert first.shape == want.shape and first.dtype == want.dtype
            assert torch.equal(first.isnan(), want.isnan()), "NaN positions differ"
            torch.testing.assert_close(first, want, rtol=tol, atol=tol, equal_nan=True)
            torch.testing.assert_close(cm(inp), want, rtol=tol, atol=tol, equal_nan=True)
            torch.testing.assert_close(first, keep, rtol=0, atol=0, equal_nan=True,
                                       msg="a later call changed an earlier result")
