"""The norm rewrites keep eager's NaN, ±inf and overflow: a spelled-out RMSNorm or
LayerNorm, and a residual Add + LayerNorm, compiled, give eager's result on rows holding
NaN, ±inf or huge values, in float32 and bfloat16, alone and after a Linear.

Found by bench/special_values_audit.py: eager's ``x.mean()`` sums a row of 3e38 to inf and
the spelled-out LayerNorm gives NaN there, ATen's ``native_layer_norm`` (Welford) gave
finite values; ``x.var()`` accumulates in float64 where ATen's LayerNorm overflows past
|x| ≈ 1e19 and gives β (eager 9.95, fused 0); the AddLayerNorm kernel summed in float64
(eager β, fused 8.9). The LayerNorm fusion now falls back to the formula's ops wherever
ATen's statistics leave the range where both agree (`ops.parity.norm_range`), the
AddLayerNorm kernel to ATen's add + layer_norm, and both norm fusions ask the probe of
this CPU first (a simulated faulty kernel stands in for a CPU whose kernel differs)."""
import pytest
import torch

import opencann
from opencann.ops import parity
from opencann.ops.parity import formulas, norm_range, norms
from opencann.ops.kernels import cpu_patterns

NAN, INF = float("nan"), float("inf")
D = 100                                   # a vector body and a tail on AVX2 and AVX-512
SPECIALS = (NAN, INF, -INF, 3e38, -3e38, 1e13, -1e13, 1e20, -1e20)


def rows(d=D, seed=0):
    """[R, d]: each special at the head, the body and the tail of a randn row; rows of
    ±3e38 and 1e19; two 3e38 in one row; clean rows."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for v in SPECIALS:
        for p in (0, d // 2 - 13, d - 1):
            r = torch.randn(d, generator=g)
            r[p] = v
            out.append(r)
    for v in (3e38, -3e38, 1e19):
        out.append(v * (1 + 0.01 * torch.rand(d, generator=g)))
    r = torch.randn(d, generator=g)
    r[[1, d - 2]] = 3e38
    out += [r] + [torch.randn(d, generator=g) for _ in range(3)]
    return torch.stack(out)


def ln_pow(m, x):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + 1e-5) * m.g + m.b


def ln_var(m, x):
    mu = x.mean(-1, keepdim=True)
    return (x - mu) * torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5)


def rms(m, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * m.g


def rms_casts(m, x):          # transformers' LlamaRMSNorm
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return m.g * h.to(x.dtype)


FORMS = {"ln_pow": (ln_pow, "fuse_layer_norm", "layer_norm"),
         "ln_var": (ln_var, "fuse_layer_norm", "layer_norm"),
         "rms": (rms, "fuse_rms_norm", "rms_norm"),
         "rms_casts": (rms_casts, "fuse_rms_norm", "rms_norm")}


class Norm(torch.nn.Module):
    """``form(pre(x))``, pre a Linear(D, D) or nothing; γ, β of shape [D]."""

    def __init__(self, form, linear=False, gamma=None):
        super().__init__()
        torch.manual_seed(0)
        self.pre = torch.nn.Linear(D, D) if linear else torch.nn.Identity()
        self.g = torch.nn.Parameter(1 + 0.1 * torch.randn(D) if gamma is None else gamma)
        self.b = torch.nn.Parameter(0.1 * torch.randn(D))
        self.form = form

    def forward(self, x):
        return self.form(self, self.pre(x))


class AddLN(torch.nn.Module):
    """nn.LayerNorm(a + pre(a)): fuse_add_layer_norm's pattern."""

    def __init__(self, linear=False):
        super().__init__()
        torch.manual_seed(0)
        self.pre = torch.nn.Linear(D, D) if linear else torch.nn.Identity()
        self.ln = torch.nn.LayerNorm(D)
        with torch.no_grad():
            self.ln.weight.normal_(1, 0.1)
            self.ln.bias.normal_(0, 0.1)

    def forward(self, x):
        return self.ln(x + self.pre(x) * 0.5)


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


def check(got, want):
    """Eager's NaN positions and infinities exactly; finite values within rounding (1e-5
    in float32, a few bfloat16 ulps: eager rounds after every op, the kernel once)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan()), \
        f"NaN positions differ in rows {torch.nonzero((got.isnan() != want.isnan()).any(-1)).flatten().tolist()}"
    inf = want.isinf()
    assert torch.equal(got.isinf(), inf) and torch.equal(got[inf], want[inf]), "inf differs"
    tol = 1e-5 if got.dtype == torch.float32 else 4e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)


def compile_and_check(m, dtype=torch.float32, options=None):
    """Compile ``m`` (in ``dtype``) on clean rows, then compare with eager on the special
    rows and clean ones, twice each; an earlier result must not change."""
    m = m.to(dtype).eval()
    x = torch.randn(len(rows()), D, generator=torch.Generator().manual_seed(5)).to(dtype)
    cm = opencann.compile(m, (x,), options=dict(options or {}, verify=True))
    with torch.no_grad():
        for inp in (rows().to(dtype), x, rows(seed=1).to(dtype)):
            first = cm(inp)
            keep = first.clone()
            check(first, m(inp))
            check(cm(inp), m(inp))
            torch.testing.assert_close(first, keep, rtol=0, atol=0, equal_nan=True)
    return cm


def fired(cm, pass_name):
    return [a for a in cm.report.applied if a["pass"] == pass_name]


# -- on this CPU, whatever it is ------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("linear", [False, True], ids=["alone", "after_linear"])
@pytest.mark.parametrize("form", list(FORMS))
def test_norm_fusions_match_eager_at_nan_inf_and_overflow(form, linear, dtype, fresh_probe):
    """Each spelled-out norm: eager's NaN, ±inf and overflowed rows (a row of 3e38 is NaN,
    1e20 overflows (x − μ)² and gives β), fused where this CPU's probe allows it."""
    f, pass_name, kind = FORMS[form]
    cm = compile_and_check(Norm(f, linear), dtype)
    computes_in = torch.float32 if form == "rms_casts" else dtype
    assert bool(fired(cm, pass_name)) is (parity.special_values_differ(kind, computes_in) is None)


@pytest.mark.parametrize("linear", [False, True], ids=["alone", "after_linear"])
def test_add_layer_norm_matches_eager_at_nan_inf_and_overflow(linear):
    """The AddLayerNorm kernel (float64 sums) hands rows where ATen's LayerNorm overflows
    or meets NaN/inf to eager's add + layer_norm."""
    cm = compile_and_check(AddLN(linear), options={"enable": ["fuse_add_layer_norm"]})
    assert fired(cm, "fuse_add_layer_norm")


def test_add_layer_norm_with_a_gamma_holding_inf_matches_eager():
    """(s − μ)·rstd·γ and ATen's (x·rstd − μ·rstd)·γ meet 0·inf at different elements; the
    kernel runs ATen's add + layer_norm (eager's kernels) for such a γ."""
    m = AddLN()
    with torch.no_grad():
        m.ln.weight[3] = INF
        m.ln.weight[5] = -INF
    cm = compile_and_check(m, options={"enable": ["fuse_add_layer_norm"]})
    assert fired(cm, "fuse_add_layer_norm")


def test_layer_norm_fusion_runs_atens_kernel_on_ordinary_rows_and_the_formula_on_huge_ones(
        monkeypatch):
    calls = []
    real = cpu_patterns.layer_norm_formula
    monkeypatch.setattr(cpu_patterns, "layer_norm_formula",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    m = Norm(ln_pow).eval()
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(2)) * 100 + 1e4
    cm = opencann.compile(m, (x,))
    if not fired(cm, "fuse_layer_norm"):
        pytest.skip(parity.special_values_differ("layer_norm", torch.float32))
    with torch.no_grad():
        check(cm(x), m(x))
        assert calls == []                       # ATen's kernel: no overflow anywhere
        x[3, 7] = 3e38
        check(cm(x), m(x))
        assert calls == [1]                      # the formula's ops: eager's overflow


def test_a_gamma_holding_inf_runs_the_formula(monkeypatch):
    """ATen computes (x·rstd − μ·rstd)·γ: where eager's x − μ is 0 and γ is inf, eager
    gives NaN and ATen may give ±inf; the kernel does not use ATen's result then."""
    calls = []
    real = cpu_patterns.layer_norm_formula
    monkeypatch.setattr(cpu_patterns, "layer_norm_formula",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    gamma = 1 + 0.1 * torch.randn(D, generator=torch.Generator().manual_seed(3))
    gamma[3] = INF
    m = Norm(ln_pow, gamma=gamma).eval()
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(4))
    x[2, 3] = x[2].mean()
    cm = opencann.compile(m, (x,))
    if not fired(cm, "fuse_layer_norm"):
        pytest.skip(parity.special_values_differ("layer_norm", torch.float32))
    with torch.no_grad():
        check(cm(x), m(x))
    assert calls


def test_guard_bounds():
    """The guard's range: ordinary statistics pass, huge ones, NaN, inf, rstd = 0 do not."""
    t = torch.tensor
    assert norm_range.layer_norm_in_range(t([0.5, -3.0]), t([1.0, 0.2]), 768, torch.float32)
    assert norm_range.layer_norm_in_range(t([1e10]), t([1e-8]), 768, torch.float32)
    bound = norm_range.row_bound(768, torch.float32)
    assert 1e16 < bound < 1e18
    for mean, rstd in (([2 * bound], [1.0]), ([0.0], [0.0]), ([NAN], [1.0]), ([0.0], [NAN]),
                       ([INF], [1.0]), ([0.0], [INF]), ([0.0], [1e-17])):
        assert not norm_range.layer_norm_in_range(t(mean), t(rstd), 768, torch.float32), (mean, rstd)
    assert norm_range.affine_in_range(t([1.0, 2.0]), t([0.5, 0.0]), 768, torch.float32)
    assert norm_range.affine_in_range(None, None, 768, torch.float32)
    for w, b in (([INF], [0.0]), ([NAN], [0.0]), ([1.0], [NAN]), ([1e37], [0.0]), ([1.0], [1e38])):
        assert not norm_range.affine_in_range(t(w), t(b), 768, torch.float32), (w, b)


# -- on a CPU whose kernel differs (simulated) ----------------------------------------

def _with_kernel(monkeypatch, kind, name, fn, form):
    """Make the probe see kernel ``fn`` (named ``name``, no guard) for ``kind`` before this
    CPU's own, compared with ``form``."""
    real = norms.kernels

    def kernels(k, dtype):
        if k == kind:
            yield name, lambda x: (fn(x), None), form
        yield from real(k, dtype)
    monkeypatch.setattr(norms, "kernels", kernels)


def _rms_in_float64(monkeypatch):
    """An RMSNorm kernel that accumulates in float64: no overflow at |x| ≈ 1e20."""
    _with_kernel(monkeypatch, "rms_norm", "simulated rms_norm",
                 lambda x: torch.rms_norm(x.double(), [x.shape[-1]], None, 1e-5).to(x.dtype),
                 lambda x: formulas.rms_norm_formula(x, None, 1e-5))


def _ln_unguarded(monkeypatch):
    """ATen's LayerNorm without the guard: finite where eager's row sum overflows."""
    _with_kernel(monkeypatch, "layer_norm", "simulated layer_norm",
                 lambda x: torch.native_layer_norm(x, [x.shape[-1]], None, None, 1e-5)[0],
                 lambda x: formulas.layer_norm_formula(x, 1, None, None, 1e-5))


SIMULATED = {"rms_norm": _rms_in_float64, "layer_norm": _ln_unguarded}


@pytest.mark.parametrize("kind", list(SIMULATED))
def test_probe_names_a_kernel_that_overflows_elsewhere(kind, monkeypatch, fresh_probe):
    SIMULATED[kind](monkeypatch)
    why = parity.special_values_differ(kind, torch.float32)
    assert why.startswith(f"simulated {kind} gives {kind}(a row with 3e+38 at 0)[0] = "), why
    why = parity.special_values_differ(kind, torch.bfloat16)    # a row of huge values, at least
    assert why.startswith(f"simulated {kind} gives {kind}(a row ") and "3e+38" in why, why
    assert "on this CPU where the spelled-out formula gives" in why and "\n" not in why


def test_probe_reports_a_norm_kernel_that_raises(monkeypatch, fresh_probe):
    def raises(x):
        raise RuntimeError("no kernel for this dtype\nsecond line")
    _with_kernel(monkeypatch, "rms_norm", "broken rms_norm", raises, None)
    assert parity.special_values_differ("rms_norm", torch.bfloat16) == \
        "broken rms_norm fails for torch.bfloat16 on this CPU (no kernel for this dtype)"
    with pytest.raises(KeyError):
        norms.norm_differs("group_norm", torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", list(FORMS))
def test_norm_is_kept_spelled_out_where_the_kernel_differs(form, dtype, monkeypatch,
                                                            fresh_probe):
    f, pass_name, kind = FORMS[form]
    SIMULATED[kind](monkeypatch)
    cm = compile_and_check(Norm(f, linear=True), dtype)
    assert not fired(cm, pass_name)
    reasons = [s["reason"] for s in cm.report.skipped if s["pass"] == pass_name]
    assert reasons and reasons[0].startswith(f"simulated {kind} gives {kind}(a row ")
    assert reasons[0].endswith(": the spelled-out form is kept")
    ops = cm.report.op_counts_after
    assert "RmsNorm" not in ops and "LayerNormFormula" not in ops
    assert "Rsqrt" in ops or "Sqrt" in ops
    assert "formula_kernels" not in cm.graph.meta


# -- model files: a norm fusion made on one CPU is not run where its kernel differs ---

@pytest.mark.parametrize("form", ["ln_pow", "rms", "rms_casts"])
def test_model_file_with_a_norm_fusion_is_refused_where_the_kernel_differs(
        form, tmp_path, monkeypatch, fresh_probe):
    f, pass_name, kind = FORMS[form]
    dtype = torch.bfloat16 if form == "rms_casts" else torch.float32
    m = Norm(f, linear=True).to(dtype).eval()
    x = rows().to(dtype)
    cm = opencann.compile(m, (x,))
    if not fired(cm, pass_name):
        pytest.skip(f"{kind} is not fused on this CPU")
    assert [kind, "float32"] in cm.graph.meta["formula_kernels"]    # casts: float32 inside
    path = str(tmp_path / "m.ocm")
    opencann.save(cm, path)
    with torch.no_grad():
        check(opencann.load(path)(x), m(x))           # the same CPU: loads and runs
    fresh_probe()
    SIMULATED[kind](monkeypatch)
    with pytest.raises(opencann.ModelFileError) as e:
        opencann.load(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(
        f"m.ocm runs a spelled-out {kind} (float32) as one kernel, but simulated {kind} gives")
    assert msg.endswith("recompile the model on this machine")
