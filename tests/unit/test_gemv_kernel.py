"""The decode GEMV kernel (`opencann.ops.kernels.gemv_cpu.gemv`, 1..MAX_ROWS = 32 rows, and
its plan-time binding `bind_gemv`) against ``torch.nn.functional.linear``: every row count up
to 8 and the 8-row groups' edges past it (9, 16, 17, 32) with odd K and N (N not a multiple
of any tile's rows), bias and none, NaN/Inf in x and W at chosen positions propagating
as in eager, a second call, output independence, ``out=`` contiguous and strided, the
thread count changing no bit, and one clear error per bad input. Values are compared with
F.linear in float64; tolerance: the kernel sums the K products in fp32 in another order
than MKL, so finite outputs agree to fp32 rounding of a K-term dot product,
|out - ref64| <= 1e-5 * (|x| @ |W|^T + |b|) elementwise (the worst-case bound of a K-term
fp32 sum is K * 2^-24 relative to that magnitude; typical errors are ~sqrt(K) * 2^-24,
below 1e-5 for K <= 2048). NaN/Inf positions and Inf signs are eager's (fp32 F.linear)."""
import pytest
import torch

import gc
import weakref

from opencann.ops.kernels.gemv_cpu import MAX_ROWS, bind_gemv, gemv, pack_weight
from helpers import check_linear


@pytest.mark.parametrize("m", list(range(1, 9)) + [9, 16, 17, MAX_ROWS])
@pytest.mark.parametrize("k,n", [(1, 1), (7, 13), (33, 65), (769, 301), (2048, 17)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(m, k, n, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    w_nk = pack_weight(w)
    out = gemv(x, w_nk, b)
    check_linear(out, x, w, b)
    again = gemv(x, w_nk, b)
    assert torch.equal(again, out)                 # a second call: same bits
    out.add_(1)                                    # the result is the caller's
    assert not torch.equal(again, out)
    assert torch.equal(gemv(x, w_nk, b), again)
    run = bind_gemv(w_nk, m)                       # the bound call: the same kernel, same bits
    buf = torch.full((m, n), float("nan"))
    assert run(x, b, buf) is buf and torch.equal(buf, again)
    assert torch.equal(run(x, b, buf), again)      # a second call into the same buffer
    fresh = run(x, b)
    assert torch.equal(fresh, again) and fresh.data_ptr() != run(x, b).data_ptr()


@pytest.mark.parametrize("m", [1, 3, 8])
def test_transposed_weight_and_out_buffer(m):
    g = torch.Generator().manual_seed(1)
    x, w_t, b = torch.randn(m, 40, generator=g), torch.randn(40, 27, generator=g), torch.randn(27, generator=g)
    w_nk = pack_weight(w_t, transposed=True)
    out = torch.empty(m, 27)
    r = gemv(x, w_nk, b, out=out)
    assert r is out
    check_linear(out, x, w_t.t(), b)
    strided = torch.empty(27, m).t()               # a non-contiguous out: filled through a copy
    assert gemv(x, w_nk, b, out=strided) is strided
    assert torch.equal(strided, out)
    xs = torch.randn(40, m, generator=g).t()       # a non-contiguous x
    check_linear(gemv(xs, w_nk, b), xs, w_t.t(), b)


@pytest.mark.parametrize("m", [1, 2, 4, 5, 6, 7, 8, 13, 31])
def test_nan_and_inf_propagate_like_eager(m):
    g = torch.Generator().manual_seed(2)
    k, n = 137, 31                   # n odd: the last column is a tile's padded one
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    if m > 1:
        x[0, 3] = float("nan")       # row 0 all NaN
    w[5, 7] = float("inf")           # column 5: +-Inf in every row (NaN in row 0)
    w[9, 100] = float("-inf")        # past the first CHUNK of K
    w[11, 4] = float("nan")          # column 11 all NaN
    w[n - 1, 70] = float("inf")      # the last column (a partial tile)
    b[13] = float("inf")
    if m > 2:                        # (at m = 2 no output would stay finite)
        x[m - 1, 8] = float("inf")   # Inf * W[:, 8] in the last row (a tile's padding repeats it)
    out = gemv(x, pack_weight(w), b)
    check_linear(out, x, w, b)
    assert torch.isnan(out[:, 11]).all() and torch.isinf(out[:, 13]).any()
    assert torch.isinf(out[-1, n - 1]) or torch.isnan(out[-1, n - 1])
    if m > 1:
        assert torch.isnan(out[0]).all() and not torch.isnan(out[1:]).all()


@pytest.mark.parametrize("bad,match", [
    (lambda: gemv(torch.randn(MAX_ROWS + 1, 8), pack_weight(torch.randn(4, 8))), f"1 <= M <= {MAX_ROWS}"),
    (lambda: gemv(torch.randn(0, 8), pack_weight(torch.randn(4, 8))), f"1 <= M <= {MAX_ROWS}"),
    (lambda: gemv(torch.randn(1, 8, dtype=torch.float64), pack_weight(torch.randn(4, 8))), "float32"),
    (lambda: gemv(torch.randn(1, 8), pack_weight(torch.randn(4, 9))), "pack_weight"),
    (lambda: gemv(torch.randn(1, 8), torch.randn(8, 4).t()), "C-contiguous"),
    (lambda: gemv(torch.randn(1, 8), pack_weight(torch.randn(4, 8)), torch.randn(5)), "bias"),
    (lambda: pack_weight(torch.randn(4, 8, dtype=torch.float16)), "float32"),
    (lambda: gemv(torch.randn(1, 8), pack_weight(torch.randn(4, 8)), threads=10 ** 4),
     r"gemv: threads must be an int in 1\.\."),
    (lambda: gemv(torch.randn(1, 8), pack_weight(torch.randn(4, 8)), threads=0), "gemv: threads"),
    (lambda: gemv(torch.randn(1, 8), pack_weight(torch.randn(4, 8)), threads=1.5), "gemv: threads"),
])
def test_bad_input_is_one_clear_error(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


@pytest.mark.parametrize("m", [1, 4, 8])
def test_threads_follow_torch_and_change_no_bit(m):
    import numba
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(m, 700, generator=g), torch.randn(91, 700, generator=g)
    w_nk = pack_weight(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemv(x, w_nk, None)
        assert numba.get_num_threads() == 1
        torch.set_num_threads(2)
        assert torch.equal(gemv(x, w_nk, None), one)
    finally:
        torch.set_num_threads(before)
    check_linear(one, x, w, None)


@pytest.mark.parametrize("m", [1, 3, 8])
def test_bound_gemv_strided_inputs_and_nan_inf(m):
    g = torch.Generator().manual_seed(4)
    k, n = 301, 45
    w = torch.randn(n, k, generator=g)
    x, b = torch.randn(k, m, generator=g).t(), torch.randn(2 * n, generator=g)[::2]  # strided x, bias
    if m > 1:
        x[m - 1, 5] = float("nan")                 # the last row all NaN
    w[7, 200] = float("-inf")                      # column 7: +-Inf (NaN in a NaN row)
    run = bind_gemv(pack_weight(w), m)
    out = torch.empty(n, m).t()                    # a non-contiguous out: filled through a copy
    assert run(x, b, out) is out
    check_linear(out, x, w, b)
    assert not torch.isfinite(out[:, 7]).any()
    if m > 1:
        assert torch.isnan(out[m - 1]).all() and torch.isfinite(out[0, :7]).all()


def test_bound_gemv_bad_input_is_one_clear_error():
    w_nk = pack_weight(torch.randn(6, 8))
    run = bind_gemv(w_nk, 2)
    with pytest.raises(ValueError, match=r"x must be float32 \[2, 8\]"):
        run(torch.randn(3, 8))                     # another row count than bound
    with pytest.raises(ValueError, match=r"x must be float32 \[2, 8\]"):
        run(torch.randn(2, 9))
    with pytest.raises(ValueError, match=r"x must be float32"):
        run(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"out must be float32 \[2, 6\]"):
        run(torch.randn(2, 8), None, torch.empty(2, 5))
    with pytest.raises(ValueError, match=f"rows must be 1..{MAX_ROWS}"):
        bind_gemv(w_nk, MAX_ROWS + 1)
    with pytest.raises(ValueError, match="pack_weight"):
        bind_gemv(torch.randn(8, 6).t(), 1)
    x = torch.randn(2, 8)
    assert torch.allclose(run(x), torch.nn.functional.linear(x, w_nk), atol=1e-5)  # still usable


def test_bound_gemv_keeps_its_weight_alive():
    w_nk = pack_weight(torch.randn(16, 32))
    ref = weakref.ref(w_nk)
    x = torch.randn(1, 32)
    want = torch.nn.functional.linear(x, w_nk)
    run = bind_gemv(w_nk, 1)
    del w_nk
    gc.collect()
    assert ref() is not None                       # a weak cache of packed copies still sees it
    assert torch.allclose(run(x), want, atol=1e-5)
    del run
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("n", list(range(1, 18)) + [29, 31, 33])
def test_one_row_every_group_split(n):
    """M = 1 pairs four-row groups half the matrix apart: every N (odd and even group
    counts, a partial last group) maps each output to its own row; NaN/Inf in the first and
    the far half's rows land where eager puts them."""
    g = torch.Generator().manual_seed(n)
    k = 70
    x, w, b = torch.randn(1, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    w[n - 1, 3] = float("inf")                     # the last row: the far half's partial group
    if n > 2:
        w[0, 60] = float("nan")
    run = bind_gemv(pack_weight(w), 1)
    out = run(x, b)
    ref = torch.nn.functional.linear(x, w, b)
    assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.isinf(out[0, n - 1])
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    fin = torch.isfinite(ref)
    assert torch.allclose(out[fin], ref[fin], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(run(x, b), out, rtol=0, atol=0, equal_nan=True)  # a second call


def test_bound_gemv_repeat_calls_read_new_values_and_new_tensors():
    """A call with the last call's x/out/bias reuses its views (values written in place
    in between are read); other tensors are bound afresh; each equals F.linear."""
    import torch.nn.functional as F
    from opencann.ops.kernels.gemv_cpu import bind_gemv
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    run = bind_gemv(w.contiguous(), 2)
    x, out = torch.randn(2, 24, generator=g), torch.empty(2, 40)
    for call in range(3):
        x.copy_(torch.randn(2, 24, generator=g))
        x[0, call] = float("nan") if call == 2 else x[0, call]
        assert run(x, b, out) is out
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5, equal_nan=True)
    other = torch.empty(2, 40)
    torch.testing.assert_close(run(x, None, other), F.linear(x, w), rtol=1e-5, atol=1e-5,
                               equal_nan=True)
