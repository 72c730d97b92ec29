"""opencann.llm with the ``opencann`` backend: every step graph compiled by opencann.compile
(KvCacheUpdate writing the generator's caches in place, DecodeAttention over live lengths
given as data). Greedy tokens equal transformers' ``generate`` and the eager backend's,
caches hold the eager backend's values, one prefill and one decode graph serve every
position (no graph or memory plan built per token), the graphs hold the model's
weights once (its own memory, shared), and the decode step runs no op on its positions
before gathering by them."""
import sys

import pytest
import torch
import transformers as T

import opencann.llm as L
from helpers import tiny_llm_config


CONFIGS = ("gpt2", "llama")


@pytest.mark.parametrize("name", CONFIGS)
def test_compiled_steps_equal_transformers_and_eager_with_one_decode_graph(name):
    torch.manual_seed(1234)
    m = T.AutoModelForCausalLM.from_config(tiny_llm_config(name)).eval()
    gen = L.compile(m, max_seq_len=48, max_batch=2, options={"backend": "opencann"})
    ids = torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    ptrs = [c.data_ptr() for c in gen.caches]
    want = m.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, pad_token_id=0)
    assert torch.equal(gen.generate(ids, attention_mask=mask, max_new_tokens=14, pad_token_id=0), want)
    s = gen.stats
    assert s.graphs == ["decode b2 t1", "prefill b2 t16"] and s.memory_plans == 2
    assert s.graphs_built_after_warmup == 0 == s.plans_built_after_warmup and s.decode_steps == 13
    # the caches were written in place and hold what the eager backend writes
    eager = L.compile(m, max_seq_len=48, max_batch=2)
    eager.generate(ids, attention_mask=mask, max_new_tokens=14, pad_token_id=0)
    assert [c.data_ptr() for c in gen.caches] == ptrs
    for c, e in zip(gen.caches, eager.caches):
        torch.testing.assert_close(c[1, :, :24], e[1, :, :24], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c[0, :, :19], e[0, :, :19], rtol=1e-5, atol=1e-5)
    # a second call (another prompt length, same bucket) builds nothing
    short = ids[:, 2:]   # 9 tokens: bucket 16 too
    assert torch.equal(gen.generate(short, max_new_tokens=6),
                       m.generate(short, max_new_tokens=6, do_sample=False))
    assert s.graphs_built == 2 and s.recompiles == 0
    # prefill attention runs the project's FlashAttention (the last layer attends its last
    # token only, as a decode step: DecodeAttention), reported per graph
    text = gen.report()
    assert text.count("fuse_flash_attention") == 1 and "memory: arena" in text
    # the graphs hold the module's weight memory (one copy, shared by both graphs), and
    # the merged Q/K/V weights once, shared by both graphs too
    own = {t.untyped_storage().data_ptr() for t in list(m.parameters()) + list(m.buffers())
           + list(gen.lm.buffers())}   # + the generator's rotary tables (`rope_table`)
    merged = []
    for key in gen.steps.keys():
        consts = gen.steps.step(*key).compiled.graph.constants
        big = [c.const for c in consts if c.const.dim() == 2 and not c.name.endswith("_qkv_w")]
        assert big and {t.untyped_storage().data_ptr() for t in big} <= own
        merged.append({c.const.untyped_storage().data_ptr() for c in consts
                       if c.name.endswith("_qkv_w")})
    # memory reported: the weights the graphs hold (the module's, each storage once, plus
    # copies) and their arenas; the eager backend's weights are the module's
    params = sum(p.numel() * p.element_size() for p in m.parameters())
    assert s.weight_bytes >= params * 0.9 and s.arena_bytes > 0
    torch_steps = L.compile(m, max_seq_len=48, max_batch=2, options={"backend": "eager"})
    torch_steps.generate(short, max_new_tokens=2)
    assert torch_steps.stats.weight_bytes >= params and torch_steps.stats.arena_bytes == 0
    assert f"weights {s.weight_bytes / 2**20:.1f} MiB" in s.summary()
    separate = hasattr(m.config, "num_key_value_heads")   # q/k/v Linears (GPT-2 has c_attn)
    assert merged[0] == merged[1] and len(merged[0]) == separate * m.config.num_hidden_layers
    # the decode step gathers its RoPE / position rows by positions [B] itself (their
    # [B, 1, D] views made at bind time): no op reads positions but the gathers and the
    # attention, and no integer Unsqueeze or Add runs per step
    g = gen.steps.step(2, 1).compiled.graph
    readers = {n.op for n in g.nodes if any(v is g.inputs[1] for v in n.inputs)}
    assert readers and readers <= {"Embedding", "DecodeAttentionKvUpdate", "KvCacheUpdate",
                                   "DecodeAttention"}, readers
    assert not [n for n in g.nodes if n.op in ("Unsqueeze", "Add")
                and any(v.desc.dtype.torch == torch.int64 for v in n.inputs)]


def test_a_weight_changed_after_compile_is_one_line_naming_the_users_parameter():
    """share_weights graphs hold packed copies of the weights: a change after compile is
    refused, naming the transformers model's parameter (not DecoderLM's internal name)
    and the recompile that fixes it; the recompiled generator follows the new weights."""
    torch.manual_seed(5)
    m = T.AutoModelForCausalLM.from_config(tiny_llm_config("llama")).eval()
    opts = {"prefill_buckets": [16]}
    gen = L.compile(m, max_seq_len=32, options=opts)
    ids = torch.randint(3, 97, (1, 9), generator=torch.Generator().manual_seed(2))
    gen.generate(ids, max_new_tokens=3)
    with torch.no_grad():
        m.model.layers[1].mlp.up_proj.weight.mul_(1.5)
    with pytest.raises(ValueError, match=r"^parameter 'model.layers.1.mlp.up_proj.weight' of the "
                       r"LlamaForCausalLM was modified in place after opencann.llm.compile: .*"
                       r"compile it again after changing weights: opencann.llm.compile\(model, "
                       r"max_seq_len=32, max_batch=1\)$"):
        gen.generate(ids, max_new_tokens=3)
    again = L.compile(m, max_seq_len=32, options=opts)
    assert torch.equal(again.generate(ids, max_new_tokens=6),
                       m.generate(ids, max_new_tokens=6, do_sample=False))


def test_a_replaced_parameter_after_compile_is_one_line_naming_it():
    """A new Parameter assigned after compile is refused, naming the user's parameter."""
    torch.manual_seed(5)
    m = T.AutoModelForCausalLM.from_config(tiny_llm_config("llama")).eval()
    again = L.compile(m, max_seq_len=32, options={"prefill_buckets": [16]})
    ids = torch.randint(3, 97, (1, 9), generator=torch.Generator().manual_seed(2))
    again.generate(ids, max_new_tokens=3)
    m.model.layers[0].self_attn.q_proj.weight = torch.nn.Parameter(torch.randn(64, 64))
    with pytest.raises(ValueError, match=r"^parameter 'model.layers.0.self_attn.q_proj.weight' of "
                       r"the LlamaForCausalLM was replaced .* after opencann.llm.compile: "):
        again.generate(ids, max_new_tokens=3)


def _storage(t):
    """(key, bytes) of the memory tensor ``t`` views (oneDNN's opaque copies by identity)."""
    if t.is_mkldnn:
        return -id(t), t.numel() * t.element_size()
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def test_memory_accounting_counts_each_storage_once_and_no_weight_in_three_layouts(monkeypatch):
    """``GenerationStats``' memory: module weights = the model's parameter and buffer
    storages, each once; packed = every other storage the step graphs' constants and
    their kernels' packed copies hold, each once, = the sum by kind; weight = module +
    packed. addmm_kn forced (weights of 1 MiB: the LM head gets a [k, n] copy; a
    weight a prefill race packed for oneDNN gets no second copy at decode); no module
    weight has two packed layouts, a concatenation none of its own (the Q/K/V weights are
    laid out as their [Σn, k] concatenation, the module's bytes do not grow; the row-major
    gate/up one is a copy); greedy tokens still equal transformers'."""
    from opencann.ops.kernels import cpu as cpu_kernels
    from tests.helpers import ForcedGemmChoice
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", ForcedGemmChoice("addmm_kn"))
    torch.manual_seed(7)
    cfg = T.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=1024,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        eos_token_id=None)                # 1 MiB MLP and LM head weights
    m = T.AutoModelForCausalLM.from_config(cfg).eval()
    before = sum(_storage(t)[1] for t in list(m.parameters()) + list(m.buffers()))
    gen = L.compile(m, max_seq_len=40, max_batch=1, options={"prefill_buckets": [32]})
    ids = torch.randint(3, 1024, (1, 20), generator=torch.Generator().manual_seed(1))
    want = m.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(gen.generate(ids, max_new_tokens=6, pad_token_id=0), want)
    s = gen.stats
    own = dict(_storage(t) for t in list(m.parameters()) + list(m.buffers()))
    assert sum(own.values()) == before   # laid out, not grown
    tables = dict(_storage(t) for t in (gen.lm.rope_cos, gen.lm.rope_sin))   # `rope_table`
    assert s.module_weight_bytes == before + sum(tables.values())
    own.update(tables)
    consts = [c.const for cm in gen.steps.compiled().values() for c in cm.graph.constants
              if isinstance(c.const, torch.Tensor)]
    extra = {}
    for t in consts + cpu_kernels.packed_copies(consts):
        key, nbytes = _storage(t)
        if key not in own:
            extra[key] = nbytes
    assert s.packed_bytes == sum(extra.values()) == sum(s.packed_bytes_by_kind.values()) > 0
    assert s.weight_bytes == s.module_weight_bytes + s.packed_bytes
    kinds = s.packed_bytes_by_kind
    # the LM head's [k, n] copy (1 row in both graphs: prefill gathers the last token);
    # the Q/K/V concatenation ([Σn, k], under 1 MiB) is the module's memory (held once),
    # counted under the module and in shared_weight_bytes; the gate/up one is row-major
    # [k, Σn] (addmm_kn forced), which would leave the weights transposed views, so it is
    # a copy beside the module's weights (hold_weights_once)
    assert kinds["addmm_kn"] >= 2**20 and kinds["qkv_concat"] == 0
    assert kinds["gate_up_concat"] == 2 * 2 * 2**20
    assert s.shared_weight_bytes == 2 * 256 * 512 * 4
    assert kinds["constants"] < 2**12   # folded scalars: no second copy of a module weight
    for w in consts:
        mine = _storage(w)[0]
        layouts = {_storage(c)[0] for c in cpu_kernels.packed_copies([w])} - {mine} - set(own)
        assert len(layouts) <= (0 if hasattr(w, "_opencann_parts") else 1), w.shape
    if sys.platform.startswith("linux"):
        assert s.peak_rss_bytes > 0 and f"peak RSS {s.peak_rss_bytes / 2**20:.0f} MiB" in s.summary()
    assert f"packed {s.packed_bytes / 2**20:.1f}" in s.summary()


def test_steps_run_on_one_thread_while_the_host_is_oversubscribed(monkeypatch):
    """While other processes hold the CPUs (`numba_cache.oversubscribed`), each step runs
    with one intra-op thread on the calling thread and gives the count back after: greedy
    tokens equal transformers', twice, and the caller's count is unchanged."""
    import opencann.ops.kernels.numba_cache as nc
    import opencann.runtime.thread_count as tc
    counts = []
    real = tc.set_this_thread

    def spy(n):
        counts.append(n)
        return real(n)
    monkeypatch.setattr(nc, "oversubscribed", lambda: True)
    monkeypatch.setattr(tc, "set_this_thread", spy)
    threads = torch.get_num_threads()
    torch.manual_seed(7)
    m = T.AutoModelForCausalLM.from_config(tiny_llm_config("llama")).eval()
    gen = L.compile(m, max_seq_len=32, max_batch=1, options={"backend": "opencann"})
    ids = torch.randint(3, 97, (1, 9), generator=torch.Generator().manual_seed(2))
    want = m.generate(ids, max_new_tokens=5, do_sample=False)
    for _ in range(2):
        assert torch.equal(gen.generate(ids, max_new_tokens=5), want)
    assert counts and set(counts) == {1} and torch.get_num_threads() == threads
