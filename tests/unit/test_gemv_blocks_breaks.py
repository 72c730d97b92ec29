"""The decode GEMV's row blocks (`gemv_cpu._gemv_blocks_kernel`: 5..MAX_ROWS (32) rows of x as blocks
of `_MB` rows, a last partial block repeating x's last row, computed and never stored)
where they break most easily, against eager ``F.linear`` (NaN/Inf positions and Inf signs)
and float64 (`helpers.check_linear`), on random inputs:

- NaN, +Inf, -Inf, -0.0 and a denormal in x's last row (the partial block's repeated
  row), in the rows just below and at a block boundary, in W's last row and the bias;
  the result bit-identical on 1 and 2 threads and on a second call;
- an ``out`` overlapping x or the bias (``out=x``, a shifted window of one buffer, the
  bias a row of ``out``): the kernel writes outputs while other tiles still read x and
  the bias, so such an ``out`` is filled through a copy (it had been read after being
  written: wrong values at every row count, bound or not);
- x as views, ``out`` non-contiguous, one bound kernel reused after its buffers change in
  place and called from 4 Python threads at once;
- the LinearAct path with the GEMV forced, [M, K] and [B, T, K], saved and loaded."""
import threading

import pytest
import torch
import torch.nn.functional as F

import opencann
from opencann.ops.kernels import cpu as cpu_kernels
from opencann.ops.kernels.gemv_cpu import _MB, bind_gemv, gemv, pack_weight
from helpers import ForcedGemmChoice, check_linear

SPECIALS = [float("nan"), float("inf"), float("-inf"), -0.0, 1e-40]


def _bits(t):
    return t.contiguous().view(torch.int32)


def _like_eager(out, x, w, b):
    """NaN/Inf positions and signs as eager's; the rows with no special value within fp32
    rounding of float64."""
    ref = F.linear(x, w, b)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    assert torch.equal(out[torch.isinf(ref)], ref[torch.isinf(ref)])
    rows = torch.isfinite(ref).all(1)
    if rows.any():
        check_linear(out[rows], x[rows], w, b)


def _boundary_rows(m):
    """x's last row, the rows just below and at the last block boundary, and `_MB` - 1."""
    last_block = (m - 1) // _MB * _MB
    return sorted({m - 1, last_block - 1, last_block, _MB - 1} & set(range(m)))


@pytest.mark.parametrize("m", [5, 6, 7, 8, 9, 13, 31, 32])
@pytest.mark.parametrize("k,n", [(9, 7), (65, 33)])
def test_special_values_at_block_edges_and_thread_bits(m, k, n):
    g = torch.Generator().manual_seed(m * 100 + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    wn = pack_weight(w)
    for r in _boundary_rows(m):
        for v in SPECIALS:
            x = torch.randn(m, k, generator=g)
            x[r, k // 2] = v
            one, two = gemv(x, wn, b, threads=1), gemv(x, wn, b, threads=2)
            assert torch.equal(_bits(one), _bits(two)), (r, v)
            assert torch.equal(_bits(gemv(x, wn, b, threads=2)), _bits(one))   # a second call
            _like_eager(one, x, w, b)
    x = torch.randn(m, k, generator=g)
    for v in SPECIALS[:3]:               # in W's last row (a tile's padded row repeats it), in the bias
        w2, b2 = w.clone(), b.clone()
        w2[n - 1, k - 1], b2[n // 2] = v, v
        _like_eager(gemv(x, pack_weight(w2), b), x, w2, b)
        _like_eager(gemv(x, wn, b2), x, w, b2)


@pytest.mark.parametrize("m", [1, 3, 5, 8, 13, 32])
def test_out_overlapping_x_or_bias_gets_the_right_values(m):
    g = torch.Generator().manual_seed(m)
    k = n = 24
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    wn = pack_weight(w)
    x = torch.randn(m, k, generator=g)
    same = x.clone()
    assert gemv(same, wn, b, out=same) is same            # out is x
    check_linear(same, x, w, b)
    run = bind_gemv(wn, m)
    for _ in range(2):                                     # bound, twice (the cached-views path)
        same = x.clone()
        assert run(same, b, same) is same
        check_linear(same, x, w, b)
    buf = torch.randn(m + 1, k, generator=g)               # x rows 1.., out rows 0..m-1
    buf[1:] = x
    gemv(buf[1:], wn, b, out=buf[:m])
    check_linear(buf[:m], x, w, b)
    out = torch.empty(m, n)
    out[0] = b                                             # the bias is out's first row
    gemv(x, wn, out[0], out=out)
    check_linear(out, x, w, b)
    assert run.prebind(x, b, x) is None                   # no prebound call on an overlap
    assert run.prebind(x, b, torch.empty(m, n)) is not None


@pytest.mark.parametrize("m", [5, 8, 13])
def test_views_buffers_changed_in_place_and_threads(m):
    g = torch.Generator().manual_seed(m + 7)
    k, n = 40, 33
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    wn = pack_weight(w)
    big = torch.randn(m + 3, 2 * k + 1, generator=g)
    for xv in (big[2:2 + m, 1:k + 1], big[:m, ::2][:, :k], torch.randn(k, m, generator=g).t()):
        strided = torch.empty(n, m).t()
        assert gemv(xv, wn, b, out=strided) is strided
        check_linear(strided, xv, w, b)
    run = bind_gemv(wn, m)
    x, out, bias = torch.randn(m, k, generator=g), torch.empty(m, n), b.clone()
    for step in range(3):                                   # the same tensors, new values
        assert run(x, bias, out) is out
        _like_eager(out, x, w, bias)
        x.normal_(generator=g)
        bias.normal_(generator=g)
        x[m - 1, step] = SPECIALS[step]
    xs = [torch.randn(m, k, generator=g) for _ in range(4)]
    want = [gemv(t, wn, b) for t in xs]
    outs, errors = [torch.empty(m, n) for _ in range(4)], []

    def work(i):
        for _ in range(50):
            run(xs[i], b, outs[i])
            if not torch.equal(outs[i], want[i]):
                errors.append(i)
                return
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_linear_act_with_the_gemv_forced_saved_and_loaded(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", ForcedGemmChoice("gemv"))
    torch.manual_seed(3)
    seq = torch.nn.Sequential(torch.nn.Linear(65, 48), torch.nn.GELU(), torch.nn.Linear(48, 31)).eval()
    for shape in [(5, 65), (13, 65), (32, 65), (2, 3, 65), (4, 7, 65)]:
        cm = opencann.compile(seq, (torch.randn(*shape),))
        assert {n.meta.get("kernel") for n in cm.graph.nodes if n.op == "LinearAct"} == {"gemv"}
        x = torch.randn(*shape)
        x.view(-1, 65)[-1, 4] = float("nan")                   # the last (partial block's) row
        with torch.no_grad():
            ref = seq(x)
        out = cm(x)
        assert torch.equal(torch.isnan(out), torch.isnan(ref))
        assert torch.allclose(out.nan_to_num(), ref.nan_to_num(), rtol=1e-5, atol=1e-5)
        path = str(tmp_path / "m.ocm")
        opencann.save(cm, path)
        assert torch.equal(_bits(opencann.load(path)(x)), _bits(out))
