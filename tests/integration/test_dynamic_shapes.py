"""Dynamic shapes (#12): one capture and one optimisation, a memory plan per concrete
shape on its first call (bounded LRU), values matching eager within 1e-4 at every
shape (random non-zero inputs, NaN positions, a second call, output independence),
and one clear error for a shape outside the declared range."""
import logging
import math
import threading

import pytest

import torch
import torch.utils._pytree as pytree

import opencann
from opencann import zoo
from opencann.ops.parity import special_values_differ
from opencann.ir.specialise import specialise
from opencann.ir.symbolic import SymExpr, bind, holds, symbols_of
from opencann.passes import ConstantFolding


def _rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _same(out, ref, tol=1e-4):
    fo, fr = pytree.tree_leaves(out), pytree.tree_leaves(ref)
    assert len(fo) == len(fr)
    for a, b in zip(fo, fr):
        assert a.shape == b.shape
        assert torch.equal(a.isnan(), b.isnan())
        assert _rel_err(a.nan_to_num(), b.nan_to_num()) < tol


class Attention(torch.nn.Module):
    """Projection → per-head SDPA → projection, views built from the input's sizes."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.heads, self.qkv, self.o = heads, torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(a.transpose(1, 2).reshape(b, t, d)) + x


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.c2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x):
        y = torch.relu(self.bn(self.c1(x)))
        y = torch.relu(self.c2(y) + y)
        return self.fc(y.mean((2, 3)))


def _seeded(model):
    torch.manual_seed(0)
    m = model.eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


@pytest.fixture(scope="module")
def attention():
    m = _seeded(Attention())
    cm = opencann.compile(m, (torch.randn(2, 8, 16),),
                          dynamic_shapes={"x": {0: "batch", 1: "seq"}},
                          dim_ranges={"seq": (2, 64), "batch": (1, 4)},
                          options={"plan_cache_size": 2})
    return m, cm


# -- symbolic expressions ----------------------------------------------------------
def test_symbolic_expressions_bind_and_guards_hold():
    assert bind("s1*s2", {"s1": 3, "s2": 5}) == 15
    assert bind(SymExpr("12*s0"), {"s0": 4}) == 48
    assert bind("FloorDiv(s0, 2)", {"s0": 7}) == 3
    assert bind(7, {}) == 7
    assert symbols_of("s0*N + E") == {"s0", "N", "E"}   # never sympy's constants
    assert holds("Eq(Mod(s0, 2), 0)", {"s0": 4}) and not holds("s0 >= 2", {"s0": 1})
    with pytest.raises(KeyError, match="s9"):
        bind("s9", {"s0": 1})


# -- one compile, any shape in range ------------------------------------------------
@pytest.mark.parametrize("b,t", [(2, 8), (1, 5), (3, 33), (4, 64), (1, 2)])
def test_attention_matches_eager_at_other_lengths(attention, b, t):
    m, cm = attention
    torch.manual_seed(b * 100 + t)
    x = torch.randn(b, t, 16)
    with torch.no_grad():
        ref = m(x)
    out = cm(x)
    _same(out, ref)
    again = cm(x)                        # a second call: same values
    _same(again, ref)
    assert out.data_ptr() != again.data_ptr()   # outputs are independent
    out.add_(1)
    _same(cm(x), ref)


def test_symbolic_graph_and_report(attention):
    _, cm = attention
    shapes = [v.desc.shape for v in cm.graph.inputs]
    assert any(isinstance(d, str) for s in shapes for d in s)
    dyn = cm.report.dynamic
    assert set(dyn["dims"]) == {"batch", "seq"}
    assert dyn["dims"]["seq"]["min"] == 2 and dyn["dims"]["seq"]["max"] == 64
    assert "2 <= seq <= 64" in dyn["guards"]
    assert any("dynamic dims: " in n for n in cm.report.notes)
    assert all(p["arena_over_lower_bound"] <= 1.02 for p in dyn["plans"])


def test_out_of_range_is_one_clear_error(attention):
    _, cm = attention
    with pytest.raises(ValueError) as e:
        cm(torch.randn(2, 65, 16))
    msg = str(e.value)
    assert "seq" in msg and "[2, 64]" in msg and "65" in msg and "dim_ranges" in msg
    assert "\n" not in msg
    with pytest.raises(ValueError, match="batch"):
        cm(torch.randn(5, 8, 16))
    with pytest.raises(ValueError, match="compiled for"):   # a static dim still checked
        cm(torch.randn(2, 8, 17))


def test_nan_positions_match_eager(attention):
    m, cm = attention
    x = torch.randn(1, 7, 16)
    x[0, 3, 5] = float("nan")
    with torch.no_grad():
        ref = m(x)
    _same(cm(x), ref)


def test_plan_cache_is_a_bounded_lru_and_passes_do_not_rerun(monkeypatch):
    m = _seeded(Attention())
    runs = {"fold": 0, "export": 0}
    real_fold, real_export = ConstantFolding.run, torch.export.export

    def fold(self, *a, **k):
        runs["fold"] += 1
        return real_fold(self, *a, **k)

    def export(*a, **k):
        runs["export"] += 1
        return real_export(*a, **k)
    monkeypatch.setattr(ConstantFolding, "run", fold)
    monkeypatch.setattr(torch.export, "export", export)
    cm = opencann.compile(m, (torch.randn(2, 8, 16),), dynamic_shapes={"x": {1: "seq"}},
                          options={"plan_cache_size": 2})
    assert runs == {"fold": 1, "export": 1}
    n_passes = len(cm.report.passes)
    for t in (5, 9, 8, 5, 12):
        x = torch.randn(2, t, 16)
        with torch.no_grad():
            _same(cm(x), m(x))
    assert runs == {"fold": 1, "export": 1}            # no re-capture, no pass re-run
    assert len(cm.report.passes) == n_passes
    # calls 8 (example), 5, 9 (evicts 8), 8 (evicts 5), 5 (evicts 9), 12 (evicts 8)
    assert cm.plans.keys() == [(5,), (12,)]
    assert cm.plans.evictions == 4 and cm.plans.misses == 5
    # the report lists the cached plans (bounded), and counts every build and eviction
    assert [p["dims"]["seq"] for p in cm.report.dynamic["plans"]] == [5, 12]
    assert cm.report.dynamic["plan_counts"] == {"built": 6, "evicted": 4}


def test_same_outputs_as_a_static_compile():
    m = _seeded(Attention())
    x = torch.randn(3, 12, 16)
    dyn = opencann.compile(m, (torch.randn(2, 8, 16),), dynamic_shapes={"x": {0: "b", 1: "t"}})
    static = opencann.compile(m, (x,))
    assert torch.allclose(dyn(x), static(x), atol=1e-6, rtol=1e-5)


def test_conv_model_with_dynamic_batch():
    m = _seeded(ConvNet())
    b = torch.export.Dim("batch", min=1, max=16)
    cm = opencann.compile(m, (torch.randn(2, 3, 10, 10),), dynamic_shapes={"x": {0: b}})
    assert cm.report.dynamic["dims"]["batch"]["max"] == 16
    for n in (1, 3, 7, 2):
        x = torch.randn(n, 3, 10, 10)
        with torch.no_grad():
            ref = m(x)
        _same(cm(x), ref)
    with pytest.raises(ValueError, match=r"batch.*\[1, 16\]"):
        cm(torch.randn(17, 3, 10, 10))


def test_concurrent_calls_at_several_shapes(attention):
    m, cm = attention
    xs = [torch.randn(1 + i % 3, 4 + 3 * (i % 5), 16) for i in range(12)]
    with torch.no_grad():
        refs = [m(x) for x in xs]
    errs = []

    def worker(i):
        try:
            for _ in range(3):
                _same(cm(xs[i]), refs[i])
        except Exception as e:  # noqa: BLE001 - reported below
            errs.append(e)
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(len(xs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errs, errs[0]


def test_bad_specs_are_clear_errors():
    m = _seeded(Attention())
    x = torch.randn(2, 8, 16)
    with pytest.raises(ValueError, match="not arguments of"):
        opencann.compile(m, (x,), dynamic_shapes={"y": {0: "batch"}})
    with pytest.raises(ValueError, match="key its dims by index"):
        opencann.compile(m, (x,), dynamic_shapes={"x": {"batch": 0}})
    with pytest.raises(ValueError, match="min <= max"):
        opencann.compile(m, (x,), dynamic_shapes={"x": {0: "batch"}}, dim_ranges={"batch": (5, 2)})
    with pytest.raises(ValueError, match="plan_cache_size"):
        opencann.compile(m, (x,), dynamic_shapes={"x": {0: "batch"}},
                         options={"plan_cache_size": 0})
    with pytest.raises(ValueError, match="dynamic_shapes"):
        opencann.compile(m, (x,), dim_ranges={"batch": (1, 4)})


def test_specialise_leaves_the_symbolic_graph_alone(attention):
    _, cm = attention
    syms = sorted({d for v in cm.graph.inputs for d in v.desc.shape if isinstance(d, str)})
    g = specialise(cm.graph, {s: 3 for s in syms})
    assert all(v.desc.is_static for n in g.nodes for v in n.outputs)
    assert any(not v.desc.is_static for n in cm.graph.nodes for v in n.outputs)
    assert len(g.nodes) == len(cm.graph.nodes)


# -- MiniLM with its real weights ---------------------------------------------------
@pytest.fixture(scope="module")
def minilm():
    zm = zoo.minilm(batch=2, seq=16)
    cm = opencann.compile(zm.model, zm.example_inputs,
                          dynamic_shapes={"input_ids": {0: "batch", 1: "seq"},
                                          "attention_mask": {0: "batch", 1: "seq"}},
                          dim_ranges={"batch": (1, 8), "seq": (2, 512)})
    return zm.model, cm


def _text(batch, seq, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 20000, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[0, seq - seq // 4:] = 0          # a padded text in the batch
    return ids, mask


@pytest.mark.parametrize("batch,seq", [(1, 16), (2, 40), (3, 77), (1, 77), (3, 16)])
def test_minilm_one_compile_many_shapes(minilm, batch, seq):
    model, cm = minilm
    ids, mask = _text(batch, seq, seed=batch * 1000 + seq)
    with torch.no_grad():
        ref = model(ids, mask)
    out = cm(ids, mask)
    _same(out.last_hidden_state, ref.last_hidden_state)
    _same(out.pooler_output, ref.pooler_output)
    again = cm(ids, mask)
    _same(again.last_hidden_state, ref.last_hidden_state)
    assert again.last_hidden_state.data_ptr() != out.last_hidden_state.data_ptr()


def test_minilm_report_and_range(minilm):
    _, cm = minilm
    dims = cm.report.dynamic["dims"]
    assert dims["seq"]["max"] == 512 and dims["batch"]["min"] == 1
    assert sorted(dims["batch"]["sources"]) == ["attention_mask.shape[0]", "input_ids.shape[0]"]
    with pytest.raises(ValueError, match=r"seq.*\[2, 512\]"):
        cm(*_text(1, 513, 0))
    ids, mask = _text(2, 16, 0)
    with pytest.raises(ValueError, match="must be equal"):
        cm(ids, mask[:1])


class Positions(torch.nn.Module):
    """Token + position embeddings (a table of 32 positions bounds the length)."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(100, 8)
        self.pos = torch.nn.Parameter(torch.randn(1, 32, 8))

    def forward(self, ids):
        return self.tok(ids) + self.pos[:, :ids.shape[1]]


class SpelledOutAttention(torch.nn.Module):
    def forward(self, q, k, v):
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        return torch.softmax(s, -1) @ v


def test_a_dim_without_range_is_narrowed_to_what_the_model_accepts():
    m = _seeded(Positions())
    cm = opencann.compile(m, (torch.randint(0, 100, (2, 8)),),
                          dynamic_shapes={"ids": {0: "batch", 1: "seq"}})
    assert cm.report.dynamic["dims"]["seq"]["max"] == 32
    assert any("narrowed" in n for n in cm.report.notes)
    for t in (3, 32):
        ids = torch.randint(0, 100, (3, t))
        with torch.no_grad():
            _same(cm(ids), m(ids))
    with pytest.raises(ValueError, match=r"seq.*33"):
        cm(torch.randint(0, 100, (1, 33)))


def test_an_explicit_range_the_model_rejects_is_one_clear_error():
    with pytest.raises(opencann.frontend.torch.CaptureError) as e:
        opencann.compile(_seeded(Positions()), (torch.randint(0, 100, (2, 8)),),
                         dynamic_shapes={"ids": {1: "seq"}}, dim_ranges={"seq": (2, 64)})
    assert "seq <= 32" in str(e.value) and "dim_ranges={'seq': (2, 32)}" in str(e.value)


def test_spelled_out_attention_compiled_at_one_length_called_at_another():
    m = SpelledOutAttention()
    qkv = [torch.randn(2, 4, 8, 16) for _ in range(3)]
    seq = {2: "seq"}
    cm = opencann.compile(m, tuple(qkv), dynamic_shapes={"q": seq, "k": seq, "v": seq},
                          options={"enable": ["fuse_flash_attention"]})
    skips = [s for s in cm.report.skipped if s["pass"] == "fuse_flash_attention"]
    assert skips and all("dynamic dim" in s["reason"] for s in skips)
    for t in (3, 19, 8):
        q, k, v = (torch.randn(2, 4, t, 16) for _ in range(3))
        _same(cm(q, k, v), m(q, k, v))


def test_constant_folding_states_its_guard():
    m = _seeded(Positions())
    cm = opencann.compile(m, (torch.randint(0, 100, (2, 8)),),
                          dynamic_shapes={"ids": {1: "seq"}}, dim_ranges={"seq": (2, 32)})
    skips = [s for s in cm.report.skipped if s["pass"] == "constant_folding"]
    assert skips and "every dim static" in skips[0]["reason"]


# -- torch.compile: dynamo's symbolic graphs through the same per-shape plans --------
class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_torch_compile_symbolic_graphs_are_compiled_not_run_eagerly():
    from opencann.dynamo.compile_fx import COMPILED_GRAPHS
    torch._dynamo.reset()
    caplog, log = _Records(), logging.getLogger("opencann")
    level = log.level
    log.addHandler(caplog)
    log.setLevel(logging.INFO)
    m = _seeded(Attention())
    cm = torch.compile(m, backend="opencann")          # default dynamic=None
    before = len(COMPILED_GRAPHS)
    shapes = [(2, 8), (3, 5), (3, 21), (2, 8), (4, 17), (2, 40)]
    try:
        with torch.no_grad():
            for b, t in shapes:
                x = torch.randn(b, t, 16)
                _same(cm(x), m(x))
                _same(cm(x), m(x))
    finally:
        log.removeHandler(caplog)
        log.setLevel(level)
    assert not [r for r in caplog.records if "eagerly" in r.getMessage()]
    graphs = COMPILED_GRAPHS[before:]
    assert len(graphs) == 2                           # one static, then one symbolic graph
    dyn = graphs[-1].dynamic
    assert dyn["dims"] and len(dyn["plans"]) == 5     # every shape from (3, 5) on
    assert any("symbolic shapes" in r.getMessage() for r in caplog.records)


def test_torch_compile_dynamic_true_conv_batches():
    torch._dynamo.reset()
    m = _seeded(ConvNet())
    cm = torch.compile(m, backend="opencann", dynamic=True)
    with torch.no_grad():
        for n in (2, 5, 3):
            x = torch.randn(n, 3, 10, 10)
            _same(cm(x), m(x))


# -- ATC-style gears ----------------------------------------------------------------
def test_batch_gears_serve_exact_gears_and_name_them_otherwise():
    m = _seeded(ConvNet())
    cm = opencann.compile(m, (torch.randn(2, 3, 10, 10),),
                          options={"dynamic_batch_size": [8, 1, 4, 2]})
    assert sorted(cm.plans.keys()) == [(1,), (2,), (4,), (8,)]   # every gear planned now
    assert cm.report.dynamic["gears"]["values"] == [[1], [2], [4], [8]]
    assert cm.report.dynamic["padding"]["dims"]["batch"]["padded"]
    built = cm.plans.misses
    for n in (1, 2, 3, 4, 8):                                    # 3: padded to 4
        x = torch.randn(n, 3, 10, 10)
        with torch.no_grad():
            _same(cm(x), m(x))
    assert cm.plans.misses == built                              # no plan built at call time
    for n in (9, 100):                                           # above every gear
        with pytest.raises(ValueError, match=r"not one of the gears .*\[1, 2, 4, 8\]"):
            cm(torch.randn(n, 3, 10, 10))


def test_image_size_gears_and_dims_gears():
    m = _seeded(ConvNet())
    cm = opencann.compile(m, (torch.randn(2, 3, 10, 10),),
                          options={"dynamic_image_size": [[8, 8], [10, 12]]})
    x = torch.randn(2, 3, 10, 12)
    with torch.no_grad():
        _same(cm(x), m(x))
    with pytest.raises(ValueError, match="not one of the gears"):
        cm(torch.randn(2, 3, 12, 10))
    a = _seeded(Attention())
    cm = opencann.compile(a, (torch.randn(2, 8, 16),), dynamic_shapes={"x": {0: "b", 1: "t"}},
                          options={"dynamic_dims": [[1, 16], [2, 40]]})
    x = torch.randn(2, 40, 16)
    with torch.no_grad():
        _same(cm(x), a(x))


def test_too_many_gears_is_one_clear_error():
    with pytest.raises(ValueError, match="at most 100"):
        opencann.compile(_seeded(ConvNet()), (torch.randn(2, 3, 10, 10),),
                         options={"dynamic_batch_size": list(range(1, 102))})
    with pytest.raises(ValueError, match="dynamic_shapes"):
        opencann.compile(_seeded(ConvNet()), (torch.randn(2, 3, 10, 10),),
                         options={"dynamic_dims": [[1, 2]]})


class WritesInput(torch.nn.Module):
    def forward(self, x):
        return x.add_(1)[1:]


def test_a_model_writing_its_input_returns_views_of_it_at_every_shape():
    m = WritesInput()
    cm = opencann.compile(m, (torch.randn(4, 8),), dynamic_shapes={"x": {0: "b", 1: "t"}},
                          dim_ranges={"b": (3, 64), "t": (2, 64)})
    for b, t in [(4, 8), (5, 3), (9, 16)]:
        x = torch.randn(b, t)
        y = x.clone()
        out, ref = cm(x), m(y)
        assert torch.equal(out, ref) and torch.equal(x, y)
        assert out.data_ptr() == x[1:].data_ptr()          # a view of the caller's tensor


def test_vnpu_with_dynamic_dims_compiles_each_shape():
    m = _seeded(ConvNet())
    cm = opencann.compile(m, (torch.randn(2, 3, 10, 10),), device="vnpu",
                          dynamic_shapes={"x": {0: "batch"}})
    for n in (2, 3):
        x = torch.randn(n, 3, 10, 10)
        with torch.no_grad():
            _same(cm(x), m(x))


class _PatternBlock(torch.nn.Module):
    """Hand-written RMSNorm, SiLU, tanh GELU, LayerNorm and erf GELU (the pattern fusions)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(16) + 0.5)
        self.l1, self.l3 = torch.nn.Linear(16, 32), torch.nn.Linear(16, 32)
        self.g, self.b = torch.nn.Parameter(torch.rand(32)), torch.nn.Parameter(torch.rand(32))

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        a = self.l1(h)
        y = a * torch.sigmoid(a) * self.l3(h)
        y = 0.5 * y * (1 + torch.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * torch.pow(y, 3))))
        mu = y.mean(-1, keepdim=True)
        y = (y - mu) / torch.sqrt(((y - mu) ** 2).mean(-1, keepdim=True) + 1e-5) * self.g + self.b
        return 0.5 * y * (1 + torch.erf(y / math.sqrt(2)))


def test_pattern_fusions_on_symbolic_shapes():
    torch.manual_seed(0)
    m = _PatternBlock().eval()
    cm = opencann.compile(m, (torch.randn(2, 8, 16),),
                          dynamic_shapes={"x": {0: "batch", 1: "seq"}})
    ops = cm.report.op_counts_after
    # a formula stays spelled out on a CPU whose kernel misplaces NaN/±inf (AVX-512's +inf)
    n = {a: int(special_values_differ(a, torch.float32) is None)
         for a in ("gelu", "gelu_tanh", "rms_norm", "layer_norm")}
    assert ops.get("RmsNorm", 0) == n["rms_norm"] and ops.get("Gelu", 0) == n["gelu"] + \
        n["gelu_tanh"] and ops.get("LayerNormFormula", 0) == n["layer_norm"], ops
    for shape in [(2, 8, 16), (1, 13, 16), (3, 5, 16), (1, 13, 16)]:
        x = torch.randn(*shape)
        x[0, 0, 0] = float("nan")
        got, want = cm(x), m(x)
        assert torch.equal(got.isnan(), want.isnan())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
