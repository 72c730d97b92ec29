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


def test_onnx_quantize_linear_keeps_its_division():
    """An ONNX QuantizeLinear is AscendQuant with ``step``: x / step, the division the ONNX
    specification writes (ONNX Runtime's bits). The fused node multiplies by 1 / step, so
    Add + LayerNormalization + QuantizeLinear gave 204 where the unfused graph and ONNX
    Runtime give 203 (y = 7.5499997, step 0.1: 75.49999 by division, 75.5 → 76 by the
    product), with the same float32 y."""
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    import numpy as np
    from opencann.engine.entry import compile_onnx
    d = 8
    inits = [numpy_helper.from_array(np.zeros(d, np.float32), "g"),
             numpy_helper.from_array(np.full(d, np.float32(7.549999713897705)), "beta"),
             numpy_helper.from_array(np.array(0.1, np.float32), "qs"),
             numpy_helper.from_array(np.array(128, np.uint8), "qz")]
    nodes = [helper.make_node("Add", ["a", "b"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "g", "beta"], ["y"], axis=-1, epsilon=1e-5),
             helper.make_node("QuantizeLinear", ["y", "qs", "qz"], ["q"])]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, d]) for n in ("a", "b", "y")]
    graph = helper.make_graph(nodes, "t", io[:2], [io[2], helper.make_tensor_value_info("q", TensorProto.UINT8, [2, d])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    a = torch.randn(2, d)
    outs = []
    for opts in (None, {"disable": ["fuse_add_layer_norm_quant"]}):
        o = compile_onnx(model, options=opts)(a, a.clone())
        outs.append(list(o.values()) if isinstance(o, dict) else list(o))
    assert torch.equal(outs[0][0], outs[1][0])
    assert outs[1][1][0, 0].item() == 203      # 7.5499997 / 0.1 = 75.49999..., + 128
    assert torch.equal(outs[0][1], outs[1][1])
