"""Random ops (any ATen overload tagged ``nondeterministic_seeded``, host fallbacks
included) are drawn anew on every call: never constant-folded (``torch.randn(4, 6)``
has no tensor inputs, so all its inputs are trivially constant), merged by CSE or
recomputed. A compiled model's random stream need not match eager's bit for bit, but
each call draws new values from torch's global RNG, so ``torch.manual_seed`` makes
calls reproducible. Checked through ``opencann.compile``, ``torch.compile(backend=
"opencann")``, the vnpu device and the training backend."""
import pytest
import torch
import torch.nn.functional as F

import opencann
from opencann.frontend.torch.convert import ConversionError
from opencann.dynamo import COMPILED_GRAPHS
from opencann.dynamo.training import opencann_training_backend
from opencann.ops import is_random


class Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(7))


def _uniform(out, x):
    assert ((out >= 0) & (out < 1)).all()
    assert abs(out.mean().item() - 0.5) < 0.05


def _standard_normal(out, x):
    assert abs(out.mean().item()) < 0.1 and abs(out.std().item() - 1) < 0.1


# name -> (function of x [64, 64], distribution check of (output, x))
CASES = {
    "rand_like": (lambda x: torch.rand_like(x), _uniform),
    "rand_like_minus_rand_like": (lambda x: torch.rand_like(x) - torch.rand_like(x),
                                  lambda o, x: abs(o.mean().item()) < 0.05 and
                                  (o != 0).float().mean() > 0.99),
    "x_plus_randn": (lambda x: x + torch.randn(64, 64), lambda o, x: _standard_normal(o - x, x)),
    "randn_no_inputs": (lambda x: torch.randn(64, 64), _standard_normal),
    "randperm_index": (lambda x: x[torch.randperm(64)],
                       lambda o, x: torch.equal(o.sort(0).values, x.sort(0).values)),
    "randint": (lambda x: torch.randint(0, 10, (64, 64)),
                lambda o, x: o.min() >= 0 and o.max() <= 9 and abs(o.float().mean() - 4.5) < 0.3),
    "bernoulli": (lambda x: torch.bernoulli(torch.full_like(x, 0.3)),
                  lambda o, x: set(o.unique().tolist()) <= {0.0, 1.0} and abs(o.mean() - 0.3) < 0.05),
    "normal_tensor_mean": (lambda x: torch.normal(x, 1.0), lambda o, x: _standard_normal(o - x, x)),
    "normal_no_inputs": (lambda x: torch.normal(0.0, 1.0, (64, 64)), _standard_normal),
    "multinomial": (lambda x: torch.multinomial(x.abs() + 0.1, 8),
                    lambda o, x: o.min() >= 0 and o.max() < 64 and
                    all(len(set(r.tolist())) == 8 for r in o)),
    "dropout_training_in_eval_model": (
        lambda x: F.dropout(x, 0.5, training=True),
        lambda o, x: abs((o == 0).float().mean() - 0.5) < 0.05 and
        torch.allclose(o[o != 0], 2 * x[o != 0])),
}


def _check(name, compiled, fn, x):
    expect = fn(x)
    a, b = compiled(x), compiled(x)
    assert a.shape == expect.shape and a.dtype == expect.dtype, (name, a.shape, a.dtype)
    assert not torch.equal(a, b), f"{name}: two calls gave the same 'random' values"
    torch.manual_seed(123)
    c = compiled(x)
    torch.manual_seed(123)
    d = compiled(x)
    assert torch.equal(c, d), f"{name}: not reproducible under torch.manual_seed"
    assert CASES[name][1](a, x) is not False, name
    assert CASES[name][1](b, x) is not False, name


@pytest.mark.parametrize("name", list(CASES))
def test_random_ops_draw_anew_each_call(name):
    fn = CASES[name][0]
    x = _x(64, 64)
    compiled = opencann.compile(Fn(fn).eval(), (x,))
    _check(name, compiled, fn, x)
    randoms = [n for n in compiled.graph.nodes if is_random(n)]
    assert randoms, f"{name}: no random node left in {compiled.graph.op_counts()}"
    assert any("random ops drawn anew" in n for n in compiled.report.notes)
    assert not compiled.graph.constants or name == "multinomial"


@pytest.mark.parametrize("name", ["rand_like_minus_rand_like", "x_plus_randn", "randperm_index",
                                  "bernoulli", "randn_no_inputs"])
def test_random_ops_through_torch_compile(name):
    fn = CASES[name][0]
    x = _x(64, 64)
    n = len(COMPILED_GRAPHS)
    compiled = torch.compile(fn, backend="opencann", dynamic=False)
    _check(name, compiled, fn, x)
    assert len(COMPILED_GRAPHS) > n  # compiled by opencann, not run eagerly


def test_random_ops_on_vnpu():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(16, 16, 1)

        def forward(self, x):
            y = self.conv(x)
            return (y + torch.randn(2, 16, 8, 8) - torch.rand_like(y)
                    + F.dropout(y, 0.5, training=True))
    torch.manual_seed(0)
    model, x = M().eval(), _x(2, 16, 8, 8)
    compiled = opencann.compile(model, (x,), device="vnpu:ascend910b")
    a, b = compiled(x), compiled(x)
    assert a.shape == model(x).shape and not torch.equal(a, b)
    torch.manual_seed(5)
    c = compiled(x)
    torch.manual_seed(5)
    assert torch.equal(c, compiled(x))


def test_compiled_call_advances_global_rng():
    compiled = opencann.compile(Fn(lambda x: x + torch.randn(8)).eval(), (_x(8),))
    torch.manual_seed(0)
    compiled(_x(8))
    after_call = torch.rand(4)
    torch.manual_seed(0)
    assert not torch.equal(after_call, torch.rand(4))


def test_one_draw_feeding_identical_consumers_is_shared():
    """CSE may merge two consumers of ONE draw (eager gives exactly zero), never two draws."""
    def same(x):
        r = torch.rand_like(x)
        return r * 2 - r * 2

    x = _x(16, 16)
    compiled = opencann.compile(Fn(same).eval(), (x,))
    assert torch.equal(compiled(x), torch.zeros(16, 16))
    two = opencann.compile(Fn(lambda x: torch.rand_like(x) * 2 - torch.rand_like(x) * 2).eval(), (x,))
    assert (two(x) != 0).all()
    assert sum(1 for n in two.graph.nodes if is_random(n)) == 2


def test_attention_dropout_is_random_only_when_dropout_p_is_nonzero():
    def attn(p):
        def f(x):
            q = x[None, None]
            return (F.scaled_dot_product_attention(q, q, q, dropout_p=p)
                    - F.scaled_dot_product_attention(q, q, q, dropout_p=p))
        return f

    x = _x(16, 8)
    drop = opencann.compile(Fn(attn(0.5)).eval(), (x,))
    assert not torch.equal(drop(x), torch.zeros(1, 1, 16, 8))
    assert not torch.equal(drop(x), drop(x))
    plain = opencann.compile(Fn(attn(0.0)).eval(), (x,))
    assert torch.equal(plain(x), torch.zeros(1, 1, 16, 8))
    assert not any(is_random(n) for n in plain.graph.nodes)
    assert not any("random ops" in n for n in plain.report.notes)


def test_unused_random_op_is_dropped():
    """Documented choice: an unused draw is unobservable and removed by DCE; the compiled
    stream then differs from eager's but stays reproducible under torch.manual_seed."""
    def f(x):
        torch.rand_like(x)
        return x + torch.rand_like(x)

    x = _x(8, 8)
    compiled = opencann.compile(Fn(f).eval(), (x,))
    assert sum(1 for n in compiled.graph.nodes if is_random(n)) == 1
    torch.manual_seed(1)
    a = compiled(x)
    torch.manual_seed(1)
    assert torch.equal(a, compiled(x)) and not torch.equal(a, compiled(x))


def test_explicit_generator_is_a_clear_error():
    gen = torch.Generator().manual_seed(0)
    model = Fn(lambda x: x + torch.rand(4, 6, generator=gen))
    with pytest.raises(ConversionError, match="torch.Generator.*global RNG"):
        opencann.compile(model, (_x(4, 6),))


def test_explicit_generator_through_torch_compile_follows_the_generator():
    gen = torch.Generator()
    x = _x(4, 6)

    def f(x):
        return x + torch.rand(4, 6, generator=gen)

    compiled = torch.compile(f, backend="opencann", dynamic=False)
    gen.manual_seed(0)
    a = compiled(x)
    gen.manual_seed(0)
    assert torch.equal(a, f(x)) and not torch.equal(compiled(x), compiled(x))


class _DropoutNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((32,), 2.0))
        self.lin = torch.nn.Linear(32, 32)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.lin(x)) * self.w * torch.rand_like(x) + torch.randn(16, 32) * self.w


def test_training_graph_draws_anew_and_backward_uses_the_forward_draw():
    torch.manual_seed(0)
    model = _DropoutNet().train()
    x = _x(16, 32)
    compiled = torch.compile(model, backend=opencann_training_backend, dynamic=False)

    def step(seed=None):
        if seed is not None:
            torch.manual_seed(seed)
        model.zero_grad()
        out = compiled(x)
        out.sum().backward()
        return out.detach(), model.w.grad.clone()

    (o1, g1), (o2, g2), (o3, g3) = step(3), step(3), step()
    assert torch.equal(o1, o2) and torch.equal(g1, g2)       # reproducible under a seed
    assert not torch.equal(o1, o3) and not torch.equal(g1, g3)  # new masks and draws per step
    # the gradient of w is the forward's output over w: backward read the forward's draws
    torch.testing.assert_close(g3, (o3 / model.w.detach()).sum(0), rtol=1e-5, atol=1e-5)
    fw = [r for r in COMPILED_GRAPHS if "training graph: forward" in r.notes][-1]
    assert any("random ops drawn anew" in n for n in fw.notes)
