"""Transformers and LLMs on the vnpu's own kernels: MiniLM, BERT, GPT-2 and a small Llama
(prefill with FlashAttention, decode with DecodeAttention and the KV-cache write) compile
for ``vnpu:ascend910b`` with 0 host ops (`vnpu_nd.host_nodes`), and their outputs match
eager within fp32 (and, for fp16 models, fp16) tolerance. The full-size BERT-base and
GPT-2 small are marked ``full``; small configs of the same code run here."""
import pytest
import torch

import opencann
from opencann.engine import compile_module
from opencann.ops.kernels.vnpu_nd import host_nodes

DEV = "vnpu:ascend910b"


def _first(o):
    return o.last_hidden_state if hasattr(o, "last_hidden_state") else (o[0] if isinstance(o, tuple) else o)


def _check(m, args, rtol=1e-4, dtype=None):
    cm = opencann.compile(m, args, device=DEV)
    assert [n.op for n in host_nodes(cm.graph)] == []
    assert all(str(n.device) == DEV for n in cm.graph.nodes)
    with torch.no_grad():
        ref = _first(m(*args)).double() if dtype is None else _first(m.double()(*args)).double()
    out = _first(cm(*args))
    out2 = _first(cm(*args))                                    # a second call, same result
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    assert err < rtol, err
    assert torch.equal(out, out2) and out.data_ptr() != out2.data_ptr()
    return cm


def _ids(vocab, seq, seed=1):
    return torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seed))


def test_minilm_has_no_host_ops():
    from opencann import zoo
    z = zoo.minilm(seq=16)
    cm = _check(z.model, z.example_inputs)
    ops = cm.graph.op_counts()
    assert ops["LayerNorm"] == 13 and ops["ScaledDotProductAttention"] == 6 and ops["Embedding"] == 1


def _bert(layers):
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    cfg = BertConfig(attn_implementation="sdpa") if layers is None else \
        BertConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                   attn_implementation="sdpa")
    return BertModel(cfg).eval()


def _gpt2(layers):
    from transformers import GPT2Config, GPT2Model
    torch.manual_seed(0)
    cfg = GPT2Config(use_cache=False) if layers is None else \
        GPT2Config(n_layer=layers, n_embd=64, n_head=4, use_cache=False)
    return GPT2Model(cfg).eval()


def test_small_bert_and_gpt2_have_no_host_ops():
    _check(_bert(2), (_ids(30000, 24),))
    _check(_gpt2(2), (_ids(50000, 24),))


def test_fp16_bert_within_fp16_tolerance_of_fp32_eager():
    m = _bert(2)
    cm = opencann.compile(m.half(), (_ids(30000, 24),), device=DEV)
    assert host_nodes(cm.graph) == []
    out = _first(cm(_ids(30000, 24))).double()
    with torch.no_grad():
        ref = _first(m.float()(_ids(30000, 24))).double()
    assert float((out - ref).abs().max() / ref.abs().max()) < 2e-2


@pytest.mark.full
@pytest.mark.parametrize("make", [_bert, _gpt2], ids=["bert-base", "gpt2"])
def test_full_size_models_have_no_host_ops(make):
    _check(make(None), (_ids(30000, 64),))


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("tokens", [8, 1], ids=["prefill", "decode"])
def test_llama_step_graphs_have_no_host_ops(tokens):
    from opencann.llm import DecoderLM
    lm = DecoderLM(_tiny_llama())
    caches = [c.normal_() for c in lm.new_caches(1, 32)]
    pos = torch.tensor([0 if tokens > 1 else 5])
    ex = (_ids(300, tokens), pos, pos + tokens, *caches)
    opts = {"share_weights": True, "enable": ["fuse_flash_attention"] if tokens > 1 else []}
    cm = compile_module(lm, ex, device=DEV, options=opts)
    ops = cm.graph.op_counts()
    assert host_nodes(cm.graph) == []
    assert ops["KvCacheUpdate"] == 4 and ops["RmsNorm"] == 5
    # a prefill's last layer attends its last token only, as a decode step (DecoderLM)
    assert ops.get("FlashAttention", 0) == (1 if tokens > 1 else 0)
    assert ops["DecodeAttention"] == (1 if tokens > 1 else 2)
    ref_caches = [c.clone() for c in caches]
    with torch.no_grad():
        ref = lm(ex[0], ex[1], ex[2], *ref_caches)
    out = cm(*ex)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(caches, ref_caches):                       # the caches were written in place, as eager
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if tokens > 1:
        fa = next(n for n in cm.graph.nodes if n.op == "FlashAttention")
        assert fa.meta["tiles"]["block_q"] % 16 == 0 and "ub" in fa.meta["tiles"]


def test_llm_generate_on_vnpu_matches_cpu(tmp_path):
    """The tests' tiny Llama (tests/tiny_llm.py: RoPE, RMSNorm, GQA, SwiGLU) generates the
    same greedy tokens on the vnpu as on the cpu."""
    from tiny_llm import save_tiny_llama
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(save_tiny_llama(tmp_path / "tiny")).eval()
    ids = _ids(300, 6)
    cpu = opencann.llm.compile(model, max_seq_len=32, options={"backend": "opencann"})
    npu = opencann.llm.compile(model, max_seq_len=32, device=DEV, options={"backend": "opencann"})
    assert torch.equal(npu.generate(ids, max_new_tokens=4), cpu.generate(ids, max_new_tokens=4))


class _Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) / 4.0, -1) @ v


def test_flash_attention_tiles_in_trace_and_estimate(tmp_path):
    from opencann.tools.estimate import estimate
    q, k, v = (torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(s)) for s in range(3))
    cm = opencann.compile(_Attention(), (q, k, v), device=DEV, options={"enable": ["fuse_flash_attention"]})
    assert cm.graph.op_counts() == {"FlashAttention": 1}
    torch.testing.assert_close(cm(q, k, v), _Attention()(q, k, v), rtol=1e-5, atol=1e-5)
    ev = [e for e in cm.profile(q, k, v) if e.get("name") == "FlashAttention"]
    tiles = ev[0]["args"]["tiles"]
    assert tiles["block_q"] == 16 and tiles["block_k"] == 64 and tiles["ub"].endswith("/196608 B")
    rep = estimate(_Attention(), (q, k, v), device=DEV)
    row = next(r for r in rep.rows if r.op == "FlashAttention")
    assert "block_q 16, block_k 64" in row.note and "l0c 4096/131072 B" in row.note
    assert any(n.startswith("FlashAttention tiles block_q 16") for n in rep.notes)


def test_attention_runs_with_fp16_operands_where_the_cube_has_no_fp32():
    from opencann.passes.layout.npu_layout import CubeDtypeError
    q, k, v = (torch.randn(1, 2, 24, 16, generator=torch.Generator().manual_seed(s)) for s in range(3))
    m = _Attention()
    cm = opencann.compile(m, (q, k, v), device="vnpu:ascend910", options={"enable": ["fuse_flash_attention"]})
    fa = next(n for n in cm.graph.nodes if n.op == "FlashAttention")
    assert fa.outputs[0].desc.dtype.value == "float16"
    assert any(a["detail"] == "fp32 to fp16 for the Cube" for a in cm.report.applied)
    out = cm(q, k, v)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, m(q, k, v), rtol=2e-2, atol=2e-2)
    with pytest.raises(CubeDtypeError, match="must_keep_origin_dtype"):
        opencann.compile(m, (q, k, v), device="vnpu:ascend910",
                         options={"enable": ["fuse_flash_attention"], "precision_mode": "must_keep_origin_dtype"})
