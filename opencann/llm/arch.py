"""Read a transformers causal-LM config into `LLMArch`: the few facts a decoder-only
model builder needs (sizes, norm, MLP kind, position encoding, biases, tying), or one
ValueError line naming the piece opencann.llm does not support.

Supported (``config.model_type``): ``gpt2`` (learned positions, LayerNorm, GELU MLP,
fused QKV Conv1D) and the Llama family ``llama``, ``mistral``, ``qwen2`` (RoPE, RMSNorm,
grouped-query attention, SwiGLU MLP, optional q/k/v/o/MLP biases - Qwen2's qkv bias).
RoPE types are those whose frequencies do not depend on the sequence length
(transformers' ``ROPE_INIT_FUNCTIONS``: ``default``, ``linear``, ``llama3``, ``yarn``);
the builder takes the frequencies from the model's own rotary embedding, so they are
transformers' to the bit. Names follow the transformers config fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

#: model types read here, by family
LLAMA_TYPES = ("llama", "mistral", "qwen2")
GPT2_TYPES = ("gpt2",)
#: RoPE types with frequencies fixed at load time (no dependence on the sequence length)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
#: activations of the MLP (transformers' ``ACT2FN`` names) the builder runs
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu")

#: known model types that are not supported, and the missing piece
_UNSUPPORTED = {
    "mixtral": "mixture-of-experts MLP", "qwen2_moe": "mixture-of-experts MLP",
    "qwen3_moe": "mixture-of-experts MLP", "deepseek_v2": "mixture-of-experts MLP and MLA attention",
    "deepseek_v3": "mixture-of-experts MLP and MLA attention", "olmoe": "mixture-of-experts MLP",
    "bloom": "ALiBi position bias", "mpt": "ALiBi position bias", "falcon": "ALiBi / parallel attention",
    "gemma": "Gemma's scaled embeddings and (1 + w) RMSNorm", "gemma2": "soft-capping and sliding window",
    "gemma3_text": "soft-capping and sliding window", "phi": "partial rotary embedding",
    "gpt_neox": "partial rotary embedding and parallel residual", "gptj": "interleaved rotary embedding",
    "qwen3": "q/k RMSNorm", "opt": "learned positions with offset and ReLU MLP", "t5": "an encoder-decoder",
    "bart": "an encoder-decoder",
}


@dataclass(frozen=True)
class LLMArch:
    """A decoder-only LM's architecture as opencann.llm builds it.

    Sizes are counts; ``head_dim`` D = per-head width; ``num_kv_heads`` Hkv divides
    ``num_heads`` Hq (GQA when Hkv < Hq). ``family`` is ``"llama"`` (RoPE, RMSNorm,
    gated MLP) or ``"gpt2"`` (learned positions, LayerNorm, plain MLP, fused QKV).
    ``attn_scales`` is the attention scale of each layer (D ** -0.5 unless the config
    says otherwise). ``sliding_window`` is the config's window (None: full attention):
    only a ``max_seq_len`` within it is accepted (`check_max_seq_len`).
    ``max_positions`` is the longest sequence (tokens) the model serves: GPT-2's
    ``n_positions`` (rows of its learned table), a RoPE model's ``max_position_embeddings``
    or, with a RoPE scaling (``linear``, ``llama3``, ``yarn``), the longer of that and
    ``original_max_position_embeddings`` x ``factor`` (`rope_context`); 0: unknown.
    ``config_positions`` is the config's own ``max_position_embeddings`` (GPT-2's
    ``n_positions``; 0: none), which transformers' ``generate`` caps its default length at
    whatever the RoPE scaling (`default_length_cap`)."""

    model_type: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    activation: str
    max_positions: int
    attn_scales: Tuple[float, ...]
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope_type: Optional[str] = None
    tie_word_embeddings: bool = False
    sliding_window: Optional[int] = None
    config_positions: Optional[int] = None

    @property
    def default_length_cap(self) -> int:
        """The sequence length (tokens) transformers' ``generate`` caps its default length
        at (``_prepare_generated_length``: the config's ``max_position_embeddings``, RoPE
        scaling not counted; 0: no cap): ``config_positions``, or ``max_positions`` for an
        arch read before that field was kept (a model file of an earlier opencann)."""
        return self.max_positions if self.config_positions is None else self.config_positions

    def kv_cache_bytes(self, max_batch: int, max_seq_len: int, itemsize: int = 4) -> int:
        """Bytes of the K and V caches of all layers: 2 * L * B_max * Hkv * S_max * D *
        ``itemsize`` (fp32: 4)."""
        return 2 * self.num_layers * max_batch * self.num_kv_heads * max_seq_len * self.head_dim * itemsize

    def check_max_seq_len(self, max_seq_len: int) -> None:
        """Raise ValueError (one line) when ``max_seq_len`` (tokens, prompt + generated)
        is not a positive int, exceeds the model's position table (GPT-2's ``n_positions``)
        or a sliding window (which this builder does not apply)."""
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive int (tokens of prompt + generated), "
                             f"got {max_seq_len!r}")
        if self.family == "gpt2" and max_seq_len > self.max_positions:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's {self.max_positions} "
                             f"learned positions (n_positions); compile with max_seq_len <= "
                             f"{self.max_positions}")
        if self.family == "llama" and 0 < self.max_positions < max_seq_len:
            scaled = (f"its RoPE scaling {self.rope_type!r} included" if self.rope_type != "default"
                      else "max_position_embeddings; a config rope_scaling such as "
                      "{'rope_type': 'linear', 'factor': 2.0} extends it")
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the {self.max_positions} positions "
                             f"the model was trained for ({scaled}); compile with max_seq_len <= "
                             f"{self.max_positions}")
        if self.sliding_window is not None and max_seq_len > self.sliding_window:
            raise ValueError(f"sliding-window attention (window {self.sliding_window}) is not "
                             f"supported by opencann.llm; compile with max_seq_len <= "
                             f"{self.sliding_window} (the window never takes effect then)")


def _get(config: Any, name: str, default: Any = None) -> Any:
    return getattr(config, name, default)


def _unsupported(model_type: str, piece: str) -> ValueError:
    return ValueError(f"opencann.llm does not support {piece} (model_type {model_type!r})")


def read_arch(config: Any) -> LLMArch:
    """`LLMArch` of a transformers ``PretrainedConfig`` of a causal LM.

    Raises ValueError, one line naming the missing piece: an unsupported model type
    (mixture of experts, ALiBi, encoder-decoder, ...), a RoPE type that depends on the
    sequence length (``dynamic``, ``longrope``) or a partial rotary factor, an
    activation outside `ACTIVATIONS`, heads that do not divide evenly."""
    mt = _get(config, "model_type", None) or type(config).__name__
    if _get(config, "is_encoder_decoder", False):
        raise _unsupported(mt, "an encoder-decoder model")
    if mt in _UNSUPPORTED:
        raise ValueError(f"opencann.llm does not support {_UNSUPPORTED[mt]} (model_type {mt!r}); "
                         f"supported: {', '.join(GPT2_TYPES + LLAMA_TYPES)}")
    if mt in GPT2_TYPES:
        return _read_gpt2(config)
    if mt in LLAMA_TYPES:
        return _read_llama(config, mt)
    raise ValueError(f"opencann.llm does not support model_type {mt!r}; supported: "
                     f"{', '.join(GPT2_TYPES + LLAMA_TYPES)}")


def _activation(mt: str, act: Any) -> str:
    if act not in ACTIVATIONS:
        raise _unsupported(mt, f"the activation {act!r} (supported: {', '.join(ACTIVATIONS)})")
    return act


def _heads(mt: str, hidden: int, heads: int, kv_heads: int) -> None:
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise _unsupported(mt, f"{heads} query heads over {kv_heads} key/value heads (query "
                           "heads must be a multiple of key/value heads)")


def _rope_type(config: Any, mt: str) -> str:
    params = _get(config, "rope_parameters", None) or _get(config, "rope_scaling", None) or {}
    if any(k in params for k in _get(config, "layer_types", None) or ()):
        raise _unsupported(mt, "RoPE parameters per layer type")
    rt = params.get("rope_type", params.get("type", "default")) or "default"
    if rt not in ROPE_TYPES:
        raise _unsupported(mt, f"RoPE type {rt!r} (frequencies that change with the sequence "
                           f"length; supported: {', '.join(ROPE_TYPES)})")
    prf = params.get("partial_rotary_factor", _get(config, "partial_rotary_factor", None))
    if prf not in (None, 1, 1.0):
        raise _unsupported(mt, f"partial rotary embedding (partial_rotary_factor {prf})")
    return rt


def rope_context(config: Any) -> int:
    """The longest sequence (tokens) a RoPE model serves: ``max_position_embeddings``,
    or with a RoPE scaling that stretches the trained context (``linear``, ``llama3``,
    ``yarn``: transformers' ``modeling_rope_utils``, where ``factor`` scales positions
    from ``original_max_position_embeddings``, default ``max_position_embeddings``) the
    longer of that and ``original_max_position_embeddings * factor``. 0 when the config
    has no ``max_position_embeddings``. Transformers itself runs past it unchecked
    (RoPE has no table): the model then sees positions it was never trained on."""
    limit = int(_get(config, "max_position_embeddings", 0) or 0)
    params = _get(config, "rope_parameters", None) or _get(config, "rope_scaling", None) or {}
    rt = params.get("rope_type", params.get("type", "default")) or "default"
    factor = params.get("factor")
    if limit and rt in ("linear", "llama3", "yarn") and factor:
        original = int(params.get("original_max_position_embeddings") or limit)
        limit = max(limit, int(original * float(factor)))
    return limit


def sliding_window(config: Any) -> Optional[int]:
    """The sliding-attention window (tokens) of a Llama-family ``config`` (`LLAMA_TYPES`;
    None for full attention and for other model types): `LLMArch.sliding_window`, whose
    size is the longest ``max_seq_len`` `LLMArch.check_max_seq_len` admits. Raises
    ValueError (one line) for attention layer types opencann.llm does not know."""
    mt = _get(config, "model_type", None)
    return _sliding_window(config, mt) if mt in LLAMA_TYPES else None


def _sliding_window(config: Any, mt: str) -> Optional[int]:
    types = set(_get(config, "layer_types", None) or ())
    if types - {"full_attention", "sliding_attention"}:
        raise _unsupported(mt, f"attention layer types {sorted(types)}")
    window = _get(config, "sliding_window", None)
    if mt == "qwen2" and not _get(config, "use_sliding_window", False):
        window = None
    if types == {"full_attention"} and mt != "mistral":
        window = None
    return int(window) if window else None


def _read_llama(config: Any, mt: str) -> LLMArch:
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    kv_heads = int(_get(config, "num_key_value_heads", None) or heads)
    _heads(mt, hidden, heads, kv_heads)
    head_dim = int(_get(config, "head_dim", None) or hidden // heads)
    qkv_bias = mt == "qwen2" or bool(_get(config, "attention_bias", False))
    return LLMArch(
        model_type=mt, family="llama", vocab_size=int(config.vocab_size), hidden_size=hidden,
        num_layers=int(config.num_hidden_layers), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=int(config.intermediate_size),
        norm_eps=float(config.rms_norm_eps), activation=_activation(mt, config.hidden_act),
        max_positions=rope_context(config),
        attn_scales=(head_dim ** -0.5,) * int(config.num_hidden_layers), qkv_bias=qkv_bias,
        o_bias=mt != "qwen2" and bool(_get(config, "attention_bias", False)),
        mlp_bias=bool(_get(config, "mlp_bias", False)), rope_type=_rope_type(config, mt),
        tie_word_embeddings=bool(_get(config, "tie_word_embeddings", False)),
        sliding_window=_sliding_window(config, mt),
        config_positions=int(_get(config, "max_position_embeddings", 0) or 0))


def _read_gpt2(config: Any) -> LLMArch:
    mt = "gpt2"
    if _get(config, "add_cross_attention", False):
        raise _unsupported(mt, "cross-attention (add_cross_attention)")
    hidden, heads, layers = int(config.n_embd), int(config.n_head), int(config.n_layer)
    if hidden % heads:
        raise _unsupported(mt, f"hidden size {hidden} not a multiple of {heads} heads")
    d = hidden // heads
    base = d ** -0.5 if _get(config, "scale_attn_weights", True) else 1.0
    inverse = bool(_get(config, "scale_attn_by_inverse_layer_idx", False))
    scales = tuple(base / (i + 1) if inverse else base for i in range(layers))
    return LLMArch(
        model_type=mt, family="gpt2", vocab_size=int(config.vocab_size), hidden_size=hidden,
        num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=d,
        intermediate_size=int(_get(config, "n_inner", None) or 4 * hidden),
        norm_eps=float(config.layer_norm_epsilon),
        activation=_activation(mt, config.activation_function),
        max_positions=int(config.n_positions), attn_scales=scales, qkv_bias=True, o_bias=True,
        mlp_bias=True, tie_word_embeddings=bool(_get(config, "tie_word_embeddings", True)),
        config_positions=int(_get(config, "max_position_embeddings", None) or config.n_positions))


__all__ = ["ACTIVATIONS", "GPT2_TYPES", "LLAMA_TYPES", "LLMArch", "ROPE_TYPES", "read_arch",
           "rope_context"]
