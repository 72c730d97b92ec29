"""`additive_attention_mask`: a bool SDPA mask ⇒ one Select(mask, 0, -inf) in the query's
dtype shared by every attention node reading it. A golden before/expected graph (two
attention nodes, one mask), the reason it does not apply (an integer query), and the
kernel's values: SDPA on the additive mask gives the bits SDPA gives on the bool mask
(fp32 and bf16, random data with NaN/±inf, a fully masked row, a broadcast mask), and a
compiled two-layer BERT in fp32 and bf16 gives the same bits with the pass on and off, on
a second call with new inputs."""
import pytest
import torch

import opencann
from opencann.engine.options import complete
from opencann.ir import DataType, Graph, TensorDesc, TensorRef, verify
from opencann.ir.dump import to_text
from opencann.passes import AdditiveAttentionMask, PassContext, PassManager
from opencann.report import CompileReport

F, B = DataType.FLOAT, DataType.BOOL
G = torch.Generator().manual_seed(0)


def run(g, device="cpu"):
    ctx = PassContext(options=complete({"verify": True}), report=CompileReport(), device=device)
    PassManager([AdditiveAttentionMask()]).run(g, ctx)
    verify(g)
    return to_text(g), ctx.report


def two_layers(qdtype=F):
    g = Graph()
    q = g.add_input(TensorDesc((1, 2, 4, 8), qdtype), "q")
    m = g.add_input(TensorDesc((1, 1, 4, 4), B), "m")
    x = q
    for i in range(2):
        x = g.create_node("ScaledDotProductAttention", [x, x, x, m],
                          {"query": TensorRef(0), "key": TensorRef(1), "value": TensorRef(2),
                           "attn_mask": TensorRef(3)}, [q.desc], f"sdpa{i}").output
    g.outputs = [x]
    return g


def test_golden_one_select_for_both_layers():
    text, rep = run(two_layers())
    assert text == """graph(%q: float32[1,2,4,8], %m: bool[1,1,4,4]):
  %c0: float32[] = const
  %c1: float32[] = const
  %0: float32[1,1,4,4] = Select(%m, %c0, %c1)
  %1: float32[1,2,4,8] = ScaledDotProductAttention(%q, %q, %q, %0)
  %2: float32[1,2,4,8] = ScaledDotProductAttention(%1, %1, %1, %0)
  return %2"""
    assert [a["detail"] for a in rep.applied] == ["bool mask ⇒ additive, once"] * 2


def test_does_not_apply_to_an_integer_query():
    g = two_layers(DataType.INT32)
    before = to_text(g)
    _, rep = run(g)
    assert to_text(g) == before
    assert [(s["pass"], s["reason"]) for s in rep.skipped] == [
        ("additive_attention_mask", "the query is DataType.INT32, not a float: SDPA's own "
                                    "conversion stays")] * 2


def test_vnpu_keeps_the_bool_mask():
    g = two_layers()
    before = to_text(g)
    run(g, device="vnpu")
    assert to_text(g) == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mshape", [(1, 1, 16, 16), (2, 1, 1, 16)])
def test_sdpa_bits_equal_on_the_additive_mask(dtype, mshape):
    q, k, v = (torch.randn(2, 3, 16, 8, generator=G).to(dtype) for _ in range(3))
    q[0, 1, 2, 3], k[1, 2, 5, 0], v[0, 0, 7, 1] = float("nan"), float("inf"), -float("inf")
    m = torch.rand(mshape, generator=G) > 0.3
    m[..., 0, :] = False if mshape[2] > 1 else m[..., 0, :]   # a fully masked row
    add = torch.where(m, torch.zeros((), dtype=dtype), torch.full((), -float("inf"), dtype=dtype))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    want, got = sdpa(q, k, v, attn_mask=m), sdpa(q, k, v, attn_mask=add)
    assert got.dtype == want.dtype
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.5, 1.5, -1.5), want.nan_to_num(0.5, 1.5, -1.5))


@pytest.mark.parametrize("precision", [None, "allow_mix_precision_bf16"])
def test_compiled_bert_same_bits(precision):
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=32)
    cfg._attn_implementation = "sdpa"
    model = BertModel(cfg).eval()
    ids, mask = torch.randint(0, 100, (2, 16)), torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0
    opt = {"precision_mode": precision} if precision else {}
    on = opencann.compile(model, (ids, mask), options=opt)
    off = opencann.compile(model, (ids, mask), options={**opt, "disable": ["additive_attention_mask"]})
    assert "additive_attention_mask" in [a["pass"] for a in on.report.applied]
    assert on.graph.op_counts().get("Select", 0) > off.graph.op_counts().get("Select", 0)
    for i in range(2):   # a second call, new inputs and padding
        ids = torch.randint(0, 100, (2, 16))
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[i, 5 + i:] = 0
        got, want = on(ids, mask), off(ids, mask)
        for k in ("last_hidden_state", "pooler_output"):
            assert torch.equal(got[k], want[k])
