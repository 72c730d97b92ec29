"""opencann.llm holds the Q/K/V and gate/up weights once: before the first step graph is
compiled the module's sibling weights are laid out as the concatenations the graphs
merge them into (`opencann.llm.steps.hold_weights_once`), so every graph's merged GEMM
operand IS the module's memory. Greedy tokens equal transformers' before and after (and
eager transformers and the eager backend on the same module afterwards), the module's
bytes do not grow and no concatenation is counted as a copy, a weight changed in place
afterwards is refused naming it (and a new compile follows it, copying nothing), and a
saved generator stores the weights once and gives the same tokens."""
import pytest
import torch
import transformers as T

import opencann.llm as L
from opencann.llm.builder import DecoderLM
from opencann.llm.steps import hold_weights_once
from opencann.ops.kernels import cpu as cpu_kernels

CONFIGS = {   # 1 MiB gate/up weights: GatedMLP runs one GEMM on their concatenation
    "llama_mlp": lambda: T.LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=1024,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, eos_token_id=None),
    "llama": lambda: T.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, eos_token_id=None),
    "qwen2": lambda: T.Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, eos_token_id=None),
    "gpt2": lambda: T.GPT2Config(vocab_size=97, n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                 bos_token_id=1, eos_token_id=None),
}


@pytest.fixture(autouse=True)
def _column_major_concatenations(monkeypatch):
    """The decode kernels' concatenation layout is raced (`cpu.concat_row_major`); these
    tests pin the [Σn, k] one, where the weights are laid out in place (the row-major
    one leaves them: tests/integration/test_user_paths.py)."""
    import opencann.passes.fusion.qkv_linear as qkv_linear
    for mod in (cpu_kernels, qkv_linear):
        monkeypatch.setattr(mod, "concat_row_major", lambda k, n, dtype=torch.float32, rows=None: False)


def _model(name, seed=11):
    torch.manual_seed(seed)
    return T.AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()


def _ptr(t):
    return t.untyped_storage().data_ptr()


def _prompts():
    ids = torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    return ids, mask


def _module_bytes(m):
    return sum({_ptr(t): t.untyped_storage().nbytes()
                for t in list(m.parameters()) + list(m.buffers())}.values())


def test_llama_merged_weights_are_the_modules_memory_and_tokens_stay():
    m = _model("llama_mlp")
    ids, mask = _prompts()
    want = m.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    values = {n: p.detach().clone() for n, p in m.named_parameters()}
    before = _module_bytes(m)
    gen = L.compile(m, max_seq_len=40, max_batch=2, options={"prefill_buckets": [16]})
    assert torch.equal(gen.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0), want)
    # the parameters keep their values and shapes; q/k/v share one storage, gate/up another
    for n, p in m.named_parameters():
        assert torch.equal(p, values[n]) and p.shape == values[n].shape, n
    merged = 0
    for layer in m.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        qkv = {_ptr(w) for w in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)}
        gate_up = {_ptr(w) for w in (mlp.gate_proj.weight, mlp.up_proj.weight)}
        assert len(qkv) == 1 == len(gate_up) and qkv != gate_up
        merged += sum(w.nbytes for w in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight,
                                         mlp.gate_proj.weight, mlp.up_proj.weight))
    # every graph's merged operands (Q/K/V constants, GatedMLP's concatenation) are it
    own = {_ptr(t) for t in m.parameters()}
    for key, cm in gen.steps.compiled().items():
        consts = [c.const for c in cm.graph.constants]
        qkv_w = [t for c, t in zip(cm.graph.constants, consts) if c.name.endswith("_qkv_w")]
        assert len(qkv_w) == 2 and {_ptr(t) for t in qkv_w} <= own, key
        concats = cpu_kernels.packed_copies_by_kind(consts)["concat"]
        assert len(concats) == 2 and {_ptr(t) for t in concats} <= own, key
    s = gen.stats
    tables = gen.lm.rope_cos.nbytes + gen.lm.rope_sin.nbytes    # `DecoderLM.rope_table`
    assert tables == 2 * 40 * m.config.head_dim * 4
    assert s.module_weight_bytes == before + tables and s.shared_weight_bytes == merged
    assert s.packed_bytes_by_kind["qkv_concat"] == 0 == s.packed_bytes_by_kind["gate_up_concat"]
    assert f"{merged / 2**20:.1f} of it the graphs' concatenations" in s.summary()
    # a second call; eager transformers and the eager backend on the same module afterwards
    assert torch.equal(gen.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0), want)
    assert torch.equal(m.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                  pad_token_id=0), want)
    eager = L.compile(m, max_seq_len=40, max_batch=2, options={"backend": "eager"})
    assert torch.equal(eager.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0), want)


def test_a_weight_changed_in_place_is_refused_and_a_new_compile_follows_it_copying_nothing():
    """The merged weights ARE the graphs' memory: an in-place change (version counter)
    is refused at the next call naming that parameter (each keeps its own counter: a
    change of k_proj names k_proj, not q_proj); a new compile reads the new values from
    the same memory (laid out already: nothing copied)."""
    m = _model("llama")
    ids, mask = _prompts()
    gen = L.compile(m, max_seq_len=32, max_batch=2, options={"prefill_buckets": [16]})
    gen.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0)
    k = m.model.layers[1].self_attn.k_proj.weight
    with torch.no_grad():
        k.mul_(1.5)
    with pytest.raises(ValueError, match=r"^parameter 'model.layers.1.self_attn.k_proj.weight' of "
                       r"the LlamaForCausalLM was modified in place after opencann.llm.compile: "):
        gen.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0)
    ptrs = [p.data_ptr() for p in m.parameters()]
    again = L.compile(m, max_seq_len=32, max_batch=2, options={"prefill_buckets": [16]})
    want = m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(again.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0), want)
    assert [p.data_ptr() for p in m.parameters()] == ptrs


def test_qwen2_biases_held_once_and_a_saved_generator_stores_the_weights_once(tmp_path):
    from opencann.runtime.model_file import read_sections
    m = _model("qwen2")
    ids, mask = _prompts()
    want = m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    gen = L.compile(m, max_seq_len=32, max_batch=2, options={"prefill_buckets": [16]})
    assert torch.equal(gen.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0), want)
    own = {_ptr(t) for t in m.parameters()}
    for layer in m.model.layers:
        a = layer.self_attn
        assert len({_ptr(t) for t in (a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)}) == 1
    for cm in gen.steps.compiled().values():
        merged = [c.const for c in cm.graph.constants if c.name.endswith(("_qkv_w", "_qkv_b"))]
        assert len(merged) == 4 and {_ptr(t) for t in merged} <= own
    path = str(tmp_path / "qwen2.ocm")
    gen.save(path, graphs="built")
    params = sum(p.nbytes for p in m.parameters())
    assert params <= len(read_sections(path)[1]["constants"]) < params * 1.1 + 64 * 1024
    assert torch.equal(L.load(path).generate(ids, attention_mask=mask, max_new_tokens=6,
                                             pad_token_id=0), want)


def test_nothing_is_laid_out_where_no_graph_merges():
    """GPT-2 (one fused c_attn Conv1D, no gated MLP) and a Llama whose compile disables
    fuse_qkv_linear keep their parameters' memory as it is."""
    g = _model("gpt2")
    ptrs = [p.data_ptr() for p in g.parameters()]
    assert hold_weights_once(DecoderLM(g)) == 0 and [p.data_ptr() for p in g.parameters()] == ptrs
    m = _model("llama")
    ptrs = [p.data_ptr() for p in m.parameters()]
    assert hold_weights_once(DecoderLM(m), {"disable": ["fuse_qkv_linear"]}) == 0
    assert [p.data_ptr() for p in m.parameters()] == ptrs
    q = m.model.layers[0].self_attn.q_proj.weight
    laid = hold_weights_once(DecoderLM(m))
    assert laid == 2 * (64 + 32 + 32) * 64 * 4 and q.is_contiguous()   # small: [Σn, k] rows
    assert _ptr(q) == _ptr(m.model.layers[0].self_attn.v_proj.weight)
