"""opencann.llm.arch: transformers configs read into `LLMArch`, and one clear ValueError line
for each unsupported piece (configs only: no model is built)."""
import pytest
import torch
import transformers as T

import opencann.llm
from opencann.llm import read_arch

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4)


def test_llama_gqa_sizes_and_scale():
    a = read_arch(T.LlamaConfig(**SMALL, num_key_value_heads=2, rms_norm_eps=1e-5))
    assert (a.family, a.model_type, a.num_heads, a.num_kv_heads, a.head_dim) == ("llama", "llama", 4, 2, 16)
    assert (a.vocab_size, a.hidden_size, a.num_layers, a.intermediate_size) == (97, 64, 2, 96)
    assert a.attn_scales == (0.25, 0.25) and a.norm_eps == 1e-5 and a.activation == "silu"
    assert not (a.qkv_bias or a.o_bias or a.mlp_bias) and a.rope_type == "default"
    assert a.sliding_window is None
    # 2 (K, V) * 2 layers * batch 3 * 2 heads * 50 positions * 16 * 4 bytes
    assert a.kv_cache_bytes(3, 50) == 2 * 2 * 3 * 2 * 50 * 16 * 4


def test_qwen2_has_qkv_bias_but_no_o_bias():
    a = read_arch(T.Qwen2Config(**SMALL, num_key_value_heads=1))
    assert a.qkv_bias and not a.o_bias and a.num_kv_heads == 1 and a.sliding_window is None


def test_llama_attention_and_mlp_bias_and_explicit_head_dim():
    a = read_arch(T.LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True, head_dim=8))
    assert a.qkv_bias and a.o_bias and a.mlp_bias and a.head_dim == 8 and a.attn_scales[0] == 8 ** -0.5


def test_gpt2_learned_positions_and_inverse_layer_scale():
    a = read_arch(T.GPT2Config(vocab_size=97, n_embd=64, n_layer=3, n_head=4, n_positions=40,
                               scale_attn_by_inverse_layer_idx=True))
    assert (a.family, a.head_dim, a.num_kv_heads, a.intermediate_size) == ("gpt2", 16, 4, 256)
    assert a.attn_scales == pytest.approx((0.25, 0.125, 0.25 / 3))
    assert a.tie_word_embeddings and a.activation == "gelu_new" and a.rope_type is None
    a.check_max_seq_len(40)
    with pytest.raises(ValueError, match=r"exceeds the model's 40 learned positions .*max_seq_len <= 40"):
        a.check_max_seq_len(41)


def test_rope_scaling_types_read_and_sequence_dependent_ones_refused():
    lin = read_arch(T.LlamaConfig(**SMALL, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                            "rope_theta": 10000.0}))
    assert lin.rope_type == "linear"
    cfg = T.LlamaConfig(**SMALL, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                  "rope_theta": 10000.0})
    with pytest.raises(ValueError, match=r"RoPE type 'dynamic' .*supported: default, linear, llama3, yarn"):
        read_arch(cfg)


def test_mistral_sliding_window_limits_max_seq_len():
    a = read_arch(T.MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=64))
    assert a.sliding_window == 64
    a.check_max_seq_len(64)
    with pytest.raises(ValueError, match=r"sliding-window attention \(window 64\).*max_seq_len <= 64"):
        a.check_max_seq_len(65)


def test_qwen2_sliding_window_only_when_used():
    assert read_arch(T.Qwen2Config(**SMALL, num_key_value_heads=2, sliding_window=32)).sliding_window is None
    a = read_arch(T.Qwen2Config(**SMALL, num_key_value_heads=2, use_sliding_window=True, sliding_window=32,
                                max_window_layers=0))
    assert a.sliding_window == 32


@pytest.mark.parametrize("cfg, piece", [
    (lambda: T.MixtralConfig(**SMALL), r"mixture-of-experts MLP \(model_type 'mixtral'\)"),
    (lambda: T.BloomConfig(), r"ALiBi position bias \(model_type 'bloom'\)"),
    (lambda: T.T5Config(), r"an encoder-decoder model"),
    (lambda: T.LlamaConfig(**SMALL, hidden_act="tanh"), r"the activation 'tanh'"),
    (lambda: T.LlamaConfig(**dict(SMALL, num_attention_heads=4), num_key_value_heads=3),
     r"4 query heads over 3 key/value heads"),
    (lambda: T.GPT2Config(n_embd=64, n_head=4, add_cross_attention=True), r"cross-attention"),
    (lambda: T.BertConfig(), r"model_type 'bert'; supported: gpt2, llama, mistral, qwen2"),
])
def test_unsupported_is_one_line_naming_the_piece(cfg, piece):
    with pytest.raises(ValueError, match=piece) as e:
        read_arch(cfg())
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "64"])
def test_max_seq_len_must_be_positive_int(bad):
    with pytest.raises(ValueError, match="max_seq_len must be a positive int"):
        read_arch(T.LlamaConfig(**SMALL)).check_max_seq_len(bad)


def test_a_module_without_a_config_is_one_line():
    import opencann.llm
    with pytest.raises(ValueError, match="takes a transformers causal LM .* got Linear") as e:
        opencann.llm.compile(torch.nn.Linear(2, 2), max_seq_len=16)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("scaling, limit", [
    (None, 64),
    ({"rope_type": "linear", "factor": 2.0}, 128),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, 128),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16}, 128),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}, 64),
])
def test_rope_max_seq_len_is_the_trained_context_stretched_by_its_scaling(scaling, limit):
    """Beyond max_position_embeddings (or original x factor for a RoPE scaling,
    transformers' modeling_rope_utils; the longer of the two) is one ValueError line."""
    a = read_arch(T.LlamaConfig(**SMALL, max_position_embeddings=64, rope_scaling=scaling))
    assert a.max_positions == limit
    a.check_max_seq_len(limit)
    with pytest.raises(ValueError, match=rf"^max_seq_len {limit + 1} exceeds the {limit} positions "
                       rf"the model was trained for \(.*\); compile with max_seq_len <= {limit}$"):
        a.check_max_seq_len(limit + 1)


def test_compile_refuses_max_seq_len_beyond_the_rope_context():
    m = T.LlamaForCausalLM(T.LlamaConfig(**SMALL, max_position_embeddings=32)).eval()
    with pytest.raises(ValueError, match=r"exceeds the 32 positions the model was trained for "
                       r"\(max_position_embeddings; a config rope_scaling .* extends it\)"):
        opencann.llm.compile(m, max_seq_len=33, options={"backend": "eager"})
    assert opencann.llm.compile(m, max_seq_len=32, options={"backend": "eager"}).max_seq_len == 32
