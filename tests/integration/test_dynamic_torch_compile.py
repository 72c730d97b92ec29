"""torch.compile(backend="opencann") with dynamic shapes (#12): every compile counted per
code object with dynamo's recompile reason and the user's line owning the failed guard
(`opencann.dynamo.recompiles`, ``report.torch_compile``, the INFO log); symbolic
training graphs compiled through the per-shape plans (gradients matching eager within
1e-5 at every batch size) with no eager fallback counted; a graph run eagerly is
counted with its reason (`opencann.dynamo.eager_fallbacks`)."""
import copy
import inspect
import logging

import pytest
import torch

import opencann  # noqa: F401  (registers the backend)
from opencann.dynamo import COMPILED_GRAPHS, eager_fallbacks, recompiles


class Branchy(torch.nn.Module):
    """A linear layer whose output doubles past 30 positions (a guard on ``t``)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        b, t, d = x.shape
        y = self.lin(x).reshape(b * t, d)
        if t > 30:
            y = y * 2
        return y.reshape(b, t, d)


class Block(torch.nn.Module):
    """A pre-norm transformer block: attention (SDPA) + GELU MLP, views from x's sizes."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.o = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                       torch.nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.n2(x))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def info_log():
    h, log = _Records(), logging.getLogger("opencann")
    level = log.level
    log.addHandler(h)
    log.setLevel(logging.INFO)
    yield h.messages
    log.removeHandler(h)
    log.setLevel(level)


def _line_of(fn, text):
    src, first = inspect.getsourcelines(fn)
    return first + next(i for i, s in enumerate(src) if text in s)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


# -- the recompile counter -----------------------------------------------------------
def test_recompiles_are_counted_with_reason_and_source_line(info_log):
    torch.manual_seed(0)
    m = Branchy().eval()
    cm = torch.compile(m, backend="opencann")
    before, fallbacks = len(COMPILED_GRAPHS), len(eager_fallbacks())
    start = recompiles(m)["compiles"]
    with torch.no_grad():
        for shape in [(2, 8), (2, 8), (3, 5), (4, 9), (3, 40), (2, 33)]:
            x = torch.randn(*shape, 16)
            assert _rel(cm(x), m(x)) < 1e-5
    rec = recompiles(cm)
    assert rec == recompiles(m)                       # the module or torch.compile's wrapper
    assert rec["compiles"] - start == 3               # static, symbolic, then t > 30
    assert rec["code"].startswith("forward (") and __file__ in rec["code"]
    size, branch = rec["recompiles"][-2:]
    # the second compile: the first graph's static size guard on x failed
    assert "size mismatch" in size["reason"] and size["dynamic"] and not size["training"]
    assert size["source"].startswith(f"{__file__}:{_line_of(Branchy.forward, 'def forward')} ")
    # the third: the symbolic graph's guard t <= 30 failed, owned by the `if`
    assert "30" in branch["reason"]
    assert branch["source"] == (f"{__file__}:{_line_of(Branchy.forward, 'if t > 30')} in "
                                "forward: if t > 30:")
    assert branch["graphs"] == 1 and branch["eager"] == []
    assert rec["eager_fallbacks"] == 0 and len(eager_fallbacks()) == fallbacks
    reports = COMPILED_GRAPHS[before:]
    assert [r.torch_compile["compile"] - start for r in reports] == [1, 2, 3]
    assert reports[-1].torch_compile["source"] == branch["source"]
    assert "recompiled because" in reports[-1].summary()
    logged = [s for s in info_log if s.startswith("torch.compile recompiled forward")]
    assert len(logged) == 2 and "if t > 30" in logged[-1]


def test_recompiles_of_a_function_and_bad_arguments():
    def f(x):
        return torch.relu(x) * x.shape[0]

    cf = torch.compile(f, backend="opencann")
    for n in (2, 3, 4):
        x = torch.randn(n, 5)
        torch.testing.assert_close(cf(x), f(x))
    rec = recompiles(f)
    assert rec["compiles"] == 2 and rec["code"].startswith("f (")
    assert recompiles(cf) == rec
    with pytest.raises(TypeError, match="takes a module, a function"):
        recompiles(3)


def test_an_eager_fallback_is_counted_with_its_reason():
    class Cond(torch.nn.Module):
        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda v: v + 1, lambda v: v - 1, (x,))

    n = len(eager_fallbacks())
    m = Cond()
    x = torch.randn(3, 4)
    torch.testing.assert_close(torch.compile(m, backend="opencann")(x), m(x))
    new = eager_fallbacks()[n:]
    assert len(new) == 1 and "torch.cond" in new[0]["reason"]
    assert recompiles(m)["eager_fallbacks"] == 1


@pytest.mark.parametrize("plan_cache_size", [1, 2])
def test_shapes_cycling_past_a_small_plan_cache_stay_compiled(plan_cache_size):
    """Three sizes in turn with a plan cache of 1 or 2: every call rebuilds an evicted plan,
    but the shapes repeat, so the graph is not churn and never turns eager (counting
    plan builds turned it eager at its first call with plan_cache_size=1)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)

    def f(x):
        return torch.relu(lin(x)) * 2

    torch._dynamo.reset()
    cf = torch.compile(f, backend="opencann", dynamic=True,
                       options={"plan_cache_size": plan_cache_size})
    n, n_graphs = len(eager_fallbacks()), len(COMPILED_GRAPHS)
    with torch.no_grad():
        for rows in [3, 5, 7] * 4:
            x = torch.randn(rows, 8)
            x[0, 0] = float("nan")
            torch.testing.assert_close(cf(x), f(x), equal_nan=True)
    assert eager_fallbacks()[n:] == []
    (report,) = [r for r in COMPILED_GRAPHS[n_graphs:] if r.dynamic]
    assert report.dynamic["plan_counts"]["built"] == 12     # still planned, not eager
    torch._dynamo.reset()


# -- symbolic training graphs ------------------------------------------------------
@pytest.mark.parametrize("make,shapes", [
    (lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                 torch.nn.LayerNorm(32), torch.nn.Linear(32, 16)),
     [(4, 16), (6, 16), (9, 16)]),
    (Block, [(2, 8, 16), (3, 11, 16), (5, 6, 16)]),
])
def test_training_with_symbolic_shapes_matches_eager_grads(make, shapes):
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    cm = torch.compile(model, backend="opencann")
    n_graphs, fallbacks = len(COMPILED_GRAPHS), len(eager_fallbacks())
    for step, shape in enumerate(shapes):
        x = torch.randn(*shape)
        for _ in range(2):                    # a second step at the same shape
            opt.zero_grad()
            opt_ref.zero_grad()
            out, out_ref = cm(x), ref(x)
            assert _rel(out.detach(), out_ref.detach()) < 1e-5
            (out * out).mean().backward()
            (out_ref ** 2).mean().backward()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert _rel(p.grad, q.grad) < 1e-5, (shape, name)
            opt.step()
            opt_ref.step()
    assert len(eager_fallbacks()) == fallbacks
    reports = COMPILED_GRAPHS[n_graphs:]
    roles = [n for r in reports for n in r.notes if n.startswith("training graph")]
    assert roles.count("training graph: backward") >= 2
    symbolic = [r for r in reports if r.dynamic]
    # one forward and one backward graph with symbolic shapes, each planned per shape
    assert len(symbolic) == 2
    assert all(len(r.dynamic["plans"]) == len(shapes) - 1 for r in symbolic)
    rec = recompiles(model)
    assert rec["recompiles"][-1]["training"] and rec["recompiles"][-1]["dynamic"]
    assert rec["eager_fallbacks"] == 0


def test_a_backward_input_with_a_computed_dim_is_checked():
    """A backward graph receives views saved as [s0*s1, d]: their size is checked against
    the symbols' values instead of being bound (one clear error when inconsistent)."""
    from opencann.engine.dynamic import ShapeBinder
    from opencann.ir import DataType, Graph, TensorDesc
    g = Graph("g")
    g.add_input(TensorDesc(("s0*s1", 4), DataType.FLOAT), "x")
    dims = {s: {"name": s, "min": 0, "max": None, "sources": ["a size argument"]}
            for s in ("s0", "s1")}
    binder = ShapeBinder(g, dims, (), ["x"], scalars=["s0", "s1"])
    assert binder.bind([torch.zeros(6, 4)], [2, 3]) == (2, 3)
    with pytest.raises(ValueError, match=r"x dim 0 is 5 but the graph computes it as s0\*s1 = 6"):
        binder.bind([torch.zeros(5, 4)], [2, 3])
