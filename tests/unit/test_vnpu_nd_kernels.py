"""vnpu kernels in ND (norms, softmax, attention, decode attention, KV-cache write, the tiled
FlashAttention and its NPU tile plan) agree with eager PyTorch, NaN/Inf included."""

import pytest
import torch
import torch.nn.functional as F

from opencann.devices.vnpu import ascend910, ascend910b
from opencann.devices.vnpu.attention_kernels import (BufferOverflowError, attention, flash_attention_tiled,
                                                     incre_flash_attention, scatter_update_, tile_occupancy)
from opencann.devices.vnpu.vector_kernels import layer_norm, rms_norm, softmax
from opencann.ops.flash_attention.planner import npu_capacity, plan_npu_tiles

TOL = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _close(a, b, dtype):
    torch.testing.assert_close(a.double(), b.double(), rtol=TOL[dtype], atol=TOL[dtype] * max(1.0, b.abs().max()),
                               equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_matches_eager(dtype):
    x, w, b = _rand(3, 5, 24, dtype=dtype), _rand(24, seed=1, dtype=dtype), _rand(24, seed=2, dtype=dtype)
    x[0, 1, 3] = float("nan")
    x[1, 2, 4] = float("inf")
    y, mean, rstd = layer_norm(x, [24], w, b, 1e-5)
    ref = F.layer_norm(x.double(), [24], w.double(), b.double(), 1e-5)
    assert y.dtype == dtype and mean.shape == (3, 5, 1) and rstd.dtype == torch.float32
    assert torch.equal(y.isnan(), ref.isnan())          # the NaN and the Inf rows are NaN, as eager
    _close(y, ref, dtype)
    y2, _, _ = layer_norm(x, [24], w, b, 1e-5)          # a second call: same bits, fresh memory
    assert torch.equal(y2.nan_to_num(), y.nan_to_num()) and y2.data_ptr() != y.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("upcast", [False, True])
def test_rms_norm_matches_eager(dtype, upcast):
    x, w = _rand(2, 7, 32, dtype=dtype), _rand(32, seed=1, dtype=dtype)
    if upcast:   # transformers' LlamaRMSNorm: normalise in fp32, round, then the weight product
        xf = x.float()
        ref = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    else:
        ref = torch.rms_norm(x.double(), [32], w.double(), 1e-6)
    _close(rms_norm(x, [32], w, 1e-6, upcast), ref, dtype)


def test_norms_reject_bad_shape_in_one_line():
    with pytest.raises(ValueError, match="trailing shape"):
        layer_norm(_rand(2, 8), [4])
    with pytest.raises(ValueError, match="not a float type"):
        rms_norm(torch.ones(2, 4, dtype=torch.int64), [4])


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_matches_eager_with_masked_and_nan_rows(dtype):
    x = _rand(4, 9, dtype=dtype) * 4
    x[1] = float("-inf")                  # fully masked row: NaN, as eager
    x[2, 3] = float("nan")
    ref = torch.softmax(x.double(), -1)
    y = softmax(x, -1)
    assert torch.equal(y.isnan(), ref.isnan())
    _close(y, ref, dtype)
    _close(softmax(x, 0, log=True), torch.log_softmax(x.double(), 0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,masked", [(False, False), (True, False), (False, True)])
def test_attention_matches_sdpa_with_gqa(dtype, causal, masked):
    q, k, v = _rand(2, 4, 10, 16, dtype=dtype), _rand(2, 2, 12, 16, seed=1, dtype=dtype), \
        _rand(2, 2, 12, 16, seed=2, dtype=dtype)
    mask = (_rand(2, 1, 10, 12, seed=3) > -0.5) if masked else None
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    ref = F.scaled_dot_product_attention(q.double(), kk.double(), vv.double(), attn_mask=mask,
                                         is_causal=causal and not masked)
    _close(attention(q, k, v, mask, causal and not masked), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_tiled_matches_sdpa(dtype, causal):
    q, k, v = _rand(1, 4, 40, 32, dtype=dtype), _rand(1, 2, 40, 32, seed=1, dtype=dtype), \
        _rand(1, 2, 40, 32, seed=2, dtype=dtype)
    cap = npu_capacity(ascend910b)
    out, stats = flash_attention_tiled(q, k, v, 16, 16, cap, causal=causal)
    ref = F.scaled_dot_product_attention(q.double(), k.repeat_interleave(2, 1).double(),
                                         v.repeat_interleave(2, 1).double(), is_causal=causal)
    _close(out, ref, dtype)
    assert stats["tiles"] == (6 if causal else 9)        # 3 x 3 tiles; causal skips those past the diagonal
    assert 0 < stats["ub_bytes"] <= cap["ub"] and 0 < stats["l0c_bytes"] <= cap["l0c"]


def test_flash_attention_tiled_float_mask_and_nan_rows():
    q, k, v = _rand(1, 2, 20, 16), _rand(1, 2, 20, 16, seed=1), _rand(1, 2, 20, 16, seed=2)
    mask = torch.zeros(1, 1, 20, 20).masked_fill(_rand(1, 1, 20, 20, seed=3) > 0.8, float("-inf"))
    mask[..., 5, :] = float("-inf")                                    # row 5 sees no key
    out, _ = flash_attention_tiled(q, k, v, 16, 16, {}, attn_mask=mask, nan_rows=True)
    ref = torch.softmax(q @ k.transpose(-1, -2) / 4 + mask, -1) @ v      # spelled-out: NaN row
    assert out[..., 5, :].isnan().all()
    _close(out, ref, torch.float32)
    zero, _ = flash_attention_tiled(q, k, v, 16, 16, {}, attn_mask=mask)
    assert (zero[..., 5, :] == 0).all()                                # torch's SDPA: 0


def test_flash_attention_tile_overflow_is_caught_at_run_time():
    q = _rand(1, 1, 64, 64)
    with pytest.raises(BufferOverflowError, match="L0C"):
        flash_attention_tiled(q, q, q, 64, 64, {"l0c": 8 * 1024})


@pytest.mark.parametrize("spec", [ascend910b, ascend910])
@pytest.mark.parametrize("d,dtype", [(64, torch.float16), (128, torch.float16), (128, torch.float32)])
def test_npu_tile_plan_fits_every_buffer(spec, d, dtype):
    plan = plan_npu_tiles(spec, d, dtype, seq_q=4096, seq_k=4096)
    occ = tile_occupancy(plan.block_q, plan.block_k, d, dtype)
    cap = npu_capacity(spec)
    assert plan.block_q % 16 == 0 and plan.block_k % 16 == 0
    assert all(occ[b] <= cap[b] for b in cap)
    assert plan.occupancy == {b: (occ[b], cap[b]) for b in cap}
    assert "fits" in plan.explain()


def test_npu_tile_plan_is_capped_by_sequence():
    plan = plan_npu_tiles(ascend910b, 32, torch.float16, seq_q=20, seq_k=20)
    assert (plan.block_q, plan.block_k) == (32, 32)


def test_incre_flash_attention_reads_only_live_keys():
    q, k, v = _rand(2, 4, 1, 8), _rand(2, 2, 10, 8, seed=1), _rand(2, 2, 10, 8, seed=2)
    lengths = torch.tensor([3, 10])
    k[0, :, 3:] = float("nan")                          # dead cache slots are never read
    v[0, :, 3:] = float("inf")
    out = incre_flash_attention(q, k, v, lengths)
    for b, n in enumerate(lengths.tolist()):
        ref = F.scaled_dot_product_attention(q[b:b + 1], k[b:b + 1, :, :n].repeat_interleave(2, 1),
                                             v[b:b + 1, :, :n].repeat_interleave(2, 1))
        _close(out[b:b + 1], ref, torch.float32)
    with pytest.raises(ValueError, match=r"lengths\[1\] = 11 is outside \[0, 10\]"):
        incre_flash_attention(q, k, v, torch.tensor([3, 11]))
    assert (incre_flash_attention(q, k, v, torch.tensor([0, 4]))[0] == 0).all()     # no live key: zeros, as cpu


def test_scatter_update_writes_in_place():
    cache = _rand(2, 2, 8, 4)
    before = cache.clone()
    new = _rand(2, 2, 3, 4, seed=1)
    out = scatter_update_(cache, new, torch.tensor([0, 5]))
    assert out is cache
    assert torch.equal(cache[0, :, :3], new[0]) and torch.equal(cache[1, :, 5:], new[1])
    assert torch.equal(cache[0, :, 3:], before[0, :, 3:]) and torch.equal(cache[1, :, :5], before[1, :, :5])
    with pytest.raises(ValueError, match="row 1 writes positions 6..8"):
        scatter_update_(cache, new, torch.tensor([0, 6]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 24), (2, 17, 40)])
def test_layer_norm_and_softmax_on_fractal_nz(dtype, shape):
    from opencann.devices.vnpu import from_fractal_nz, to_fractal_nz, valid_mask
    from opencann.devices.vnpu.vector_kernels import layer_norm_nz, softmax_nz
    x, w, b = _rand(*shape, dtype=dtype) * 3, _rand(shape[-1], seed=1, dtype=dtype), _rand(shape[-1], seed=2, dtype=dtype)
    x[(0,) * len(shape)] = float("nan")
    nz = to_fractal_nz(x)
    pad = ~valid_mask(shape, "FRACTAL_NZ", dtype)
    y, mean, rstd = layer_norm_nz(nz, shape, w, b, 1e-5)
    assert not y[pad].any() and mean.shape == (*shape[:-1], 1)
    ref, rmean, rrstd = torch.native_layer_norm(x.double(), [shape[-1]], w.double(), b.double(), 1e-5)
    _close(from_fractal_nz(y, shape), ref, dtype)
    _close(mean, rmean, dtype)
    _close(rstd, rrstd, dtype)
    sm = softmax_nz(nz, shape)
    assert not sm[pad].any()
    _close(from_fractal_nz(sm, shape), torch.softmax(x.double(), -1), dtype)
    _close(from_fractal_nz(softmax_nz(nz, shape, log=True), shape), torch.log_softmax(x.double(), -1), dtype)


class _LinearNormSoftmax(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.ln, self.l2 = torch.nn.Linear(32, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 24)

    def forward(self, x):
        return torch.softmax(self.l2(self.ln(self.l1(x))), -1)


def test_layer_norm_and_softmax_stay_in_fractal_nz_between_matmuls():
    """910's Cube writes FRACTAL_NZ: LayerNorm and Softmax over the last axis keep it, so the
    whole chain needs one TransData in and one out (910B's ND matmuls need none)."""
    import copy

    import opencann
    torch.manual_seed(0)
    m, x = _LinearNormSoftmax().eval().half(), _rand(20, 32, dtype=torch.float16)
    ref = copy.deepcopy(m).float()(x.float())
    for dev, fmt, trans in (("vnpu:ascend910", "FRACTAL_NZ", 2), ("vnpu:ascend910b", "ND", 0)):
        cm = opencann.compile(m, (x,), device=dev)
        assert cm.graph.op_counts().get("TransData", 0) == trans
        assert {n.outputs[0].desc.format.value for n in cm.graph.nodes if n.op in ("LayerNorm", "SoftmaxV2")} == {fmt}
        _close(cm(x), ref, torch.float16)
