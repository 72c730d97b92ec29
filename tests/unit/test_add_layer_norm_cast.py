"""`fuse_add_layer_norm_cast`: mixed precision's Cast(bf16 → fp32) + residual Add +
LayerNorm + Cast(fp32 → bf16) ⇒ AddLayerNormCast (y fp32, y bf16). A golden
before/expected graph of ≤ 10 nodes, the reasons it does not apply, the kernel's bits
against the unfused chain (random data with NaN/±inf, odd D, one row and rows past ATen's
parallel grain, a second call, outputs independent of each other and of the inputs), and
a compiled BERT in bf16 with and without the pass: the same bits, fewer Casts."""
import pytest
import torch

import opencann
from opencann.engine.options import complete
from opencann.ir import DataType, Graph, TensorDesc, TensorRef, verify
from opencann.ir.dump import to_text
from opencann.ops.kernels.add_layer_norm_cast_cpu import add_layer_norm_cast
from opencann.passes import FuseAddLayerNormCast, PassContext, PassManager
from opencann.report import CompileReport

F, BF = DataType.FLOAT, DataType.BF16
G = torch.Generator().manual_seed(0)


def d(*shape, dtype=F):
    return TensorDesc(tuple(shape), dtype)


def run(g, device="cpu"):
    ctx = PassContext(options=complete({"verify": True}), report=CompileReport(), device=device)
    PassManager([FuseAddLayerNormCast()]).run(g, ctx)
    verify(g)
    return to_text(g, attrs=("dtype",)), ctx.report


def skipped(report):
    return [(s["pass"], s["reason"]) for s in report.skipped]


def cast(g, v, dt):
    return g.create_node("Cast", [v], {"self": TensorRef(0), "dtype": dt.torch},
                         [v.desc.with_(dtype=dt)], "cast").output


def block(up=True, add=True, sum_read=False, stats_read=False, down=True):
    """a (bf16 [2,8]) [-> Cast fp32] + b (fp32) -> LayerNorm -> Reshape [16] -> Cast bf16;
    outputs: the norm (the residual stream) and the cast."""
    g = Graph()
    a = g.add_input(d(2, 8, dtype=BF if up else F), "a")
    b = g.add_input(d(2, 8), "b")
    x = cast(g, a, F) if up else a
    s = g.create_node("Add", [x, b], {"self": TensorRef(0), "other": TensorRef(1)},
                      [d(2, 8)], "add").output if add else x
    gamma = g.add_const(torch.randn(8, generator=G), "g")
    beta = g.add_const(torch.randn(8, generator=G), "beta")
    ln = g.create_node("LayerNorm", [s, gamma, beta],
                       {"input": TensorRef(0), "normalized_shape": [8], "eps": 1e-5,
                        "weight": TensorRef(1), "bias": TensorRef(2)},
                       [d(2, 8), d(2, 1), d(2, 1)], "ln")
    y = ln.outputs[0]
    g.outputs = [y]
    if down:
        r = g.create_node("Reshape", [y], {"self": TensorRef(0), "size": [16]}, [d(16)], "view").output
        g.outputs.append(cast(g, r, BF))
    if sum_read:
        g.outputs.append(s)
    if stats_read:
        g.outputs.append(ln.outputs[1])
    return g


def test_golden():
    text, rep = run(block())
    assert text == """graph(%a: bfloat16[2,8], %b: float32[2,8]):
  %c0: float32[8] = const
  %c1: float32[8] = const
  %0: float32[2,8], %1: bfloat16[2,8] = AddLayerNormCast(%a, %b, %c0, %c1; dtype=torch.bfloat16)
  %2: bfloat16[16] = Reshape(%1)
  return %0, %2"""
    assert [a["detail"] for a in rep.applied] == ["Cast + Add + LayerNorm + Cast"]


def test_golden_fp32_addends():
    """Both addends fp32 (BERT's embeddings norm): the down-Cast is still folded in."""
    text, rep = run(block(up=False))
    assert "AddLayerNormCast(%a, %b, %c0, %c1" in text and "Cast(" not in text.replace("NormCast(", "")
    assert [a["detail"] for a in rep.applied] == ["Add + LayerNorm + Cast"]


@pytest.mark.parametrize("case,reason", [
    ("no_add", "no residual Add produces the LayerNorm's input (the embeddings' norm): the "
               "fused node adds two tensors"),
    ("sum_read", "the sum a + b is also read by the caller; the fused node does not write it"),
    ("stats_read", "the LayerNorm's mean or rstd is read (training): the fused node returns "
                   "the normalized output and its cast only"),
])
def test_does_not_apply(case, reason):
    g = block(add=case != "no_add", sum_read=case == "sum_read", stats_read=case == "stats_read")
    before = to_text(g)
    _, rep = run(g)
    assert skipped(rep) == [("fuse_add_layer_norm_cast", reason)]
    assert to_text(g) == before


def test_no_down_cast_is_not_a_match():
    """fp32 models (no Cast to bf16 reads the norm) are left to fuse_add_layer_norm, silently."""
    g = block(down=False)
    before = to_text(g)
    _, rep = run(g)
    assert to_text(g) == before and not rep.skipped and not rep.applied


def test_vnpu_keeps_the_chain():
    g = block()
    before = to_text(g)
    run(g, device="vnpu")
    assert to_text(g) == before


def _chain(a, b, w, beta, eps):
    y = torch.native_layer_norm(a.float() + b, [a.shape[-1]], w, beta, eps)[0]
    return y, y.to(torch.bfloat16)


def _special(t):
    flat = t.view(-1)
    idx = torch.randperm(flat.numel(), generator=G)[:6]
    flat[idx[:2]] = float("nan")
    flat[idx[2:4]] = float("inf")
    flat[idx[4:]] = -float("inf")
    return t


@pytest.mark.parametrize("rows,dim", [(1, 8), (1, 769), (7, 33), (300, 257)])
def test_kernel_bits_equal_the_chain(rows, dim):
    """rows x dim: one row, odd D, 300 x 257 = 77k elements past ATen's parallel grain
    (32768); NaN/±inf in some rows of both addends; scales that leave bf16's rounding."""
    a = (torch.randn(rows, dim, generator=G) * 3 + 1).to(torch.bfloat16)
    b = torch.randn(rows, dim, generator=G) * 1e3
    w, beta = torch.randn(dim, generator=G), torch.randn(dim, generator=G)
    if rows > 1:
        _special(a[: rows // 2])
        _special(b[rows // 2:])
    a0, b0 = a.clone(), b.clone()
    want = _chain(a, b, w, beta, 1e-12)
    for _ in range(2):   # a second call: nothing cached from the first
        y, lo = add_layer_norm_cast(a, b, w, beta, 1e-12, torch.bfloat16)
        assert y.dtype == torch.float32 and lo.dtype == torch.bfloat16
        assert torch.equal(y.view(torch.int32), want[0].view(torch.int32))
        assert torch.equal(lo.view(torch.int16), want[1].view(torch.int16))
    if rows > 1:
        assert y.isnan().any() and lo.isnan().any()
    assert torch.equal(a.view(torch.int16), a0.view(torch.int16)) and torch.equal(b.view(torch.int32), b0.view(torch.int32))
    y.fill_(7.0)   # the outputs are their own memory
    assert torch.equal(lo.view(torch.int16), want[1].view(torch.int16))
    assert torch.equal(b.view(torch.int32), b0.view(torch.int32))


def test_kernel_rejects_a_broadcast():
    with pytest.raises(ValueError, match="must have one shape"):
        add_layer_norm_cast(torch.randn(2, 8).bfloat16(), torch.randn(8), None, None, 1e-5,
                            torch.bfloat16)


def test_compiled_bert_bf16_same_bits_fewer_casts():
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=100, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=96, max_position_embeddings=32)
    model = BertModel(cfg).eval()
    ids = torch.randint(0, 100, (2, 16))
    opt = {"precision_mode": "allow_mix_precision_bf16"}
    on = opencann.compile(model, (ids,), options=opt)
    off = opencann.compile(model, (ids,), options={**opt, "disable": ["fuse_add_layer_norm_cast"]})
    n_on, n_off = on.graph.op_counts(), off.graph.op_counts()
    # 4 norms of 2 blocks; the last one's output reaches its Cast through a SelectInt (not
    # fused) and the embeddings' Add broadcasts the position embeddings at batch 2
    assert n_on["AddLayerNormCast"] == 3 and "AddLayerNormCast" not in n_off
    assert n_off["Cast"] - n_on["Cast"] == 6 and n_on["LayerNorm"] == 2
    for ids_ in (ids, torch.randint(0, 100, (2, 16))):   # a second call, new inputs
        want = off(ids_)
        got = on(ids_)
        for k in ("last_hidden_state", "pooler_output"):
            assert torch.equal(got[k], want[k])
