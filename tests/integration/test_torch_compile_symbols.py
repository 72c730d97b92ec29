"""torch.compile(backend="opencann"): whether a graph is static, symbolic or data-dependent
is read from every value of the graph (`opencann.dynamo.symbolic.graph_symbols`), not only
from the tensor inputs' shapes.

* A Python int argument that changes between calls while every tensor keeps its shape
  (``x[:n]``, ``forward(tokens, start_pos: int)``) reaches the backend as a SymInt input
  with static tensors and symbolic intermediates: compiled once and planned per shape,
  inference and training, values and gradients matching eager (it failed with "slice_1 has
  symbolic shape ...; plans are made per concrete input shape").
* A graph computing a data-dependent size or scalar (``.item()``, ``x[mask]`` under
  dynamo's ``capture_scalar_outputs`` / ``capture_dynamic_output_shape_ops``) runs eagerly
  and is counted in `opencann.dynamo.eager_fallbacks` (it raised a ConversionError telling
  the user to use torch.compile); ``opencann.compile`` keeps its error."""
import copy

import pytest
import torch

import opencann
from opencann.dynamo import COMPILED_GRAPHS, eager_fallbacks, recompiles
from opencann.dynamo.symbolic import graph_symbols
from opencann.frontend.torch import ConversionError


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _with_nan(*shape):
    x = torch.randn(*shape)
    x[0, 1] = float("nan")
    return x


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# -- the scan --------------------------------------------------------------------------
def _scans(fn, calls):
    seen = []

    def backend(gm, example_inputs):
        seen.append((graph_symbols(gm, example_inputs), example_inputs))
        return gm.forward
    cf = torch.compile(fn, backend=backend)
    for args in calls:
        cf(*args)
    return seen


def test_an_int_argument_with_static_tensors_is_symbolic():
    x = torch.randn(6, 4)
    (first, _), (second, inputs) = _scans(lambda x, n: x[:n] * 2, [(x, 2), (x, 3), (x, 4)])
    assert not first.dynamic and not first.data_dependent
    # the tensor input stays static: only the int and the slice are symbolic
    assert all(isinstance(d, int) for t in inputs if isinstance(t, torch.Tensor) for d in t.shape)
    assert second.dynamic and not second.data_dependent and len(second.backed) == 1


def test_a_data_dependent_size_is_named_with_its_line():
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        ((syms, _),) = _scans(lambda x: x[x > 0].sum(), [(torch.randn(6, 4),)])
    assert syms.data_dependent and not syms.dynamic
    assert "test_torch_compile_symbols.py:" in syms.why_eager()


# -- int arguments: compiled, per shape --------------------------------------------------
@pytest.mark.parametrize("fn", [
    lambda x, n: x[:n] * 2,                           # a slice bound
    lambda x, n: x * n + n,                           # a scalar operand
    lambda x, n: x[:, n:n + 2].sum(1) + torch.arange(6) * n,
], ids=["slice", "scalar", "window"])
def test_changing_int_argument_is_compiled_not_failed(fn):
    torch.manual_seed(0)
    cf = torch.compile(fn, backend="opencann")
    n_graphs, fallbacks = len(COMPILED_GRAPHS), len(eager_fallbacks())
    x = _with_nan(6, 4)
    for n in (2, 3, 1, 2):
        torch.testing.assert_close(cf(x, n), fn(x, n), equal_nan=True)
    assert eager_fallbacks()[fallbacks:] == []
    assert any(r.dynamic.get("dims") for r in COMPILED_GRAPHS[n_graphs:])


class KvAttention(torch.nn.Module):
    """Llama-style attention: ``forward(tokens, start_pos: int)`` writes the new keys and
    values into cache buffers at ``start_pos`` and attends over ``[0, start_pos + t)``."""

    def __init__(self, d=16, heads=2, max_len=32):
        super().__init__()
        self.heads, self.emb = heads, torch.nn.Embedding(50, d)
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(d, d) for _ in range(4))
        self.register_buffer("ck", torch.zeros(1, max_len, d))
        self.register_buffer("cv", torch.zeros(1, max_len, d))

    def forward(self, tokens, start_pos: int):
        x = self.emb(tokens)
        b, t, d = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        with torch.no_grad():
            self.ck[:b, start_pos:start_pos + t] = k.detach()
            self.cv[:b, start_pos:start_pos + t] = v.detach()
        keys = torch.cat([self.ck[:b, :start_pos], k], 1)
        vals = torch.cat([self.cv[:b, :start_pos], v], 1)

        def heads(z):
            return z.view(b, -1, self.heads, d // self.heads).transpose(1, 2)
        a = torch.nn.functional.scaled_dot_product_attention(heads(q), heads(keys), heads(vals))
        return self.wo(a.transpose(1, 2).reshape(b, t, d))


def _prompt_then_tokens():
    g = torch.Generator().manual_seed(1)
    yield torch.randint(0, 50, (1, 4), generator=g), 0
    for pos in (4, 5, 6, 7):
        yield torch.randint(0, 50, (1, 1), generator=g), pos


def test_kv_cache_decoding_with_start_pos_matches_eager():
    torch.manual_seed(0)
    m = KvAttention().eval()
    ref = copy.deepcopy(m)
    cm = torch.compile(m, backend="opencann")
    fallbacks = len(eager_fallbacks())
    with torch.no_grad():
        for tokens, pos in _prompt_then_tokens():
            assert _rel(cm(tokens, pos), ref(tokens, pos)) < 1e-5, pos
    assert _rel(m.ck, ref.ck) < 1e-5 and _rel(m.cv, ref.cv) < 1e-5   # the caches written
    assert eager_fallbacks()[fallbacks:] == [] and recompiles(m)["recompiles"][-1]["dynamic"]


@pytest.mark.parametrize("make", [KvAttention, None], ids=["start_pos", "slice"])
def test_training_with_a_changing_int_argument_matches_eager_grads(make):
    torch.manual_seed(0)

    class Sliced(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, n):
            return self.lin(x[:n]).tanh()
    model = make() if make else Sliced()
    ref = copy.deepcopy(model)
    cm = torch.compile(model, backend="opencann")
    fallbacks = len(eager_fallbacks())
    calls = list(_prompt_then_tokens()) if make else [(torch.randn(6, 4), n) for n in (2, 3, 5)]
    for a, n in calls:
        out, out_ref = cm(a, n), ref(a, n)
        assert _rel(out.detach(), out_ref.detach()) < 1e-5
        (out * out).mean().backward()
        (out_ref * out_ref).mean().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert _rel(p.grad, q.grad) < 1e-5, (n, name)
    assert eager_fallbacks()[fallbacks:] == []


# -- data-dependent sizes: eager, counted --------------------------------------------------
def _item_slice(x, k):
    return x[: k.item()] * 2


def _masked(x):
    return x[x > 0].sum() + x.nan_to_num().mean()


@pytest.mark.parametrize("fn,calls", [
    (_item_slice, [(_with_nan(6, 4), torch.tensor(k)) for k in (3, 5, 2)]),
    (_masked, [(_with_nan(6, 4),) for _ in range(3)]),
], ids=["item", "mask"])
def test_data_dependent_graphs_run_eagerly_and_are_counted(fn, calls):
    n = len(eager_fallbacks())
    with torch._dynamo.config.patch(capture_scalar_outputs=True,
                                    capture_dynamic_output_shape_ops=True):
        cf = torch.compile(fn, backend="opencann")
        for args in calls:
            torch.testing.assert_close(cf(*args), fn(*args), equal_nan=True)
    new = eager_fallbacks()[n:]
    assert len(new) == 1 and "from tensor values" in new[0]["reason"]
    assert "test_torch_compile_symbols.py:" in new[0]["reason"]
    assert recompiles(fn)["eager_fallbacks"] == 1


def test_data_dependent_training_graph_runs_eagerly_with_eager_grads():
    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, k):
            return self.lin(x[: k.item()]).relu().sum() + self.lin(x[x[:, 0] > 0]).sum()

    torch.manual_seed(0)
    m = Gate()
    ref = copy.deepcopy(m)
    n = len(eager_fallbacks())
    with torch._dynamo.config.patch(capture_scalar_outputs=True,
                                    capture_dynamic_output_shape_ops=True):
        cm = torch.compile(m, backend="opencann")
        for k in (2, 5, 3):
            x = torch.randn(6, 4)
            cm(x, torch.tensor(k)).backward()
            ref(x, torch.tensor(k)).backward()
            for p, q in zip(m.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad)
    new = eager_fallbacks()[n:]
    # the forward graph and the backward graph, both under the compile that made them
    assert len(new) == 2 and len({e["compile_id"] for e in new}) == 1
    assert recompiles(m)["eager_fallbacks"] == 2


def test_opencann_compile_keeps_its_data_dependent_error():
    class Masked(torch.nn.Module):
        def forward(self, x):
            return x[x > 0] * 2

    with pytest.raises(ConversionError, match="data-dependent value.*torch.compile"):
        opencann.compile(Masked(), (torch.randn(8),))
