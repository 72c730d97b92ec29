"""Faults found by trying to break `fuse_add_layer_norm_quant`'s float32 form and the
add-and-norm checks it shares (`passes/fusion/match.residual_layer_norm`)."""
import pytest
import torch

import opencann


class _AddNorm(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.a, self.ln = torch.nn.Linear(d, d), torch.nn.LayerNorm(d)

    def forward(self, x):
        return self.ln(x + self.a(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_add_layer_norm_still_fuses_a_low_or_double_precision_model(dtype):
    """`fuse_add_layer_norm` took LayerNorms of any dtype whose γ / β match x (its kernel
    runs ATen's add + layer_norm outside float32); the shared matcher's float32-γ/β rule,
    meant for the nodes that normalize in float32 (AddLayerNormCast / AddLayerNormQuant),
    turned every bf16, fp16 and fp64 model away from it."""
    torch.manual_seed(0)
    m = _AddNorm().eval().to(dtype)
    x = torch.randn(2, 3, 16, dtype=dtype)
    c = opencann.compile(m, (x,), options={"enable": ["fuse_add_layer_norm"]})
    skipped = [s["reason"] for s in c.report.skipped if s["pass"] == "fuse_add_layer_norm"]
    assert c.executor.graph.op_counts().get("AddLayerNorm") == 1, skipped
    with torch.no_grad():
        assert torch.equal(c(x), m(x))
