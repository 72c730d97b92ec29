"""opencann.llm computes what transformers' modules compute: every value their forward
reads from a module (RMSNorm ``variance_epsilon``, ``self_attn.scaling``, GPT-2's
``attn.scaling`` and LayerNorm ``eps``, the rotary module's ``inv_freq`` and
``attention_scaling``) is read from that module, not from ``model.config``
(`opencann.llm.module_values`). Greedy tokens equal eager transformers' ``generate``
after such a module attribute was set, and after the config was edited once the model
was built (which transformers' forward does not read), on the eager step backend and
through opencann.compile. On the compiled backend a module value changed after compile
is refused with the one line that says the step graphs baked it in (true: compiling
again with the new value gives eager's tokens), and an attribute neither forward reads
(dropout) is not refused. Tiny random models (hidden 32-64, 1-2 layers)."""
import pytest
import torch
import transformers as T

import opencann.llm as L

IDS = torch.tensor([[5, 9, 17, 33, 2, 41]])
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64, eos_token_id=None,
             initializer_range=0.2)
CONFIGS = {
    "llama": lambda: T.LlamaConfig(**SMALL, num_key_value_heads=2),
    "qwen2": lambda: T.Qwen2Config(**SMALL, num_key_value_heads=2),
    "mistral": lambda: T.MistralConfig(**SMALL, num_key_value_heads=1, sliding_window=64),
    "gpt2": lambda: T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                 bos_token_id=1, eos_token_id=None, initializer_range=0.2),
}


def fresh(name):
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()


def eager(m, ids=IDS, n=8):
    with torch.no_grad():
        return m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          do_sample=False, pad_token_id=0)


def _llama_modules(m):
    for i, layer in enumerate(m.model.layers):
        layer.input_layernorm.variance_epsilon = 0.5
        layer.post_attention_layernorm.variance_epsilon = 0.25 * (i + 1)
        layer.self_attn.scaling = 0.9 + i
    m.model.norm.variance_epsilon = 2.0
    m.model.rotary_emb.attention_scaling = 1.7
    with torch.no_grad():
        m.model.rotary_emb.inv_freq.mul_(3.0)


def _gpt2_modules(m):
    for i, block in enumerate(m.transformer.h):
        block.ln_1.eps, block.attn.scaling = 0.5, 1.3 / (i + 1)
    m.transformer.ln_f.eps = 3.0


def _config_after_build(m):
    """Config fields transformers' modules copied at __init__: their forward never reads
    the config's values again."""
    c = m.config
    if c.model_type == "gpt2":
        c.layer_norm_epsilon, c.scale_attn_weights, c.scale_attn_by_inverse_layer_idx = 0.5, False, True
    else:
        c.rms_norm_eps, c.head_dim = 0.5, 4


EDITS = [(n, _llama_modules) for n in ("llama", "qwen2", "mistral")] + \
    [("gpt2", _gpt2_modules)] + [(n, _config_after_build) for n in sorted(CONFIGS)]


@pytest.mark.parametrize("name, edit", EDITS, ids=[f"{n}-{e.__name__.strip('_')}" for n, e in EDITS])
def test_module_values_are_the_modules_on_the_eager_backend(name, edit):
    m = fresh(name)
    plain = eager(m)
    edit(m)
    want = eager(m)
    if edit is not _config_after_build:
        assert not torch.equal(want, plain)      # the edit changes transformers' tokens
    gen = L.compile(m, max_seq_len=32, options={"backend": "eager"})
    assert torch.equal(gen.generate(IDS, max_new_tokens=8), want)


@pytest.mark.parametrize("name, edit", [("llama", _llama_modules), ("gpt2", _gpt2_modules),
                                        ("qwen2", _config_after_build)])
def test_module_values_are_the_modules_compiled(name, edit):
    m = fresh(name)
    edit(m)
    gen = L.compile(m, max_seq_len=32)
    assert torch.equal(gen.generate(IDS, max_new_tokens=8), eager(m))


def test_a_module_value_changed_after_compile_is_refused_and_was_baked_in():
    m = fresh("llama")
    gen = L.compile(m, max_seq_len=32)
    assert torch.equal(gen.generate(IDS, max_new_tokens=8), eager(m))
    m.model.layers[1].self_attn.attention_dropout = 0.3     # read by neither forward in eval
    assert torch.equal(gen.generate(IDS, max_new_tokens=8), eager(m))
    m.model.layers[1].post_attention_layernorm.variance_epsilon = 0.5
    with pytest.raises(ValueError, match=r"'model.layers.1.post_attention_layernorm.variance_"
                       r"epsilon' of the LlamaForCausalLM was 1e-06 at opencann.llm.compile "
                       r"and is 0.5 now: the generator's step graphs baked its value in") as e:
        gen.generate(IDS, max_new_tokens=8)
    assert "\n" not in str(e.value)
    again = L.compile(m, max_seq_len=32)
    assert torch.equal(again.generate(IDS, max_new_tokens=8), eager(m))


def test_rotary_values_changed_after_compile_on_the_eager_backend():
    """The eager backend remakes its cos/sin table from the rotary module's values when
    they changed, as transformers' rotary module reads them at every call."""
    m = fresh("llama")
    gen = L.compile(m, max_seq_len=32, options={"backend": "eager"})
    gen.generate(IDS, max_new_tokens=3)
    with torch.no_grad():
        m.model.rotary_emb.inv_freq.mul_(2.0)
    assert torch.equal(gen.generate(IDS, max_new_tokens=8), eager(m))
    m.model.rotary_emb.attention_scaling = 1.5
    assert torch.equal(gen.generate(IDS, max_new_tokens=8), eager(m))


def test_arch_holds_the_modules_values():
    m = fresh("gpt2")
    _gpt2_modules(m)
    _config_after_build(m)
    a = L.DecoderLM(m).arch
    assert a.attn_scales == pytest.approx((1.3, 0.65)) and a.norm_eps == 3.0


def test_a_sequence_length_dependent_rope_type_on_the_module_is_one_line():
    m = fresh("llama")
    m.model.rotary_emb.rope_type = "dynamic"
    with pytest.raises(ValueError, match="RoPE type 'dynamic'") as e:
        L.compile(m, max_seq_len=32)
    assert "\n" not in str(e.value)


def test_a_rotary_buffer_changed_after_compile_is_named_a_buffer():
    m = fresh("llama")
    gen = L.compile(m, max_seq_len=32)
    gen.generate(IDS, max_new_tokens=2)
    with torch.no_grad():
        m.model.rotary_emb.inv_freq.mul_(2.0)
    with pytest.raises(ValueError, match=r"^buffer 'model.rotary_emb.inv_freq' of the "
                       r"LlamaForCausalLM was modified in place after opencann.llm.compile: the "
                       r"generator's step graphs were built from the model's buffers as they were "
                       r"then \(the RoPE cos/sin table from a rotary module's inv_freq\); compile it "
                       r"again after changing it") as e:
        gen.generate(IDS, max_new_tokens=2)
    assert "\n" not in str(e.value) and "packed copies of the weights" not in str(e.value)
