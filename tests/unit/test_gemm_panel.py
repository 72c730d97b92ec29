"""The panel GEMM (`opencann.ops.kernels.gemm_panel_cpu`: the weight packed once into
NR-wide column panels, `gemm_tile`'s register tile) against ``F.linear``: row counts around
the tile's MR (1, MR - 1, MR, MR + 1, a last block of every size), N around NR (1, NR - 1,
NR, NR + 1, several panels), K from 1 to past 768, bias and none, NaN/Inf in x and W at
chosen positions propagating as in eager, a second call, output independence, ``out=``
contiguous and strided, the AVX-512 tile's shape run here too (LLVM splits its 16-lane
vectors on an AVX2 CPU: the same values), and one clear error per bad input. Tolerance as
for the GEMV (tests/unit/test_gemv_kernel.py): |out - ref64| <= 1e-5 * (|x| @ |W|^T + |b|)
elementwise (fp32 sums of K products in another order than MKL's)."""
import numba
import numpy as np
import pytest
import torch

from opencann.ops.kernels.gemm_panel_cpu import MR, NR, bind_panel, gemm_panel, pack_panels
from opencann.ops.kernels.gemm_tile import panel_shape, panel_tile
from helpers import check_linear


@pytest.mark.parametrize("m", [1, 2, MR // 3 + 1, MR - 1, MR, MR + 1, 2 * MR + MR // 3, 67])
@pytest.mark.parametrize("k,n", [(1, 1), (7, NR - 1), (33, NR + 1), (769, 3 * NR), (64, 2 * NR + 5)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(m, k, n, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    out = gemm_panel(x, w, b)
    check_linear(out, x, w, b)
    run = bind_panel(pack_panels(w, transposed=False), m, n)
    again = run(x, b)
    assert torch.equal(again, out)                 # the bound call: the same kernel, same bits
    out.add_(1)                                    # the result is the caller's
    assert torch.equal(run(x, b), again)
    buf = torch.full((m, n), float("nan"))
    assert run(x, b, buf) is buf and torch.equal(buf, again)
    assert torch.equal(run(x, b, buf), again)      # a second call into the same buffer


@pytest.mark.parametrize("m", [3, MR + 2])
def test_nan_and_inf_propagate_as_in_eager(m):
    g = torch.Generator().manual_seed(m)
    x, w, b = torch.randn(m, 40, generator=g), torch.randn(NR + 3, 40, generator=g), torch.randn(NR + 3, generator=g)
    x[1, 5] = float("nan")
    x[m - 1, 7] = float("inf")
    w[NR + 1, 2] = float("-inf")
    w[3, 9] = float("nan")
    check_linear(gemm_panel(x, w, b), x, w, b)


def test_strided_out_and_x_views():
    """x a column slice of a wider tensor (row stride != K), out the transpose of a
    contiguous buffer: the values land where they belong."""
    g = torch.Generator().manual_seed(1)
    wide, w, b = torch.randn(9, 70, generator=g), torch.randn(20, 50, generator=g), torch.randn(20, generator=g)
    x = wide[:, 10:60]
    out = torch.zeros(20, 9).t()
    run = bind_panel(pack_panels(w.t()), 9, 20)
    assert run(x, b, out) is out
    check_linear(out, x, w, b)


def test_transposed_weight_packs_as_nn_linear():
    w = torch.randn(30, 17)
    assert torch.equal(pack_panels(w.t()), pack_panels(w, transposed=False))
    p = pack_panels(w.t())
    assert p.shape == (-(-30 // NR), 17, NR) and p.is_contiguous()
    assert torch.equal(p[0, :, :min(NR, 30)], w.t()[:, :min(NR, 30)])
    assert not p[-1, :, 30 - (p.shape[0] - 1) * NR:].any()         # columns past N are zero


@pytest.mark.parametrize("width", [8, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_tile_of_either_width_matches(width, bias):
    """The micro-kernel at both widths (AVX2 6 x 16 and AVX-512 12 x 32) on the same data:
    one block of MR rows against the second panel of the packed weight, stored at an
    offset inside a larger destination (the bias read at its own offset); nothing else in
    the destination is written."""
    mr, nr = panel_shape(width)
    tile = panel_tile(mr, width, bias)

    @numba.njit
    def one(x, bp, dst, b):
        return tile(x, bp, 0, 1, dst, 2, 3, b, 4)
    g = torch.Generator().manual_seed(width)
    x, w = torch.randn(mr, 45, generator=g), torch.randn(45, 2 * nr, generator=g)
    b = torch.randn(nr + 7, generator=g)
    bp = w.view(45, 2, nr).permute(1, 0, 2).contiguous()
    dst = np.zeros((mr + 3, nr + 5), np.float32)
    one(x.numpy(), bp.numpy(), dst, b.numpy())
    got = torch.from_numpy(dst)
    check_linear(got[2:2 + mr, 3:3 + nr], x, w[:, nr:].t(), b[4:4 + nr] if bias else None)
    got[2:2 + mr, 3:3 + nr] = 0
    assert not got.any()


def test_bad_input_is_one_line():
    packed = pack_panels(torch.randn(20, 8).t())       # W [K=8, N=20]
    run = bind_panel(packed, 4, 20)
    for call, match in ((lambda: run(torch.randn(5, 8)), "x must be float32 \\[4, 8\\]"),
                        (lambda: run(torch.randn(4, 8).double()), "x must be float32"),
                        (lambda: run(torch.randn(4, 8), torch.randn(3)), "bias must be float32 \\[20\\]"),
                        (lambda: run(torch.randn(4, 8), None, torch.empty(4, 21)), "out must be float32"),
                        (lambda: bind_panel(packed, 0, 20), "rows must be a positive int"),
                        (lambda: bind_panel(packed, 4, 99), "does not match"),
                        (lambda: bind_panel(torch.randn(2, 8, 3), 4, 20), "pass it through pack_panels"),
                        (lambda: pack_panels(torch.randn(8, 20).double()), "2-D float32"),
                        (lambda: gemm_panel(torch.randn(4, 8), torch.randn(20, 9)), "x must be float32 \\[M, K\\]")):
        with pytest.raises(ValueError, match=match) as e:
            call()
        assert "\n" not in str(e.value)
