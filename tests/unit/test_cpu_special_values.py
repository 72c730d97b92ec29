"""The formula fusions (spelled-out GELU in erf and tanh form, x·sigmoid(x)) keep eager's
NaN and ±inf on every CPU: they rewrite only where this CPU's kernels of the fused op
place NaN and ±inf as the formula does (`opencann.ops.parity`).

CI found the fault this guards: on an AVX-512 machine oneDNN's exact GELU, which ATen uses
for contiguous fp32 tensors, returns NaN for +inf (pytorch/pytorch#185770), so the fused
``0.5·x·(1 + erf(x/√2))`` gave NaN where eager gave +inf. An AVX2 machine does not show
it, so a simulated kernel with that fault stands in for it here (`_with_kernel`); the
end-to-end tests at the bottom run on whatever CPU runs them and compare with eager.
The norm formulas (RMSNorm, LayerNorm) are in tests/unit/test_norm_special_values.py."""
import math

import pytest
import torch
import torch.nn.functional as F

import opencann
from opencann.ops import parity
from opencann.ops.parity import activations
from opencann.ops.parity.formulas import formula

NAN, INF = float("nan"), float("inf")


def gelu_erf(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def silu(x):
    return x * torch.sigmoid(x)


FORMS = {"gelu": (gelu_erf, "fuse_gelu_erf"), "gelu_tanh": (gelu_tanh, "fuse_gelu_tanh"),
         "silu": (silu, "fuse_silu")}


@pytest.fixture
def fresh_probe(tmp_path, monkeypatch):
    """Probe answers from this test alone: nothing in memory and an empty disk cache;
    calling the fixture's value starts afresh again (after a kernel is simulated)."""
    n = [0]

    def reset():
        n[0] += 1
        monkeypatch.setenv("OPENCANN_CACHE_DIR", str(tmp_path / f"probe-cache-{n[0]}"))
        parity.clear_memory()
    reset()
    yield reset
    parity.clear_memory()


def _with_kernel(monkeypatch, act, name, fn):
    """Make the probe see kernel ``fn`` (named ``name``) for ``act`` before this CPU's
    own (so its reason is the one reported on any CPU)."""
    real = activations.kernels

    def kernels(a, dtype):
        if a == act:
            yield name, fn
        yield from real(a, dtype)
    monkeypatch.setattr(activations, "kernels", kernels)


# the simulated kernels start from the formula, not from this CPU's F.gelu (which on an
# AVX-512 machine already maps +inf to NaN and would be reported first)
def _nan_at_posinf(x):  # oneDNN's AVX-512 exact GELU (pytorch/pytorch#185770)
    return torch.where(torch.isposinf(x), torch.full_like(x, NAN), formula(x, "gelu"))


def _zero_at_neginf(x):  # ATen's GELU after the fix proposed in pytorch/pytorch#192318
    return torch.where(torch.isneginf(x), torch.zeros_like(x), formula(x, "gelu"))


# -- the probe ----------------------------------------------------------------------

def test_probe_names_a_kernel_that_turns_posinf_into_nan(monkeypatch, fresh_probe):
    _with_kernel(monkeypatch, "gelu", "simulated AVX-512 gelu", _nan_at_posinf)
    why = parity.special_values_differ("gelu", torch.float32)
    assert why.startswith("simulated AVX-512 gelu gives gelu(inf) = nan on this CPU where "
                          "the spelled-out formula gives inf (pytorch/pytorch#185770)"), why


def test_probe_names_a_kernel_that_gives_zero_for_neginf(monkeypatch, fresh_probe):
    _with_kernel(monkeypatch, "gelu", "fixed gelu", _zero_at_neginf)
    why = parity.special_values_differ("gelu", torch.float32)
    assert why.startswith("fixed gelu gives gelu(-inf) = 0 on this CPU where the spelled-out "
                          "formula gives nan"), why


def test_probe_reports_a_kernel_that_raises(monkeypatch, fresh_probe):
    def raises(x):
        raise RuntimeError("no kernel for this dtype\nsecond line")
    _with_kernel(monkeypatch, "silu", "broken silu", raises)
    assert parity.special_values_differ("silu", torch.bfloat16) == \
        "broken silu fails for torch.bfloat16 on this CPU (no kernel for this dtype)"


def test_probe_agrees_with_atens_gelu_on_this_cpu(fresh_probe):
    """When the probe finds no difference, ATen's GELU on a contiguous tensor gives +inf for
    +inf and NaN for -inf and NaN here, as the formula does."""
    x = torch.randn(1000)
    x[[0, 500, 999]] = torch.tensor([INF, -INF, NAN])
    for act, approximate in (("gelu", "none"), ("gelu_tanh", "tanh")):
        if parity.special_values_differ(act, torch.float32) is None:
            y = F.gelu(x, approximate=approximate)
            assert y[0] == INF and y[500].isnan() and y[999].isnan()


def test_formula_is_the_spelled_out_form():
    x = torch.tensor([-3.0, -0.5, 0.0, 0.7, 2.0, INF, -INF, NAN])
    for act, (f, _) in FORMS.items():
        torch.testing.assert_close(formula(x, act), f(x), rtol=0, atol=0, equal_nan=True)
    with pytest.raises(KeyError):
        formula(x, "relu6")


# -- the fusions on a CPU whose kernel differs (simulated) --------------------------

class After(torch.nn.Module):
    """``form(layer(x))``: the spelled-out activation after a Linear, a Conv2d or nothing."""

    def __init__(self, form, layer=None):
        super().__init__()
        torch.manual_seed(0)
        self.form, self.layer = form, layer or torch.nn.Identity()

    def forward(self, x):
        return self.form(self.layer(x))


def _specials(shape, seed=0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3
    flat = x.view(-1)
    flat[:3] = torch.tensor([NAN, INF, -INF])
    flat[-1] = 1e-40
    return x


def check(got, want):
    """Eager's NaN positions and infinities exactly; values within 1e-5 (fp32) or a few bf16
    ulps (the fused op rounds once where eager rounds after every op, and a bf16 GEMM's
    accumulation order may differ by one ulp before it)."""
    assert torch.equal(got.isnan(), want.isnan()), "NaN positions differ"
    inf = want.isinf()
    assert torch.equal(got.isinf(), inf) and torch.equal(got[inf], want[inf]), "inf differs"
    tol = 1e-5 if got.dtype == torch.float32 else 4e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)


def _compile_and_check(m, x, dtype=torch.float32):
    m = m.to(dtype).eval()
    x = x.to(dtype)
    cm = opencann.compile(m, (x,), options={"verify": True})
    with torch.no_grad():
        for inp in (x, _specials(x.shape, seed=1).to(dtype)):
            first = cm(inp)
            keep = first.clone()
            check(first, m(inp))
            check(cm(inp), m(inp))
            torch.testing.assert_close(first, keep, rtol=0, atol=0, equal_nan=True)
    return cm


LAYERS = {"alone": lambda: None, "linear": lambda: torch.nn.Linear(8, 8),
          "conv": lambda: torch.nn.Conv2d(2, 2, 1)}
SHAPES = {"alone": (2, 3, 8), "linear": (4, 8), "conv": (1, 2, 4, 5)}


@pytest.mark.parametrize("where", list(LAYERS))
def test_spelled_out_gelu_is_kept_where_the_kernel_turns_inf_into_nan(where, monkeypatch,
                                                                      fresh_probe):
    _with_kernel(monkeypatch, "gelu", "simulated AVX-512 gelu", _nan_at_posinf)
    cm = _compile_and_check(After(gelu_erf, LAYERS[where]()), _specials(SHAPES[where]))
    assert not [a for a in cm.report.applied if a["pass"] == "fuse_gelu_erf"]
    reasons = [s["reason"] for s in cm.report.skipped if s["pass"] == "fuse_gelu_erf"]
    assert reasons and reasons[0].startswith("simulated AVX-512 gelu gives gelu(inf) = nan")
    assert reasons[0].endswith("(pytorch/pytorch#185770): the spelled-out form is kept")
    assert "Erf" in cm.report.op_counts_after and "Gelu" not in cm.report.op_counts_after
    assert not any(n.attrs.get("act") == "gelu" for n in cm.graph.nodes)


@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
def test_other_formula_fusions_are_kept_where_their_kernel_differs(act, monkeypatch, fresh_probe):
    _with_kernel(monkeypatch, act, f"simulated {act}",
                 lambda x: torch.where(torch.isposinf(x), torch.full_like(x, NAN), formula(x, act)))
    form, pass_name = FORMS[act]
    cm = _compile_and_check(After(form, torch.nn.Linear(8, 8)), _specials((4, 8)))
    assert not [a for a in cm.report.applied if a["pass"] == pass_name]
    assert [s for s in cm.report.skipped if s["pass"] == pass_name and
            s["reason"].startswith(f"simulated {act} gives {act}(inf) = nan")]


# -- on this CPU, whatever it is ----------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("where", list(LAYERS))
@pytest.mark.parametrize("act", list(FORMS))
def test_formula_fusions_match_eager_at_nan_and_inf_here(act, where, dtype, fresh_probe):
    """Each spelled-out form after nothing, a Linear and a Conv2d: eager's NaN and ±inf,
    fused where this CPU's kernels allow it (the report says which), kept otherwise."""
    form, pass_name = FORMS[act]
    cm = _compile_and_check(After(form, LAYERS[where]()), _specials(SHAPES[where]), dtype)
    fired = [a for a in cm.report.applied if a["pass"] == pass_name]
    assert bool(fired) is (parity.special_values_differ(act, dtype) is None)


# -- model files: a fusion made on one CPU is not run where its kernel differs -----

@pytest.mark.parametrize("act", list(FORMS))
def test_model_file_with_a_formula_fusion_is_refused_where_the_kernel_differs(
        act, tmp_path, monkeypatch, fresh_probe):
    form, pass_name = FORMS[act]
    m = After(form, torch.nn.Linear(8, 8)).eval()
    x = _specials((4, 8))
    cm = opencann.compile(m, (x,))
    if parity.special_values_differ(act, torch.float32) is not None:
        pytest.skip(f"{act} is not fused on this CPU")
    assert [act, "float32"] in cm.graph.meta["formula_kernels"]
    path = str(tmp_path / "m.ocm")
    opencann.save(cm, path)
    with torch.no_grad():
        check(opencann.load(path)(x), m(x))          # the same CPU: loads and runs
    fresh_probe()
    _with_kernel(monkeypatch, act, f"simulated {act}",
                 lambda t: torch.where(torch.isposinf(t), torch.full_like(t, NAN), formula(t, act)))
    with pytest.raises(opencann.ModelFileError) as e:
        opencann.load(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"m.ocm runs a spelled-out {act} (float32) as one "
                                               f"kernel, but simulated {act} gives {act}(inf) = nan")
    assert msg.endswith("recompile the model on this machine")


def test_model_file_without_formula_fusions_loads_anywhere(tmp_path, monkeypatch, fresh_probe):
    m = After(torch.nn.functional.gelu, torch.nn.Linear(8, 8)).eval()   # ATen's GELU, as eager
    x = _specials((4, 8))
    cm = opencann.compile(m, (x,))
    assert "formula_kernels" not in cm.graph.meta
    path = str(tmp_path / "m.ocm")
    opencann.save(cm, path)
    _with_kernel(monkeypatch, "gelu", "simulated gelu", _nan_at_posinf)
    with torch.no_grad():
        check(opencann.load(path)(x), m(x))
