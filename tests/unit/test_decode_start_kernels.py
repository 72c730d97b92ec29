"""A decode step's first ops on the CPU: Embedding (`embedding_cpu`: a numba row copy into
the planned buffer) and the first RmsNorm (`rms_norm_cpu`: a numba row kernel, prebound)
for a few rows, and the decode graph gathering its RoPE / position rows by ``positions``
itself (no Unsqueeze or Add per step). Each against eager: values (Embedding bit for bit,
RmsNorm to fp32 rounding), NaN / inf positions, a second call, output independence, and
eager's error for an index out of range (the executor's line naming the node); longer inputs keep ATen's kernels."""
import pytest
import torch
import transformers as T

import opencann
import opencann.llm as L
from opencann.ops.kernels.cpu_patterns import rms_norm_writes_out
from opencann.ops.kernels.embedding_cpu import decode_rows as embedding_rows
from opencann.runtime.executor import ExecutionError


class LlamaNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm, spelled out (upcast, then the weight)."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d))
        self.eps = eps

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _nodes(cm, op):
    return [n for n in cm.graph.nodes if n.op == op]


def _same_specials_and_close(out, ref, ulps=4):
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    fin = torch.isfinite(ref)
    tol = ulps * torch.finfo(torch.float32).eps * ref[fin].abs().clamp_min(1e-30)
    assert ((out[fin] - ref[fin]).abs() <= tol + 1e-30).all()


@pytest.mark.parametrize("shape", [(1, 1, 768), (4, 768), (2, 3, 8), (1, 5)])
def test_rms_norm_of_decode_rows_matches_eager(shape):
    torch.manual_seed(0)
    m = LlamaNorm(shape[-1]).eval()
    x = torch.randn(shape)
    cm = opencann.compile(m, (x,))
    norms = _nodes(cm, "RmsNorm")
    assert norms and all(rms_norm_writes_out(n) for n in norms)
    for k in range(3):
        x = torch.randn(shape) * 10 ** k
        flat = x.view(-1, shape[-1])
        if flat.shape[0] > 1:          # NaN, inf and overflowing rows beside finite ones
            flat[0, 1] = float("nan")
            flat[-1, 0] = float("inf") if k != 1 else 3e20
        with torch.no_grad():
            ref = m(x)
        out = cm(x)
        _same_specials_and_close(out, ref)
        again = cm(x)
        assert torch.equal(again.nan_to_num(), out.nan_to_num())
        out.add_(1)                              # the output is the caller's
        assert not torch.equal(again.nan_to_num(), out.nan_to_num())


def test_rms_norm_of_many_rows_and_bf16_keep_atens_kernel():
    torch.manual_seed(0)
    m = LlamaNorm(768).eval()
    cm = opencann.compile(m, (torch.randn(64, 768),))     # 64 x 768 elements: a prefill
    assert not any(rms_norm_writes_out(n) for n in _nodes(cm, "RmsNorm"))
    x = torch.randn(64, 768)
    with torch.no_grad():
        assert torch.equal(cm(x), m(x))                  # ATen's kernel: eager's bits
    mb = LlamaNorm(64).eval().to(torch.bfloat16)
    xb = torch.randn(2, 64, dtype=torch.bfloat16)
    cb = opencann.compile(mb, (xb,))
    assert not any(rms_norm_writes_out(n) for n in _nodes(cb, "RmsNorm"))
    with torch.no_grad():
        assert torch.equal(cb(xb), mb(xb))


@pytest.mark.parametrize("ids_shape", [(1, 1), (3, 2), (4,)])
def test_embedding_of_decode_rows_is_eagers_bits(ids_shape):
    torch.manual_seed(0)
    m = torch.nn.Embedding(50, 16).eval()
    with torch.no_grad():
        m.weight[7, 3] = float("nan")
        m.weight[7, 4] = -0.0
        m.weight[9, 0] = float("-inf")
    ids = torch.randint(0, 50, ids_shape)
    cm = opencann.compile(m, (ids,))
    emb = _nodes(cm, "Embedding")
    assert emb and all(embedding_rows(n) for n in emb)
    for k in range(3):
        ids = torch.randint(0, 50, ids_shape)
        ids.view(-1)[0] = 7 if k != 2 else 9
        with torch.no_grad():
            ref = m(ids)
        out = cm(ids)
        assert out.shape == ref.shape
        assert torch.equal(out.view(torch.int32), ref.view(torch.int32))   # NaN, -0.0 too
        again = cm(ids)
        out.add_(1)
        assert torch.equal(again.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("bad", [50, -1, 10 ** 6])
def test_embedding_index_out_of_range_is_eagers_error_and_writes_nothing(bad):
    m = torch.nn.Embedding(50, 16).eval()
    cm = opencann.compile(m, (torch.tensor([[3]]),))
    good = cm(torch.tensor([[3]])).clone()
    with pytest.raises(IndexError, match="index out of range"):
        m(torch.tensor([[bad]]))
    with pytest.raises(ExecutionError, match="Embedding.* index out of range in self$"):
        cm(torch.tensor([[bad]]))
    assert torch.equal(cm(torch.tensor([[3]])), good)


def test_embedding_of_many_rows_keeps_atens_kernel():
    m = torch.nn.Embedding(100, 768).eval()
    ids = torch.randint(0, 100, (8, 16))          # 128 rows x 768: a prefill's gather
    cm = opencann.compile(m, (ids,))
    assert not any(embedding_rows(n) for n in _nodes(cm, "Embedding"))
    ids = torch.randint(0, 100, (8, 16))
    with torch.no_grad():
        assert torch.equal(cm(ids), m(ids))


@pytest.mark.parametrize("cfg", [
    T.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, eos_token_id=None),
    T.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                 bos_token_id=1, eos_token_id=None)], ids=["llama", "gpt2"])
def test_the_decode_step_gathers_by_positions_with_no_op_on_them(cfg):
    """positions [B] index the RoPE table / position embedding directly: the rows' [B, 1, D]
    views are made at bind time, and nothing but the gathers and the attention reads
    positions; greedy tokens stay eager's."""
    torch.manual_seed(0)
    m = T.AutoModelForCausalLM.from_config(cfg).eval()
    gen = L.compile(m, max_seq_len=32, max_batch=2, options={"backend": "opencann"})
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    want = m.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(gen.generate(ids, max_new_tokens=6, pad_token_id=0), want)
    g = gen.steps.step(2, 1).compiled.graph
    positions = g.inputs[1]
    readers = {n.op for n in g.nodes if any(v is positions for v in n.inputs)}
    assert readers and readers <= {"Embedding", "DecodeAttentionKvUpdate", "KvCacheUpdate",
                                   "DecodeAttention"}, readers
    assert not [n for n in g.nodes if n.op in ("Unsqueeze", "Add")
                and any(v.desc.dtype.torch == torch.int64 for v in n.inputs)]
