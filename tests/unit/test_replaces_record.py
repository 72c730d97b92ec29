"""Fused nodes record the nodes whose work they do (``meta["replaces"]``, read with
`opencann.ir.traced_names`), by the rewrite's dataflow (`Graph.rewriting`), never by
name: a fused node, CSE's survivor, the AscendQuant of a quantized layer and a merged
QKV GEMM name their sources; a bypassed node (an AscendQuant the layer before absorbs)
passes nothing on; a block that raises records nothing. Compiled models still match
eager on random inputs."""
import pytest
import torch

import opencann
from opencann.ir import DataType, Graph, TensorDesc, TensorRef, traced_names

F32 = TensorDesc((2, 3), DataType.FLOAT)


def _unary(g, op, x, name):
    return g.create_node(op, [x], {"self": TensorRef(0)}, [F32], name)


def _chain():
    """x -> a (Neg) -> b (Relu) -> output."""
    g = Graph("t")
    x = g.add_input(F32, "x")
    a = _unary(g, "Neg", x, "a")
    b = _unary(g, "Relu", a.output, "b")
    g.outputs = [b.output]
    return g, x, a, b


def test_a_fused_node_records_the_chain_it_replaces_and_carries_it_on():
    g, x, a, b = _chain()
    with g.rewriting():
        f = _unary(g, "NegRelu", x, "a_relu")
        g.replace_all_uses_with(b.output, f.output)
        g.erase_node(b)
        g.erase_node(a)
    assert traced_names(f) == ("b", "a")
    with g.rewriting():     # a later rewrite of the fused node keeps the first names
        f2 = _unary(g, "NegRelu2", x, "a_relu_1")
        g.replace_all_uses_with(f.output, f2.output)
        g.erase_node(f)
    assert traced_names(f2) == ("b", "a")
    assert traced_names(_unary(g, "Abs", x, "fresh")) == ("fresh",)   # formed by no rewrite


def test_a_survivor_adds_the_merged_nodes_names_and_a_bypass_passes_none_on():
    g = Graph("t")
    x = g.add_input(F32, "x")
    a, a2 = _unary(g, "Neg", x, "a"), _unary(g, "Neg", x, "a2")
    q = _unary(g, "AscendQuant", a.output, "q")
    g.outputs = [a2.output, q.output]
    with g.rewriting():      # CSE: a2 is a
        g.replace_all_uses_with(a2.output, a.output)
        g.erase_node(a2)
    assert traced_names(a) == ("a", "a2")
    with g.rewriting():      # a bypassed node (its reader reads its input): no work of its runs
        g.replace_all_uses_with(q.output, a.output)
        g.erase_node(q)
    assert traced_names(a) == ("a", "a2")


def test_helpers_created_for_a_node_record_it_and_a_failed_block_records_nothing():
    g, x, a, b = _chain()
    with g.rewriting():      # quantize: a new AscendQuant feeds the new layer
        qx = _unary(g, "AscendQuant", x, "a_quant")
        qa = _unary(g, "QuantNeg", qx.output, "a_int8")
        g.replace_all_uses_with(a.output, qa.output)
        g.erase_node(a)
    assert traced_names(qx) == traced_names(qa) == ("a",)
    with pytest.raises(RuntimeError):
        with g.rewriting():
            f = _unary(g, "Relu2", qa.output, "b2")
            g.replace_all_uses_with(b.output, f.output)
            g.erase_node(b)
            raise RuntimeError("rewrite failed")
    assert "replaces" not in f.meta


class _Residual(torch.nn.Module):
    """conv-ReLU, then a residual conv: conv + add + relu (one ConvAddAct), and three
    sibling Linears (one merged GEMM)."""

    def __init__(self):
        super().__init__()
        self.c, self.c2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, padding=1)
        self.q, self.k, self.v = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        y = torch.relu(self.c(x))
        y = torch.relu(y + self.c2(y))
        return self.q(y) * self.k(y) + self.v(y)


@pytest.mark.parametrize("quantize", [False, True])
def test_compiled_fused_nodes_name_the_traced_nodes(quantize):
    torch.manual_seed(0)
    m, x = _Residual().eval(), torch.randn(2, 3, 16, 16)
    cm = opencann.quantize(m, [(x,)]) if quantize else opencann.compile(m, (x,))
    by_op = {}
    for n in cm.graph.nodes:
        by_op.setdefault(n.op, []).append(traced_names(n))
    conv_add = by_op["QuantConvAddAct" if quantize else "ConvAddAct"]
    assert conv_add == [("relu_1", "add", "convolution_1")], by_op
    assert by_op["QuantConvBiasAct" if quantize else "ConvBiasAct"] == [("relu", "convolution")]
    gemm = [t for t in by_op["QuantLinearAct" if quantize else "LinearAct"] if len(t) > 1]
    assert gemm and set(gemm[0]) >= {"addmm", "addmm_1"}, by_op
    if quantize:     # each quantization does its layer's work; none does another's
        assert all(len(set(t) & {"convolution", "convolution_1"}) <= 1 for t in by_op["AscendQuant"])
    with torch.no_grad():
        ref = m(x)
    y = cm(x)
    cos = torch.nn.functional.cosine_similarity(y.flatten().double(), ref.flatten().double(), 0)
    assert cos > 0.99
    if not quantize:
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
