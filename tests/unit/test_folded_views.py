"""Views of a kernel's fresh result folded onto it (runtime/codegen.py, `CodeGen._folded`):
a chain of views (slice, reshape, transpose) of a result the kernel allocates itself is
made per call as one ``as_strided`` window of that result, the intermediate views are not
made, and the values are eager's: NaN/Inf, a second call, output independence, a
reshape that must copy, a view returned to the caller, and the same bits as the code
without folding."""
import pytest
import torch
from torch import nn

import opencann
from opencann.devices.cpu import onednn_bf16_available
from opencann.runtime.codegen import CodeGen

BF16 = {"precision_mode": "allow_mix_precision_bf16"}


class QKV(nn.Module):
    """A fused QKV projection's result split into heads (bf16 GEMMs return their own
    tensor), attention over them, its output viewed back to rows, and one transposed
    view that must copy to reshape."""

    def __init__(self, d=32, h=4):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.reshape(b, s, self.h, d // self.h).transpose(1, 2) for t in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        y = self.out(a.transpose(1, 2).reshape(b, s, d))
        return y, y.transpose(1, 2).reshape(b, d * s)        # the second reshape copies


def _compile(m, x, fold=True):
    keep = CodeGen._folded
    if not fold:
        CodeGen._folded = lambda self, node: False
    try:
        return opencann.compile(m, (x,), options=BF16)
    finally:
        CodeGen._folded = keep


def _x(seed, specials=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 8, 32, generator=g)
    if specials:
        x[0, 1, 3], x[1, 2, 0], x[1, 5, 7] = float("nan"), float("inf"), -float("inf")
    return x


@pytest.mark.skipif(not onednn_bf16_available(), reason="the fresh GEMM results it folds come from oneDNN's "
                    "bf16 inner product, which this CPU lacks (AVX2 only)")
def test_view_chains_of_fresh_results_are_windows_with_the_same_bits():
    torch.manual_seed(0)
    m = QKV().eval()
    folded, plain = _compile(m, _x(0)), _compile(m, _x(0), fold=False)
    src = folded.executor._src
    assert src.count("_as(") >= 3, src                         # q, k, v at least
    assert len(src.splitlines()) < len(plain.executor._src.splitlines())
    with torch.no_grad():
        for seed, specials in ((1, False), (2, True), (3, False)):
            x = _x(seed, specials)
            got, want = folded(x), plain(x)
            for a, b in zip(got, want):
                assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan()) and torch.equal(
                    a.nan_to_num(), b.nan_to_num())
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ref = m(x)
            for a, r in zip(got, ref):
                assert a.shape == r.shape
                assert torch.equal(a.isnan(), r.float().isnan())
            if not specials:
                cos = torch.nn.functional.cosine_similarity(got[0].flatten(), m(x)[0].flatten(), dim=0)
                assert cos > 0.999
        y1 = folded(_x(4))
        y2 = folded(_x(4))
        assert torch.equal(y1[0], y2[0]) and y1[0].data_ptr() != y2[0].data_ptr()
        assert y1[1].is_contiguous() and torch.equal(y1[1], y1[0].transpose(1, 2).reshape(2, -1))


def test_no_folding_in_debugging_variants():
    torch.manual_seed(1)
    m = QKV().eval()
    cm = opencann.compile(m, (_x(0),), options={**BF16, "check_aliasing": True})
    assert "_as(" not in cm.executor._src
    with torch.no_grad():
        torch.testing.assert_close(cm(_x(5))[0], _compile(m, _x(0))(_x(5))[0], rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(2, 8, 32), (1, 8, 32)])
def test_fp32_graph_same_values_as_eager(shape):
    torch.manual_seed(2)
    m = QKV().eval()
    x = torch.randn(shape)
    cm = opencann.compile(m, (x,))
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(shape)
            x[0, 0, 0] = float("nan")
            for a, b in zip(cm(x), m(x)):
                torch.testing.assert_close(a, b, equal_nan=True, rtol=1e-5, atol=1e-5)
