"""`numba_cache.general_entry`: the arguments at its positions are compiled for layout 'A',
so contiguous arrays and views of them share one machine code (a parallel kernel takes
5-25 s to compile), with the same results as the dispatcher's own per-layout code; a
plain function (a test's spy) is returned as it is. FlashAttention's forward and backward
and the decode attention-with-cache-write take their mask / out / new rows / query
through it: contiguous and strided callers compile one signature for those arguments."""
import numpy as np
import pytest
import torch
from numba import njit, types

from opencann.ops.flash_attention import flash_attention_forward
from opencann.ops.flash_attention import cpu as fa_cpu
from opencann.ops.kernels.numba_cache import general_entry


@njit(cache=False)
def _row_sums(x, w, out):  # pragma: no cover - numba
    for i in range(x.shape[0]):
        s = np.float32(0.0)
        for j in range(x.shape[1]):
            s += x[i, j] * w[j]
        out[i] = s


def test_contiguous_and_strided_arrays_share_one_signature_and_equal_the_dispatcher():
    rng = np.random.default_rng(0)
    base = rng.standard_normal((6, 10), dtype=np.float32)
    w = rng.standard_normal(5, dtype=np.float32)
    base[2, 4] = np.nan
    for x in (np.ascontiguousarray(base[:, ::2]), base[:, ::2], base[::2, 1::2]):
        out = np.full(x.shape[0], 7.0, np.float32)
        general_entry(_row_sums, (x, w, out), (0,))(x, w, out)
        ref = np.full(x.shape[0], 7.0, np.float32)
        _row_sums(x, w, ref)                    # the dispatcher: its own layout's code
        np.testing.assert_array_equal(out, ref)
        assert np.array_equal(np.isnan(out), np.isnan(x).any(axis=1))   # base[2, 4]'s NaN
    general = [sig for sig in _row_sums.overloads if sig[0].layout == "A"]
    assert len(general) == 1 and general[0][1] == types.Array(types.float32, 1, "C")


def test_a_plain_function_is_returned_as_it_is():
    def spy(*args):
        return args
    assert general_entry(spy, (np.zeros(3),), (0,)) is spy


@pytest.mark.parametrize("strided_out", [False, True])
def test_flash_attention_mask_and_out_layouts_compile_one_signature(strided_out):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=g) for _ in range(3))
    mask = torch.randn(1, 1, 24, 24, generator=g).expand(1, 2, 24, 24)   # a stride-0 view
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if strided_out:      # out written in place through eager's [B, S, H, D] memory
        holder = torch.full((1, 24, 2, 16), 5.0)
        out = holder.transpose(1, 2)
        got, _ = flash_attention_forward(q, k, v, attn_mask=mask, out=out, backend="numba")
        assert got.data_ptr() == holder.data_ptr()
    else:
        out, _ = flash_attention_forward(q, k, v, attn_mask=mask, backend="numba")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for sig in fa_cpu.fwd_kernel.overloads:
        assert sig[3].layout == sig[15].layout == "A", sig      # mask, out: any layout


def test_the_memo_keys_on_every_arguments_type():
    """A second call with the same types reuses the entry; another dtype, rank or
    writability gets its own (never a float32 entry reading float64 memory)."""
    x32 = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    w32 = np.linspace(-1, 1, 4).astype(np.float32)
    o32 = np.empty(3, np.float32)
    e1 = general_entry(_row_sums, (x32, w32, o32), (0,))
    assert general_entry(_row_sums, (x32[:, :], w32, o32), (0,)) is e1
    x64, w64, o64 = x32.astype(np.float64), w32.astype(np.float64), np.empty(3, np.float64)
    e2 = general_entry(_row_sums, (x64, w64, o64), (0,))
    assert e2 is not e1
    e2(x64, w64, o64)
    np.testing.assert_allclose(o64, x64 @ w64, rtol=1e-12)
    ro = x32.copy()
    ro.setflags(write=False)
    general_entry(_row_sums, (ro, w32, o32), (0,))(ro, w32, o32)
    np.testing.assert_allclose(o32, x32 @ w32, rtol=1e-6)
