"""Kernel functions that take ``out=`` refuse one of another dtype or shape with one line
(`opencann.ops.kernels.out_arg.check_out`), where they used to write through it cast (an
int32 ``out`` truncated) or broadcast, or fail deep inside numba; and the bound decode GEMV
checks its bias as `gemv` does (a short bias was read past its end)."""
import pytest
import torch

from opencann.ops.kernels.add_rms_norm_cpu import add_rms_norm
from opencann.ops.kernels.decode_attention_cpu import decode_attention, decode_attention_update
from opencann.ops.kernels.gemv_cpu import bind_gemv, gemv
from opencann.ops.kernels.rotary_mul_cpu import apply_rotary_pos_emb, rotary_mul

_G = torch.Generator().manual_seed(0)
Q, K, V = (torch.randn(2, 4, n, 8, generator=_G) for n in (1, 6, 6))
X, C, S = torch.randn(1, 2, 3, 8, generator=_G), torch.randn(1, 1, 3, 8, generator=_G), torch.randn(1, 1, 3, 8, generator=_G)
A, B, W = torch.randn(2, 8, generator=_G), torch.randn(2, 8, generator=_G), torch.rand(8, generator=_G)
X2, W2 = torch.randn(2, 16, generator=_G), torch.randn(9, 16, generator=_G)

CALLS = {   # name -> call(out) for an out like the result's but for its dtype / shape
    "gemv": lambda o: gemv(X2, W2, out=o(2, 9)),
    "bound gemv": lambda o: bind_gemv(W2, 2)(X2, None, o(2, 9)),
    "rotary_mul": lambda o: rotary_mul(X, C, S, out=o(1, 2, 3, 8)),
    "apply_rotary_pos_emb": lambda o: apply_rotary_pos_emb(X, X, C, S, out=(o(1, 2, 3, 8), o(1, 2, 3, 8))),
    "add_rms_norm": lambda o: add_rms_norm(A, B, W, 1e-6, out=(o(2, 8), o(2, 8))),
    "decode_attention": lambda o: decode_attention(Q, K, V, torch.tensor([6, 3]), None, o(2, 4, 1, 8)),
    "decode_attention_update": lambda o: decode_attention_update(
        Q, K.clone(), V.clone(), torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8),
        torch.tensor([5, 2]), torch.tensor([6, 3]), None, o(2, 4, 1, 8)),
}


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float16])
def test_an_out_of_another_dtype_is_one_line_and_untouched(name, dtype):
    made = []

    def o(*shape):
        made.append(torch.full(shape, 7, dtype=dtype))
        return made[-1]
    with pytest.raises(ValueError, match=r"out must be float32") as e:
        CALLS[name](o)
    assert "\n" not in str(e.value)
    assert all(bool((t == 7).all()) for t in made)           # nothing written
    assert CALLS[name](lambda *s: torch.empty(s)) is not None   # float32 still fine


def test_quantize_u8_refuses_an_out_that_is_not_uint8_of_xs_shape():
    from opencann.ops.kernels.int8_cpu import quantize_u8
    x = torch.randn(4, 8, generator=_G)
    for out in (torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.int8), torch.zeros(2, 4, 8, dtype=torch.uint8)):
        with pytest.raises(ValueError, match=r"quantize_u8: out must be uint8 \[4, 8\]"):
            quantize_u8(x, 0.05, 3, out=out)
    out = torch.zeros(4, 8, dtype=torch.uint8)
    assert quantize_u8(x, 0.05, 3, out=out) is out and torch.equal(out, quantize_u8(x, 0.05, 3))


@pytest.mark.parametrize("name", ["gemv", "rotary_mul", "decode_attention"])
def test_an_out_of_a_broadcastable_larger_shape_is_refused(name):
    def o(*shape):
        return torch.zeros((2,) + shape)       # eager's out= would refuse it too
    with pytest.raises(ValueError, match=r"out must be float32"):
        CALLS[name](o)


@pytest.mark.parametrize("bias", [torch.randn(3), torch.randn(2000), torch.randn(9, dtype=torch.float64),
                                  torch.randn(1, 9)])
def test_the_bound_gemv_checks_its_bias_as_gemv_does(bias):
    run = bind_gemv(W2, 2)
    run(X2, torch.randn(9), torch.empty(2, 9))     # a valid call first: its views are kept
    with pytest.raises(ValueError, match=r"bias must be float32 \[9\]"):
        run(X2, bias, torch.empty(2, 9))
    with pytest.raises(ValueError, match=r"bias must be float32 \[9\]"):
        gemv(X2, W2, bias)
    good = torch.randn(9)
    torch.testing.assert_close(run(X2, good), torch.nn.functional.linear(X2, W2, good))
