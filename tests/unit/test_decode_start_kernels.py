"""A decode step's first ops on the CPU: Embedding (`embedding_cpu`: a numba row copy into
the planned buffer) and the first RmsNorm (`rms_norm_cpu`: a numba row kernel, prebound)
for a few rows (the decode graph gathering its RoPE / position rows by ``positions``
itself: tests/models/test_llm_compiled.py). Each against eager: values (Embedding bit for bit,
RmsNorm to fp32 rounding, also where a reassociated product or an fp32 running sum had
left eager's result), NaN / inf positions, a second call, output independence, and
eager's error for an index out of range (the executor's line naming the node); longer
inputs keep ATen's kernels. The models give each op a consumer, so that it writes a
planned buffer (a graph output has none and runs ATen's kernel), and count the numba
kernel's calls."""
import pytest
import torch
from helpers import run_threads

import opencann
from opencann.ops.kernels import embedding_cpu, rms_norm_cpu
from opencann.ops.kernels.cpu_patterns import rms_norm_writes_out
from opencann.ops.kernels.numpy_views import NumpyViews
from opencann.ops.kernels.embedding_cpu import decode_rows as embedding_rows
from opencann.runtime.executor import ExecutionError


class LlamaNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm, spelled out (upcast, then the weight)."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d))
        self.eps = eps

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Consumed(torch.nn.Module):
    """``op(x)`` followed by a consumer (so its output is a planned buffer), returned."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x):
        y = self.op(x)
        return torch.cat([y, y], 0)[: y.shape[0]]


def _counted(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def counting(*args):
        calls.append(1)
        return real(*args)
    monkeypatch.setattr(module, name, counting)
    return calls


def _ulps(a, b):
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max().item()


def _nodes(cm, op):
    return [n for n in cm.graph.nodes if n.op == op]


def _same_specials_and_close(out, ref, ulps=4):
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    fin = torch.isfinite(ref)
    tol = ulps * torch.finfo(torch.float32).eps * ref[fin].abs().clamp_min(1e-30)
    assert ((out[fin] - ref[fin]).abs() <= tol + 1e-30).all()


@pytest.mark.parametrize("shape", [(1, 1, 768), (4, 768), (2, 3, 8), (1, 5)])
def test_rms_norm_of_decode_rows_matches_eager(shape, monkeypatch):
    calls = _counted(monkeypatch, rms_norm_cpu, "_rows")
    torch.manual_seed(0)
    m = Consumed(LlamaNorm(shape[-1])).eval()
    x = torch.randn(shape)
    cm = opencann.compile(m, (x,))
    norms = _nodes(cm, "RmsNorm")
    assert norms and all(rms_norm_writes_out(n) for n in norms)
    for k in range(3):
        x = torch.randn(shape) * 10 ** k
        flat = x.view(-1, shape[-1])
        if flat.shape[0] > 1:          # NaN, inf and overflowing rows beside finite ones
            flat[0, 1] = float("nan")
            flat[-1, 0] = float("inf") if k != 1 else 3e20
        with torch.no_grad():
            ref = m(x)
        out = cm(x)
        _same_specials_and_close(out, ref)
        again = cm(x)
        assert torch.equal(again.nan_to_num(), out.nan_to_num())
        out.add_(1)                              # the output is the caller's
        assert not torch.equal(again.nan_to_num(), out.nan_to_num())
    assert len(calls) == 6                       # the numba kernel ran every call


class EmbeddedNorm(torch.nn.Module):
    """A decode step's start: one row's Embedding, then LlamaRMSNorm (the prebound path:
    both operands are planned buffers or constants), then a consumer."""

    def __init__(self, rows, w, eps):
        super().__init__()
        self.e = torch.nn.Embedding.from_pretrained(rows)
        self.n = LlamaNorm(rows.shape[1], eps)
        with torch.no_grad():
            self.n.weight.copy_(w)

    def forward(self, i):
        h = self.e(i)
        return torch.cat([self.n(h), h], 0)[:1]


def _outlier_row(d):
    row = torch.full((d,), 0.0312 ** 0.5)   # squares just under half an ulp of 1e6 ...
    row[0] = 1e3                            # ... beside one large value (a massive activation)
    return row[None]


@pytest.mark.parametrize("rows,w,eps", [
    (torch.full((1, 64), 2e18), torch.full((64,), 1e21), 1e-6),       # x·w would overflow
    (torch.full((1, 64), 1e-30), torch.linspace(1, 2, 64) * 1e-14, 1e-30),  # x·w a denormal
    (torch.full((1, 64), 1e-45), torch.linspace(-0.4, 0.4, 64), 0.0),  # x² = 0, eps 0: ±inf
    (_outlier_row(4096), torch.ones(4096), 1e-6),     # an fp32 running sum lost the small squares
    (_outlier_row(8190), torch.ones(8190), 1e-6),
], ids=["x_w_overflow", "x_w_denormal", "denormal_eps0", "outlier4096", "outlier8190"])
def test_rms_norm_keeps_eagers_product_order_and_sum(rows, w, eps):
    m = EmbeddedNorm(rows, w, eps).eval()
    i = torch.tensor([[0]])
    cm = opencann.compile(m, (i,))
    with torch.no_grad():
        ref = m(i)
    out = cm(i)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(out.isinf(), ref.isinf()) and torch.equal(out[ref.isinf()], ref[ref.isinf()])
    fin = torch.isfinite(ref)
    assert not fin.any() or _ulps(out[fin], ref[fin]) <= 4


def test_rms_norm_of_many_rows_and_bf16_keep_atens_kernel():
    torch.manual_seed(0)
    m = LlamaNorm(768).eval()
    cm = opencann.compile(m, (torch.randn(64, 768),))     # 64 x 768 elements: a prefill
    assert not any(rms_norm_writes_out(n) for n in _nodes(cm, "RmsNorm"))
    x = torch.randn(64, 768)
    with torch.no_grad():
        assert torch.equal(cm(x), m(x))                  # ATen's kernel: eager's bits
    mb = LlamaNorm(64).eval().to(torch.bfloat16)
    xb = torch.randn(2, 64, dtype=torch.bfloat16)
    cb = opencann.compile(mb, (xb,))
    assert not any(rms_norm_writes_out(n) for n in _nodes(cb, "RmsNorm"))
    with torch.no_grad():
        assert torch.equal(cb(xb), mb(xb))


@pytest.mark.parametrize("ids_shape", [(1, 1), (3, 2), (4,)])
def test_embedding_of_decode_rows_is_eagers_bits(ids_shape, monkeypatch):
    calls = _counted(monkeypatch, embedding_cpu, "_gather")
    torch.manual_seed(0)
    m = Consumed(torch.nn.Embedding(50, 16)).eval()
    with torch.no_grad():
        m.op.weight[7, 3] = float("nan")
        m.op.weight[7, 4] = -0.0
        m.op.weight[9, 0] = float("-inf")
    ids = torch.randint(0, 50, ids_shape)
    cm = opencann.compile(m, (ids,))
    emb = _nodes(cm, "Embedding")
    assert emb and all(embedding_rows(n) for n in emb)
    for k in range(3):
        ids = torch.randint(0, 50, ids_shape)
        ids.view(-1)[0] = 7 if k != 2 else 9
        with torch.no_grad():
            ref = m(ids)
        out = cm(ids)
        assert out.shape == ref.shape
        assert torch.equal(out.view(torch.int32), ref.view(torch.int32))   # NaN, -0.0 too
        again = cm(ids)
        out.add_(1)
        assert torch.equal(again.view(torch.int32), ref.view(torch.int32))
    assert len(calls) == 6


@pytest.mark.parametrize("bad", [50, -1, 10 ** 6])
def test_embedding_index_out_of_range_is_eagers_error_and_writes_nothing(bad):
    m = Consumed(torch.nn.Embedding(50, 16)).eval()
    cm = opencann.compile(m, (torch.tensor([[3]]),))
    good = cm(torch.tensor([[3]])).clone()
    with pytest.raises(IndexError, match="index out of range"):
        m(torch.tensor([[bad]]))
    with pytest.raises(ExecutionError, match="Embedding.* index out of range in self$"):
        cm(torch.tensor([[bad]]))
    assert torch.equal(cm(torch.tensor([[3]])), good)


def test_embedding_of_many_rows_keeps_atens_kernel():
    m = torch.nn.Embedding(100, 768).eval()
    ids = torch.randint(0, 100, (8, 16))          # 128 rows x 768: a prefill's gather
    cm = opencann.compile(m, (ids,))
    assert not any(embedding_rows(n) for n in _nodes(cm, "Embedding"))
    ids = torch.randint(0, 100, (8, 16))
    with torch.no_grad():
        assert torch.equal(cm(ids), m(ids))


def test_threads_share_the_bound_kernels_views_memo():
    """One compiled model called from several threads: its bound kernels share one
    `NumpyViews` memo, whose evictions must not race (they raised KeyError / 'dictionary
    changed size during iteration'); the memo alone, every call a miss, too."""
    views, errors = NumpyViews(capacity=2), []
    pool = [torch.empty(3) for _ in range(64)]    # alive: their ids stay theirs

    def churn(k):
        try:
            for j in range(20000):                # nearly every lookup a miss
                assert views.shaped(pool[(7 * j + k) % 64], (3,)) is not None
        except Exception as e:   # noqa: BLE001 - any error is the failure
            errors.append(repr(e))
    m = Consumed(torch.nn.Embedding(100, 32)).eval()
    cm = opencann.compile(m, (torch.tensor([[1, 2, 3]]),))

    def call(seed):
        g = torch.Generator().manual_seed(seed)
        try:
            for _ in range(300):
                i = torch.randint(0, 100, (1, 3), generator=g)
                with torch.no_grad():
                    assert torch.equal(cm(i), m(i))
        except Exception as e:   # noqa: BLE001
            errors.append(repr(e))
    run_threads([(churn, (k,)) for k in range(6)] + [(call, (s,)) for s in range(4)])
    assert not errors, errors[:3]
