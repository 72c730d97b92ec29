"""FlashAttention (numba CPU backend) against a float64 matmul + softmax reference.

Relative error = max|a - b| / max|ref|. Tolerances: fp32 1e-5 (output) and 1e-4
(gradients); fp16/bf16 1e-2. Inputs are seeded random normals, never zeros.
"""
import zlib

import pytest
import torch
import torch.nn.functional as F

from opencann.ops.flash_attention import (attention_reference, flash_attention,
                                          flash_attention_forward)


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def make(seed, B, H, Hk, Sq, Sk, D, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, s, D, generator=g).to(dtype) for h, s in ((H, Sq), (Hk, Sk), (Hk, Sk))], g


def make_mask(kind, g, B, H, Sq, Sk):
    if kind == "bool_full":
        return torch.rand(B, H, Sq, Sk, generator=g) > 0.3
    if kind == "bool_bcast":
        return torch.rand(Sq, Sk, generator=g) > 0.4  # broadcast over batch and heads
    if kind == "float_bcast":
        return torch.randn(B, 1, 1, Sk, generator=g)  # per-key bias
    if kind == "float_heads":
        m = torch.randn(1, H, Sq, Sk, generator=g)
        return m.masked_fill(torch.rand(1, H, Sq, Sk, generator=g) > 0.8, float("-inf"))
    return None


# (B, H, Hk, Sq, Sk, D, causal, mask, tiles) - tails not multiple of tiles, Sq != Sk, GQA, MQA
CASES = [
    (1, 2, 2, 37, 53, 16, False, None, (16, 16)),
    pytest.param((2, 4, 2, 64, 64, 32, True, None, (16, 32)),   # causal, no mask: the last
                 marks=pytest.mark.full),                      # case covers it in make test
    (1, 6, 2, 45, 70, 24, "bottom_right", "bool_bcast", (16, 16)),
    (2, 4, 1, 70, 33, 16, "top_left", "float_bcast", (32, 16)),
    (1, 4, 4, 29, 29, 64, False, "bool_full", (16, 48)),
    (2, 2, 1, 33, 81, 40, "bottom_right", "float_heads", (48, 32)),
    (1, 2, 2, 100, 100, 32, True, None, None),  # planner-chosen tiles
]


@pytest.mark.parametrize("case", CASES)
def test_fp32_matches_reference(case):
    B, H, Hk, Sq, Sk, D, causal, mk, tiles = case
    (q, k, v), g = make(zlib.crc32(repr(case).encode()) % 10_000, B, H, Hk, Sq, Sk, D)  # per case, every run
    mask = make_mask(mk, g, B, H, Sq, Sk)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = flash_attention(qq, kk, vv, attn_mask=mask, causal=causal, tiles=tiles)
    do = torch.randn(out.shape, generator=g)
    out.backward(do)
    rq, rk, rv = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(rq, rk, rv, attn_mask=mask, causal=causal)
    ref.backward(do.double())
    assert not torch.isnan(out).any()
    assert rel(out, ref) < 1e-5
    for a, b in ((qq, rq), (kk, rk), (vv, rv)):
        assert not torch.isnan(a.grad).any()
        assert rel(a.grad, b.grad) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes(dtype):
    (q, k, v), g = make(7, 1, 4, 2, 50, 61, 32, dtype)
    mask = make_mask("float_bcast", g, 1, 4, 50, 61)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = flash_attention(qq, kk, vv, attn_mask=mask, causal="bottom_right", tiles=(16, 32))
    assert out.dtype == dtype
    do = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(do)
    rq, rk, rv = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(rq, rk, rv, attn_mask=mask, causal="bottom_right")
    ref.backward(do.double())
    assert rel(out, ref) < 1e-2
    for a, b in ((qq, rq), (kk, rk), (vv, rv)):
        assert a.grad.dtype == dtype and rel(a.grad, b.grad) < 1e-2


def test_bsnd_layout_matches_bnsd():
    (q, k, v), g = make(3, 2, 4, 2, 40, 40, 16)
    ref, _ = attention_reference(q, k, v, causal=True)
    out = flash_attention(*(t.transpose(1, 2).contiguous() for t in (q, k, v)),
                          causal=True, layout="BSND", tiles=(16, 16))
    assert out.shape == (2, 40, 4, 16)
    assert rel(out.transpose(1, 2), ref) < 1e-5


def test_every_output_element_written():
    (q, k, v), g = make(11, 1, 3, 1, 45, 38, 24)
    out = torch.full((1, 3, 45, 24), float("nan"))
    o, lse = flash_attention_forward(q, k, v, causal="bottom_right", tiles=(16, 16), out=out)
    assert o.data_ptr() == out.data_ptr()
    assert not torch.isnan(out).any()
    ref, ref_lse = attention_reference(q, k, v, causal="bottom_right")
    assert rel(out, ref) < 1e-5
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert rel(lse[fin], ref_lse[fin]) < 1e-5


def test_fully_masked_rows_give_zero_output_and_gradient():
    (q, k, v), g = make(5, 1, 2, 2, 30, 20, 16)
    mask = torch.rand(1, 2, 30, 20, generator=g) > 0.5
    mask[:, :, 3] = False  # row 3 sees nothing; bottom_right with Sq > Sk hides rows 0..9 too
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = flash_attention(qq, kk, vv, attn_mask=mask, causal="bottom_right", tiles=(16, 16))
    out.backward(torch.randn(out.shape, generator=g))
    assert torch.equal(out[:, :, :10], torch.zeros_like(out[:, :, :10]))
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
    assert torch.equal(qq.grad[:, :, :10], torch.zeros_like(qq.grad[:, :, :10]))
    for t in (out, qq.grad, kk.grad, vv.grad):
        assert torch.isfinite(t).all()
    ref, _ = attention_reference(q, k, v, attn_mask=mask, causal="bottom_right")
    assert rel(out, ref) < 1e-5


def test_reference_agrees_with_torch_sdpa():
    (q, k, v), g = make(2, 2, 4, 4, 33, 47, 16)
    mask = make_mask("bool_bcast", g, 2, 4, 33, 47)
    mask[:, 0] = True  # no fully masked row (tested in test_nan_semantics.py)
    ref, _ = attention_reference(q, k, v, attn_mask=mask)
    sd = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    assert rel(ref, sd) < 1e-12
    ref, _ = attention_reference(q, k, v, causal=True)
    sd = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert rel(ref, sd) < 1e-12


def test_trains():
    (q, k, v), g = make(9, 1, 2, 2, 24, 24, 16)
    w = torch.nn.Parameter(torch.randn(16, 16, generator=g) * 0.1)
    opt = torch.optim.SGD([w], lr=0.5)
    losses = []
    for _ in range(5):
        out = flash_attention(q @ w, k, v, causal=True, tiles=(16, 16))
        loss = (out - v).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(layout="NBSD"), "layout"),
    (dict(causal="diagonal"), "causal"),
    (dict(attn_mask=torch.ones(3, 7, dtype=torch.bool)), "broadcast"),
    (dict(backend="cuda"), "backend"),
])
def test_bad_arguments(kwargs, match):
    (q, k, v), _ = make(1, 1, 2, 2, 8, 8, 16)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v, **kwargs)


def test_bad_shapes():
    (q, k, v), _ = make(1, 1, 4, 2, 8, 8, 16)
    with pytest.raises(ValueError, match="4 "):
        flash_attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="head dim"):
        flash_attention(q, k[..., :8], v[..., :8])
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        flash_attention(q[:, :3], k, v)


def test_public_spelling_opencann_ops_flash_attention():
    """The issue's API: ``opencann.ops.flash_attention(q, k, v, ...)`` trains."""
    import opencann.ops as ops
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 2, 33, 16, generator=g, requires_grad=True)
    k, v = torch.randn(1, 1, 45, 16, generator=g), torch.randn(1, 1, 45, 16, generator=g)
    out = ops.flash_attention(q, k, v, causal="bottom_right")
    out.square().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all() and q.grad.abs().max() > 0


def test_forward_only_long_sequence_uses_256_row_blocks_correctly():
    """Inference (no grad) at S >= 512 takes the forward-only 256-row query blocks, a
    causal one `CPU_CAUSAL_FORWARD_BLOCKS`; the tails (600 = 2*256 + 88 = 4*128 + 88)
    and a causal bottom-right mask must still be exact."""
    from opencann.ops.flash_attention.api import CPU_FORWARD_BLOCK_Q, _default_tiles
    assert _default_tiles("numba", 64, 600, 700, torch.float32, True)[0] == CPU_FORWARD_BLOCK_Q
    bq, bk = _default_tiles("numba", 64, 600, 700, torch.float32, True, True)
    assert bq == 128 and bk <= bq    # causal: key tiles above the diagonal skipped
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, 2, 600, 64, generator=g)
    k, v = torch.randn(1, 2, 700, 64, generator=g), torch.randn(1, 2, 700, 64, generator=g)
    import opencann.ops as ops
    with torch.no_grad():
        out = ops.flash_attention(q, k, v, causal="bottom_right")
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(),
        attn_mask=torch.ones(600, 700, dtype=torch.bool).tril(100))
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


@pytest.mark.parametrize("sq,sk", [(5, 5), (64, 64), (100, 100), (200, 200), (257, 300), (520, 520)])
def test_causal_forward_blocks_match_the_reference_at_every_length(sq, sk):
    """A causal forward (an LLM prefill: GQA, bottom-right when S_k > S_q) on the blocks
    `CPU_CAUSAL_FORWARD_BLOCKS` gives, at lengths below, at and across a block boundary,
    float64 SDPA's values, NaN rows where a query is NaN, twice the same bits."""
    from opencann.ops.flash_attention.api import CPU_CAUSAL_FORWARD_BLOCKS, _default_tiles
    bq, bk = _default_tiles("numba", 64, sq, sk, torch.float32, True, True)
    assert bq == next(b for top, b in CPU_CAUSAL_FORWARD_BLOCKS if top is None or sq <= top)
    assert bk <= bq
    g = torch.Generator().manual_seed(sq)
    q = torch.randn(1, 6, sq, 64, generator=g)
    k, v = torch.randn(1, 2, sk, 64, generator=g), torch.randn(1, 2, sk, 64, generator=g)
    q[0, 1, sq // 2, 3] = float("nan")
    from opencann.ops.flash_attention.api import flash_attention_forward
    out, _ = flash_attention_forward(q, k, v, causal="bottom_right")
    again, _ = flash_attention_forward(q, k, v, causal="bottom_right")
    mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(3, 1), v.double().repeat_interleave(3, 1), attn_mask=mask)
    assert torch.equal(out.isnan(), ref.isnan()) and out.isnan().any()
    fin = ~ref.isnan()
    assert ((out.double()[fin] - ref[fin]).abs().max() / ref[fin].abs().max()).item() < 1e-5
    assert torch.equal(out.nan_to_num(), again.nan_to_num())


def test_tile_gemms_leave_the_callers_blas_threads_as_they_were():
    """The kernels run their tile GEMMs on a sequential BLAS (MKL's thread-local count
    set to 1 per task, restored after): the calling thread's MKL count is what it was
    before a forward and a backward, and a 2-thread causal GQA prefill still matches
    the reference, twice."""
    import ctypes
    import os

    from opencann.ops.flash_attention import cpu
    if not cpu.BLAS_NAME.startswith("mkl"):
        pytest.skip("the tile GEMMs run on OpenBLAS here: no MKL thread count to keep")
    mkl = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        before = mkl.MKL_Get_Max_Threads()
        (q, k, v), _ = make(11, 1, 6, 2, 96, 96, 32)
        ref, _ = attention_reference(q.double(), k.double(), v.double(), causal=True)
        for _ in range(2):
            out, _ = flash_attention_forward(q, k, v, causal=True, tiles=(32, 32))
            assert rel(out, ref) < 1e-5
            assert mkl.MKL_Get_Max_Threads() == before
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        flash_attention(qg, kg, vg, causal=True, tiles=(32, 32)).sum().backward()
        assert mkl.MKL_Get_Max_Threads() == before
        assert all(torch.isfinite(t.grad).all() for t in (qg, kg, vg))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("S", [5, 33, 130])
def test_forward_reads_and_writes_bsnd_memory_in_place(S):
    """q, k, v as a linear's [B, S, (H + 2 Hk) D] output viewed per head (BNSD views of
    BSND memory, rows H·D apart) and ``out`` eager's [B, S, H, D] memory seen as BNSD: the
    kernel reads and writes them as they are; the result matches the reference (causal,
    GQA, a tail block), the inputs keep their values, a second call gives the same bits,
    and an ``out`` with a transposed D is one clear error."""
    B, H, Hk, D = 2, 6, 2, 32
    g = torch.Generator().manual_seed(S)
    lin = torch.randn(B, S, (H + 2 * Hk) * D, generator=g)
    q = lin[..., :H * D].view(B, S, H, D).transpose(1, 2)
    k = lin[..., H * D:(H + Hk) * D].view(B, S, Hk, D).transpose(1, 2)
    v = lin[..., (H + Hk) * D:].view(B, S, Hk, D).transpose(1, 2)
    before = lin.clone()
    ref, _ = attention_reference(q.double(), k.double(), v.double(), causal=True)
    out = torch.full((B, S, H, D), float("nan")).transpose(1, 2)
    got, _ = flash_attention_forward(q, k, v, causal=True, tiles=(16, 16), out=out)
    assert got is out and not out.is_contiguous()
    assert rel(out, ref) < 1e-5 and torch.isfinite(out).all()
    assert torch.equal(lin, before)
    again, _ = flash_attention_forward(q, k, v, causal=True, tiles=(16, 16))
    assert again.is_contiguous() and torch.equal(again, out)
    with pytest.raises(ValueError, match="unit stride along D"):
        flash_attention_forward(q, k, v, causal=True, out=torch.empty(B, H, D, S).transpose(2, 3))


def test_bind_forward_equals_flash_attention_forward():
    """`bind_forward` (a graph kernel's binding: checks and tiles once) gives
    `flash_attention_forward`'s bits on strided inputs, into ``out`` or a fresh tensor;
    a call of another shape or dtype takes `flash_attention_forward`; bad shapes are
    one ValueError at binding."""
    from opencann.ops.flash_attention.api import bind_forward
    B, H, Hk, S, D = 1, 6, 2, 40, 16
    g = torch.Generator().manual_seed(3)
    lin = torch.randn(B, S, (H + 2 * Hk) * D, generator=g)
    q = lin[..., :H * D].view(B, S, H, D).transpose(1, 2)
    k = lin[..., H * D:(H + Hk) * D].view(B, S, Hk, D).transpose(1, 2)
    v = lin[..., (H + Hk) * D:].view(B, S, Hk, D).transpose(1, 2)
    run = bind_forward(q.shape, k.shape, causal=True, scale=0.3)
    want, want_lse = flash_attention_forward(q, k, v, causal=True, scale=0.3)
    for _ in range(2):
        got, lse = run(q, k, v)
        assert torch.equal(got, want) and torch.equal(lse, want_lse)
    out = torch.empty(B, S, H, D).transpose(1, 2)
    assert run(q, k, v, out=out)[0] is out and torch.equal(out, want)
    qh, kh, vh = (t.bfloat16() for t in (q, k, v))   # another dtype: the general path
    got, _ = run(qh, kh, vh)
    assert got.dtype == torch.float32 and rel(got, want) < 1e-2   # as flash_attention_forward
    with pytest.raises(ValueError, match="head dim"):
        bind_forward((1, 6, 8, 16), (1, 4, 8, 16))


@pytest.mark.parametrize("which", ["q", "k", "kv", "qkv"])
def test_inputs_expanded_along_the_sequence_are_read_as_their_values(which):
    """q, k or v expanded along S (stride 0: one row seen S times) cannot be read in place:
    the row stride is the tile GEMMs' leading dimension, which BLAS requires >= D. Such
    an operand is copied, and forward, out= and the gradients equal SDPA's (the kernel
    used to call MKL with a leading dimension 0, print its error and leave tiles unwritten)."""
    g = torch.Generator().manual_seed(11)
    full = {n: torch.randn(2, 3, 17, 12, generator=g) for n in "qkv"}
    ts = {n: (full[n][:, :, :1].expand(2, 3, 17, 12) if n in which else full[n]) for n in "qkv"}
    assert any(t.stride(2) == 0 for t in ts.values())
    for causal in (False, True):
        ref = F.scaled_dot_product_attention(*(t.contiguous() for t in ts.values()), is_causal=causal)
        got, _ = flash_attention_forward(*ts.values(), causal=causal, backend="numba")
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        out = torch.full((2, 17, 3, 12), 7.0).transpose(1, 2)
        flash_attention_forward(*ts.values(), causal=causal, backend="numba", out=out)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        leaves = {n: t.detach().clone().requires_grad_() for n, t in full.items()}
        views = {n: (leaves[n][:, :, :1].expand(2, 3, 17, 12) if n in which else leaves[n])
                 for n in "qkv"}
        flash_attention(*views.values(), causal=causal).sum().backward()
        want = {n: t.detach().clone().requires_grad_() for n, t in full.items()}
        wviews = {n: (want[n][:, :, :1].expand(2, 3, 17, 12) if n in which else want[n])
                  for n in "qkv"}
        F.scaled_dot_product_attention(*wviews.values(), is_causal=causal).sum().backward()
        for n in "qkv":
            torch.testing.assert_close(leaves[n].grad, want[n].grad, rtol=1e-4, atol=1e-4)


def test_an_out_whose_rows_are_closer_than_d_is_one_line():
    q = torch.randn(1, 2, 1, 8)
    out = torch.empty(1, 2, 8).unsqueeze(2).as_strided((1, 2, 1, 8), (16, 8, 3, 1))
    with pytest.raises(ValueError, match="out= needs"):
        flash_attention_forward(q, q, q, backend="numba", out=out)
