"""NumpyViews (a bound kernel's memo of NumPy views) and the bound AddRmsNorm fast path
that uses it: views share the tensors' memory (new values are seen), new storage is a
miss, non-contiguous tensors are never memoized, the memo is bounded; the bound kernel
equals eager on random rows with NaN/Inf, call after call."""
import numpy as np
import pytest
import torch

from opencann.ir import TensorDesc
from opencann.ops.kernels.add_rms_norm_cpu import bind_add_rms_norm
from opencann.ops.kernels.numpy_views import NumpyViews


def test_a_view_is_memoized_and_shares_memory():
    views = NumpyViews()
    t = torch.randn(2, 3)
    a = views.array(t)
    assert views.array(t) is a
    t.mul_(2.0)                            # in place: the memoized view sees the new values
    np.testing.assert_array_equal(a, t.numpy())
    r = views.shaped(t, (3, 2))
    assert r.shape == (3, 2) and views.shaped(t, (3, 2)) is r
    b = views.bits(t)
    assert b.dtype == np.int32 and np.array_equal(b, t.numpy().view(np.int32))


def test_new_storage_is_a_miss():
    views = NumpyViews()
    t = torch.randn(4)
    a = views.array(t)
    t.set_(torch.randn(4))                 # same object, new memory
    a2 = views.array(t)
    assert a2 is not a
    np.testing.assert_array_equal(a2, t.numpy())


def test_non_contiguous_is_made_afresh_and_never_reshaped():
    views = NumpyViews()
    t = torch.randn(4, 6)[:, ::2]
    a = views.array(t)
    np.testing.assert_array_equal(a, t.numpy())
    assert views.array(t) is not a         # not memoized
    assert views.shaped(t, (12,)) is None  # a reshape would copy
    assert views.shaped(torch.randn(5), (2, 2)) is None   # another number of elements


def test_the_memo_is_bounded():
    views = NumpyViews(capacity=3)
    keep = [torch.randn(2) for _ in range(5)]
    for t in keep:
        views.array(t)
    assert len(views._memo) == 3


@pytest.mark.parametrize("rows", [1, 8])
def test_bound_add_rms_norm_equals_eager_call_after_call(rows):
    torch.manual_seed(rows)
    a, b = torch.randn(rows, 1, 768), torch.randn(rows, 1, 768)
    w = torch.randn(768)
    run = bind_add_rms_norm(TensorDesc.of(a), TensorDesc.of(b), TensorDesc.of(w), 1e-6)
    y, s = torch.empty(rows, 768), torch.empty(rows, 1, 768)   # y squeezed, as planned
    for call in range(3):
        a.copy_(torch.randn(rows, 1, 768) * (call + 1))
        if call == 2:
            a[0, 0, 5] = float("nan")
            b[-1, 0, 7] = float("inf")
        out = run(a, b, w, out=(y, s))
        assert out[0] is y and out[1] is s
        ref_s = a + b
        ref_y = torch.rms_norm(ref_s, (768,), w, 1e-6)
        torch.testing.assert_close(s, ref_s, rtol=0, atol=0, equal_nan=True)   # bit for bit
        torch.testing.assert_close(y, ref_y.reshape(rows, 768), rtol=2e-6, atol=2e-6,
                                   equal_nan=True)
        assert torch.equal(torch.isnan(y), torch.isnan(ref_y.reshape(rows, 768)))
    y_before = y.clone()
    a.add_(1.0)                              # the output is the kernel's buffer: independent
    torch.testing.assert_close(y, y_before, rtol=0, atol=0, equal_nan=True)


def test_bound_add_rms_norm_refuses_bad_input_in_one_line():
    a = torch.randn(1, 768)
    run = bind_add_rms_norm(TensorDesc.of(a), TensorDesc.of(a), TensorDesc.of(torch.randn(768)), 1e-6)
    with pytest.raises(ValueError, match="add_rms_norm: expected float32"):
        run(a, torch.randn(1, 768), torch.randn(767), out=(torch.empty(1, 768), torch.empty(1, 768)))


def test_bound_add_rms_norm_new_output_tensors_are_written():
    a, b, w = torch.randn(2, 64), torch.randn(2, 64), torch.randn(64)
    run = bind_add_rms_norm(TensorDesc.of(a), TensorDesc.of(b), TensorDesc.of(w), 1e-5)
    first = (torch.empty(2, 64), torch.empty(2, 64))
    run(a, b, w, out=first)
    other = (torch.empty(2, 64), torch.empty(2, 64))       # other buffers: not the last call's
    run(a, b, w, out=other)
    assert torch.equal(other[0], first[0]) and torch.equal(other[1], a + b)


def test_bound_decode_attention_repeats_see_new_values_and_new_tensors():
    """The bound decode attention reuses the last call's views when handed the same
    tensors: values written in place between calls are read, other tensors are a miss;
    every call equals the general path bit for bit."""
    from opencann.ops.kernels.decode_attention_cpu import (bind_decode_attention_update,
                                                           decode_attention_update)
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, S, D = 2, 6, 2, 32, 16

    def operands():
        return (torch.randn(B, Hq, 1, D, generator=g), torch.randn(B, Hkv, S, D, generator=g),
                torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, 1, D, generator=g),
                torch.randn(B, Hkv, 1, D, generator=g), torch.tensor([3, 9]), torch.tensor([4, 10]))
    ops = operands()
    run = bind_decode_attention_update(*(TensorDesc.of(t) for t in ops), None)
    out = torch.empty(B, Hq, 1, D)
    for call in range(3):
        if call:
            ops[0].copy_(torch.randn(B, Hq, 1, D, generator=g))   # in place: same tensors
            ops[3].copy_(torch.randn(B, Hkv, 1, D, generator=g))
            ops[5].add_(1)
            ops[6].add_(1)
        ref = [t.clone() for t in ops]
        want = decode_attention_update(*ref, out=torch.empty(B, Hq, 1, D))
        got = run(*ops, out=out)
        assert torch.equal(got[0], want[0]) and torch.equal(ops[1], ref[1])
    fresh = operands()                                             # other tensors: a miss
    want = decode_attention_update(*[t.clone() for t in fresh])
    assert torch.equal(run(*fresh, out=torch.empty(B, Hq, 1, D))[0], want[0])
