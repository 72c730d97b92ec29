"""Elementwise/reduction fusion with codegen (issue #16 item 1): ``fuse_elementwise`` turns
maximal elementwise groups (+ a trailing last-dim reduction) into one ``FusedElementwise``
node whose kernel numba generates (Triton on CUDA, checked here under TRITON_INTERPRET=1).

Fused vs eager: random elementwise DAGs (hypothesis) with NaN/±inf/denormal inputs,
broadcasting, int + float and bool masks; values within 1e-6 relative (+1e-6 absolute for
cancellation; sums: 1e-6 of Σ|x|), NaN at eager's positions, a second call, outputs
independent of each other. Near misses are reported with their reasons. Sizes stay small
and programs repeat so numba compiles few kernels (each ~0.3 s)."""
import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from helpers import REPO, run_compiled

ON = {"verify": True, "enable": ["fuse_elementwise"]}
G = torch.Generator().manual_seed(0)


def _fused(graph):
    return [n for n in graph.nodes if n.op == "FusedElementwise"]


def _reasons(report):
    return [s["reason"] for s in report.skipped if s["pass"] == "fuse_elementwise"]


def _check(out, ref, sum_scale=None):
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out, ref)
    if not ref.dtype.is_floating_point:
        assert torch.equal(out, ref)
        return
    assert torch.equal(out.isnan(), ref.isnan()), (out, ref)
    fin = ~ref.isnan()
    atol = 1e-6 if sum_scale is None else 1e-6 * float(sum_scale) + 1e-6
    torch.testing.assert_close(out[fin], ref[fin], rtol=1e-6, atol=atol)


def _special(x):
    """x with NaN, ±inf and a float32 denormal at fixed positions."""
    flat = x.clone().reshape(-1)
    flat[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40])
    return flat.reshape(x.shape)


# -- random DAGs ------------------------------------------------------------------------

_UN = {"exp": torch.exp, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "neg": torch.neg,
       "abs": torch.abs, "relu": torch.relu, "sqrt_abs": lambda a: torch.sqrt(torch.abs(a)),
       "recip": torch.reciprocal}
_BIN = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
        "max": torch.maximum, "min": torch.minimum,
        "where": lambda a, b, m=None: torch.where(a > b, a, b * 0.5)}

step = st.tuples(st.sampled_from(sorted(_UN) + sorted(_BIN)), st.integers(0, 20), st.integers(0, 20))


def _program(steps, reduce):
    def f(x, y, i, m):
        pool = [x, y, i * 0.5 + x, torch.where(m, x, y)]   # broadcast, int + float, bool mask
        for name, a, b in steps:
            u, v = pool[a % len(pool)], pool[b % len(pool)]
            pool.append(_UN[name](u) if name in _UN else _BIN[name](u, v))
        out = pool[-1]
        if reduce == "sum":
            return out, out.sum(-1)
        if reduce == "amax":
            return (out.amax(-1, keepdim=True),)
        return (out,)
    return f


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate])   # shrinking re-traces: slow
@given(steps=st.lists(step, min_size=2, max_size=5), reduce=st.sampled_from([None, "sum", "amax"]),
       special=st.booleans())
def test_random_dags_match_eager(steps, reduce, special):
    g = torch.Generator().manual_seed(len(steps))
    x = torch.randn(3, 6, generator=g)
    if special:
        x = _special(x)
    y = torch.randn(6, generator=g)                       # broadcasts over x's rows
    i = torch.randint(-3, 4, (3, 6), generator=g, dtype=torch.int32)
    m = torch.rand(3, 6, generator=g) > 0.5
    f = _program(steps, reduce)
    outs, graph, _, rep = run_compiled(f, x, y, i, m, options=ON)
    ref = f(x, y, i, m)
    for o, r in zip(outs, ref):
        scale = None
        if reduce == "sum" and o.dim() == 1:
            scale = ref[0].abs().nan_to_num(0, 0, 0).sum(-1).max()
        _check(o, r, scale)


# -- end to end: one module, a second call, output independence -----------------------------

class Chain(torch.nn.Module):
    """x*sigmoid(y) + z*w, also returned summed over the last dim."""

    def forward(self, x, y, z, w):
        a = x * torch.sigmoid(y) + z * w
        return a, a.sum(-1), (a > 0).to(torch.int64) + 1


def test_chain_second_call_and_independent_outputs():
    import opencann
    xs = [torch.randn(4, 33, generator=G) for _ in range(4)]
    xs[0][1, 2] = float("nan")
    cm = opencann.compile(Chain(), tuple(xs), options={"enable": ["fuse_elementwise"]})
    assert any(n.op == "FusedElementwise" for n in cm.graph.nodes)
    first = [t.clone() for t in cm(*xs)]
    again = cm(*xs)
    for a, b, r in zip(first, again, Chain()(*xs)):
        _check(a, r)
        assert torch.equal(a.nan_to_num(7), b.nan_to_num(7))
    ptrs = [t.data_ptr() for t in again]
    assert len(set(ptrs)) == len(ptrs)
    xs2 = [torch.randn(4, 33, generator=G) for _ in range(4)]
    third = cm(*xs2)
    for a, b in zip(again, first):                       # earlier results not overwritten
        assert torch.equal(a.nan_to_num(7), b.nan_to_num(7))
    for a, r in zip(third, Chain()(*xs2)):
        _check(a, r)


def test_value_read_outside_stays_an_output():
    def f(x, y):
        a = torch.exp(x) * y
        b = a + 1.0
        return b * b, torch.matmul(a, y.t())          # a is read by the matmul too
    x, y = torch.randn(5, 5, generator=G), torch.randn(5, 5, generator=G)
    outs, graph, _, _ = run_compiled(f, x, y, options=ON)
    (node,) = _fused(graph)
    assert len(node.outputs) == 2
    for o, r in zip(outs, f(x, y)):
        _check(o, r)


def test_int_arithmetic_wraps_as_eager():
    def f(a, b):
        return (a * b + a) * 3, (a - b).abs().amax(-1)
    a = torch.randint(-2**31, 2**31 - 1, (4, 7), generator=G, dtype=torch.int32)
    b = torch.randint(-2**31, 2**31 - 1, (4, 7), generator=G, dtype=torch.int32)
    outs, graph, _, _ = run_compiled(f, a, b, options=ON)
    assert _fused(graph)
    for o, r in zip(outs, f(a, b)):
        _check(o, r)


def test_mean_and_float64():
    def f(x, y):
        return ((x - y) * (x - y)).mean(-1, keepdim=True)
    x, y = torch.randn(3, 40, dtype=torch.float64, generator=G), torch.randn(40, dtype=torch.float64, generator=G)
    outs, graph, _, _ = run_compiled(f, x, y, options=ON)
    assert _fused(graph)
    _check(outs[0], f(x, y))


def test_mean_overflows_where_eager_does():
    """ATen's float32 mean is sum (float32: a row of 1e38 sums to inf), then ÷ n; the fused
    mean sums in float64 but rounds that sum to float32 before dividing, so the row is inf
    as in eager, not 1e38 (bench/special_values_audit.py found it)."""
    def f(x):
        return (x * 0.5 + x * 0.5).mean(-1)
    x = torch.randn(4, 40, generator=torch.Generator().manual_seed(7))
    x[1] = 1e38
    x[2, 7] = 3e38
    x[3, :] = -1e37
    outs, graph, _, _ = run_compiled(f, x, options=ON)
    assert _fused(graph)
    want = f(x)
    assert want[1] == float("inf") and want[3] == float("-inf") and want[2].isfinite()
    assert torch.equal(outs[0].isinf(), want.isinf()) and outs[0][1] == want[1]
    _check(outs[0], want)


# -- near misses ---------------------------------------------------------------------------

def _near(fn, *xs, options=ON, check=True):
    """Compile ``fn``; (graph, fuse_elementwise's skip reasons); values checked against eager."""
    outs, graph, _, rep = run_compiled(fn, *xs, options=options)
    if check:
        ref = fn(*xs)
        for o, r in zip(outs, ref if isinstance(ref, tuple) else (ref,)):
            assert torch.allclose(o.float(), r.float(), rtol=1e-3, atol=1e-3, equal_nan=True)
    return graph, _reasons(rep)


def test_random_op_never_fuses():
    def f(x, y):
        return (x * y + torch.rand_like(x)) * y
    graph, why = _near(f, torch.randn(4, 8), torch.randn(4, 8), check=False)
    assert any("random: random ops never fuse" in r for r in why), why
    rnd = [n for n in graph.nodes if n.op != "FusedElementwise"]
    assert rnd and all(n.outputs[0] in f_.inputs for f_ in _fused(graph) for n in rnd)


def test_view_in_the_middle_ends_the_group():
    def f(x, y):
        return (torch.exp(x) * y).reshape(8, 4) + 1.0
    graph, why = _near(f, torch.randn(4, 8), torch.randn(4, 8))
    assert any("is a view" in r for r in why), why
    assert not any(set(n.attrs["ops"]) >= {"Exp", "Add"} for n in _fused(graph))


def test_float16_is_not_fused_and_says_why():
    def f(x, y):
        return x * torch.sigmoid(y) + y
    graph, why = _near(f, torch.randn(4, 8).half(), torch.randn(4, 8).half())
    assert not _fused(graph)
    assert any("dtype float16" in r for r in why), why


def test_single_op_is_left_to_aten():
    graph, why = _near(lambda x, y: x + y, torch.randn(4, 8), torch.randn(4, 8))
    assert not _fused(graph)
    assert any("single fusable op" in r for r in why), why


def test_off_on_cpu_by_default():
    outs, graph, _, rep = run_compiled(lambda x, y: torch.exp(x) * y + 1.0, torch.randn(4, 8), torch.randn(4, 8),
                                       options={"verify": True})
    assert not _fused(graph)
    rec = next(p for p in rep.passes if p.name == "fuse_elementwise")
    assert "off on cpu by default" in (rec.note or "")


def test_disable_switches_it_off():
    opts = {"verify": True, "enable": ["fuse_elementwise"], "disable": ["fuse_elementwise"]}
    outs, graph, _, rep = run_compiled(lambda x: torch.exp(x) + 1.0, torch.randn(3), options=opts)
    assert not _fused(graph)
    assert not next(p for p in rep.passes if p.name == "fuse_elementwise").enabled


# -- vnpu: one Vector kernel, HBM once -------------------------------------------------------

class Ew(torch.nn.Module):
    def forward(self, x, y, z, w):
        return x * torch.sigmoid(y) + z * w


def test_vnpu_estimate_reads_and_writes_hbm_once():
    from opencann.tools.estimate import estimate
    xs = tuple(torch.randn(64, 1024) for _ in range(4))
    on = estimate(Ew(), xs, device="vnpu:ascend910b")
    rows = [r for r in on.rows if r.op == "FusedElementwise"]
    assert len(rows) == 1 and len([r for r in on.rows if r.time_us > 0]) == 1
    assert rows[0].hbm_bytes == 5 * 64 * 1024 * 4          # 4 inputs read, 1 output written
    assert on.hbm_bytes_fused < on.hbm_bytes_unfused and on.time_us_fused < on.time_us_unfused


# -- Triton under the interpreter ---------------------------------------------------------------

TRITON_SCRIPT = r"""
import json, torch
from opencann.ops.fused_elementwise import run_fused
from opencann.ops.kernels.ew_program import Program
g = torch.Generator().manual_seed(0)
x, y, z = torch.randn(5, 37, generator=g), torch.randn(37, generator=g), torch.randn(5, 37, generator=g)
x[0, 0] = float("nan"); x[1, 1] = float("inf")
p = Program.from_attrs({"program": [
    ["t0", "float32", "a0 * (lit_float32(1.0) / (lit_float32(1.0) + exp(-(a1))))"],
    ["t1", "float32", "maximum(t0, a2) - lit_float32(0.5)"]], "outputs": ["t1", "r"],
    "reduce": ["amax", "t1", "float32", False]})
e1 = torch.maximum(x * torch.sigmoid(y), z) - 0.5
o1, r1 = run_fused(p, [x, y, z], [torch.float32, torch.float32], backend="triton")
q = Program.from_attrs({"program": [["t0", "float32", "a0 * a1"]], "outputs": ["r"],
    "reduce": ["sum", "t0", "float32", True]})
r2 = run_fused(q, [z, y], [torch.float32], backend="triton")
i = torch.randint(-5, 5, (5, 37), generator=g, dtype=torch.int32)
w = Program.from_attrs({"program": [
    ["t0", "bool", "a0 > lit_float32(0.0)"],
    ["t1", "float32", "where(t0, tanh(a0), erf(a1)) + cast_float32(a2 * lit_int32(3))"],
    ["t2", "int32", "a2 * a2 - lit_int32(1)"]], "outputs": ["t1", "t2"], "reduce": None})
o3, o4 = run_fused(w, [x, z, i], [torch.float32, torch.int32], backend="triton")
e3 = torch.where(x > 0, torch.tanh(x), torch.erf(z)) + i * 3
def err(a, b):
    ok = torch.equal(a.isnan(), b.isnan())
    f = ~b.isnan() & b.isfinite()
    return [ok, float((a[f] - b[f]).abs().max() / b[f].abs().max())]
print(json.dumps({"ew": err(o1, e1), "amax": err(r1, e1.amax(-1)), "sum": err(r2, (z * y).sum(-1, keepdim=True)),
                  "where_int": err(o3, e3), "int": [torch.equal(o4, i * i - 1), 0.0]}))
"""


def test_triton_kernel_under_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = str(REPO)
    r = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], env=env, cwd=root, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for name, (nan_ok, rel) in res.items():
        assert nan_ok and rel < 1e-6, (name, res)


def test_parallel_rows_and_strided_inputs():
    """A domain of ≥ PARALLEL_MIN elements runs rows in parallel (prange); a transposed
    (strided) and a broadcast input are read in place."""
    from opencann.ops.fused_elementwise import run_fused
    from opencann.ops.kernels.ew_numba import PARALLEL_MIN
    from opencann.ops.kernels.ew_program import Program
    p = Program.from_attrs({"program": [["t0", "float32", "a0 * a1"], ["t1", "float32", "t0 + a2"]],
                            "outputs": ["t1", "r"], "reduce": ["amax", "t1", "float32", True]})
    x = torch.randn(300, 200, generator=G).t()             # strided: inner stride 200
    y, z = torch.randn(300, generator=G), torch.randn(200, 1, generator=G)
    assert x.numel() >= PARALLEL_MIN
    x[3, 4] = float("nan")
    out, red = run_fused(p, [x, y, z], [torch.float32, torch.float32])
    ref = x * y + z
    _check(out, ref)
    _check(red, ref.amax(-1, keepdim=True))


def test_model_file_round_trip(tmp_path):
    """A compiled model with a FusedElementwise node saves and loads (attrs are plain
    lists); the loaded model gives the same values."""
    import opencann
    xs = tuple(torch.randn(4, 33, generator=G) for _ in range(4))
    cm = opencann.compile(Chain(), xs, options={"enable": ["fuse_elementwise"]})
    path = str(tmp_path / "m.ocm")
    opencann.save(cm, path)
    lm = opencann.load(path)
    assert any(n.op == "FusedElementwise" for n in lm.graph.nodes)
    for a, b in zip(lm(*xs), cm(*xs)):
        assert torch.equal(a.nan_to_num(7), b.nan_to_num(7))


class Masked(torch.nn.Module):
    def forward(self, x, y):
        return torch.where(x > y, x * 2.0, y - 1.0) + (x != x).to(torch.float32)


def test_dynamic_shapes():
    """Symbolic dims: the kernel takes its sizes from the tensors of each call."""
    import opencann
    x, y = torch.randn(2, 8, generator=G), torch.randn(2, 8, generator=G)
    cm = opencann.compile(Masked(), (x, y), dynamic_shapes={"x": {0: "b"}, "y": {0: "b"}},
                          options={"enable": ["fuse_elementwise"]})
    assert any(a["pass"] == "fuse_elementwise" for a in cm.report.applied)
    for n in (2, 5):
        a, b = torch.randn(n, 8, generator=G), torch.randn(n, 8, generator=G)
        out = cm(a, b)
        _check(out[0] if isinstance(out, tuple) else out, Masked()(a, b))


def test_fastmath_is_an_option():
    """``fuse_elementwise_fastmath`` compiles with fast-math (off by default); a non-bool
    value is one clear error."""
    import opencann
    xs = tuple(torch.randn(4, 33, generator=G) for _ in range(4))
    cm = opencann.compile(Chain(), xs, options={"enable": ["fuse_elementwise"],
                                                "fuse_elementwise_fastmath": True})
    nodes = [n for n in cm.graph.nodes if n.op == "FusedElementwise"]
    assert nodes and all(n.attrs["fastmath"] is True for n in nodes)
    for a, r in zip(cm(*xs), Chain()(*xs)):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="fuse_elementwise_fastmath"):
        opencann.compile(Chain(), xs, options={"fuse_elementwise_fastmath": 1})


def test_int64_amax_and_amin_reach_the_extremes():
    from opencann.ops.fused_elementwise import run_fused
    from opencann.ops.kernels.ew_program import Program
    lo, hi = torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max
    x = torch.tensor([[lo, lo], [hi, hi], [3, -4]], dtype=torch.int64)
    for kind, ref in (("amax", x.abs().amax(-1)), ("amin", x.abs().amin(-1))):
        p = Program.from_attrs({"program": [["t0", "int64", "abs(a0)"]], "outputs": ["r"],
                                "reduce": [kind, "t0", "int64", False]})
        assert torch.equal(run_fused(p, [x], [torch.int64]), ref)


def test_empty_domain():
    """Batch 0 and empty rows: nothing computed; a sum over empty rows is 0, a mean NaN
    (as eager)."""
    def f(x, y):
        a = torch.exp(x) * y
        return a, a.sum(-1), (x * y).mean(-1)
    for shape in ((0, 5), (3, 0)):
        x, y = torch.randn(shape, generator=G), torch.randn(shape, generator=G)
        outs, graph, _, _ = run_compiled(f, x, y, options=ON)
        for o, r in zip(outs, f(x, y)):
            _check(o, r)
