"""The fp32 kernels opencann.llm's step graphs run (and the races that choose them) make
their outputs, scratch and race operands float32 whatever torch's default dtype
(``torch.set_default_dtype``): under bfloat16 or float64 they give the bits they give
under float32, where they used to allocate in the default dtype (a bf16 output NumPy
cannot view, "Got unsupported ScalarType BFloat16"). Random inputs with NaN / Inf."""
import pytest
import torch

from opencann.ops.kernels import cpu as cpu_kernels
from opencann.ops.kernels.add_layer_norm_quant_cpu import OnePass
from opencann.ops.kernels.add_rms_norm_cpu import add_rms_norm
from opencann.ops.kernels.decode_attention_cpu import decode_attention, decode_attention_update
from opencann.ops.kernels.gemv_cpu import bind_gemv, gemv
from opencann.ops.kernels.rotary_mul_cpu import apply_rotary_pos_emb, rotary_mul


def _r(*shape, seed=0, special=False):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    if special:
        flat = x.view(-1)
        flat[1], flat[-2] = float("nan"), float("inf")
    return x


Q, K, V = _r(2, 4, 1, 8, seed=1), _r(2, 4, 300, 8, seed=2), _r(2, 4, 300, 8, seed=3)
X, C, S = _r(1, 2, 3, 8, seed=4, special=True), _r(1, 1, 3, 8, seed=5), _r(1, 1, 3, 8, seed=6)
XL, CL, SL = _r(2, 8, 640, 8, seed=7), _r(1, 1, 640, 8, seed=8), _r(1, 1, 640, 8, seed=9)
A, B, W = _r(3, 8, seed=10, special=True), _r(3, 8, seed=11), _r(8, seed=12)
X2, W2 = _r(2, 16, seed=13, special=True), _r(9, 16, seed=14)
LENS = torch.tensor([300, 7])

CALLS = {   # name -> call() returning a tensor or a tuple of tensors
    "gemv": lambda: gemv(X2, W2),
    "bound gemv": lambda: bind_gemv(W2, 2)(X2, None, None),
    "rotary_mul serial": lambda: rotary_mul(X, C, S),
    "rotary_mul parallel": lambda: rotary_mul(XL, CL, SL),
    "apply_rotary_pos_emb serial": lambda: apply_rotary_pos_emb(X, X + 1, C, S),
    "apply_rotary_pos_emb pair": lambda: apply_rotary_pos_emb(XL, XL + 1, CL, SL),
    "add_rms_norm": lambda: add_rms_norm(A, B, W, 1e-6),
    "decode_attention serial": lambda: decode_attention(Q, K[:, :, :8], V[:, :, :8],
                                                        torch.tensor([8, 3]), None),
    "decode_attention split": lambda: decode_attention(Q, K, V, LENS, None),
    "decode_attention_update": lambda: decode_attention_update(
        Q, K.clone(), V.clone(), _r(2, 4, 1, 8, seed=15), _r(2, 4, 1, 8, seed=16),
        torch.tensor([299, 6]), LENS, None)[0],
    "add_layer_norm_quant (no affine)": lambda: OnePass(None, None, 1e-5, 0.05, 3, 8)(A, B),
}


def _flat(r):
    return list(r) if isinstance(r, (tuple, list)) else [r]


@pytest.fixture(params=[torch.bfloat16, torch.float64], ids=["bfloat16", "float64"])
def default_dtype(request):
    was = torch.get_default_dtype()
    yield request.param
    torch.set_default_dtype(was)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_kernels_give_their_float32_bits_whatever_the_default_dtype(name, default_dtype):
    want = _flat(CALLS[name]())
    torch.set_default_dtype(default_dtype)
    got = _flat(CALLS[name]())
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w) or torch.allclose(g, w, rtol=0, atol=0, equal_nan=True)


def test_the_concat_layout_race_runs_float32_weights(default_dtype, monkeypatch):
    """`cpu.concat_row_major`'s race makes its random weights in the dtype it decides for
    (float32), not the default: a bf16 weight under a float32 GEMM failed the race."""
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", {})
    monkeypatch.setattr(cpu_kernels, "_CONCAT_ROWS", {})
    torch.set_default_dtype(default_dtype)
    assert cpu_kernels.concat_row_major(256, 1032, torch.float32, rows=1) in (True, False)
