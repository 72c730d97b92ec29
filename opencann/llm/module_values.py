"""The values transformers' forward reads from a causal LM's modules (not its config),
read from those modules for `DecoderLM`, so that it computes what the modules compute:
also after a module attribute was set (``layer.input_layernorm.variance_epsilon = ...``)
and whatever the config says after the model was built (transformers' modules copy
what they need from it at ``__init__``; their forward reads the copies).

What each forward reads (transformers 5, ``modeling_llama.py`` / ``modeling_mistral.py``
/ ``modeling_qwen2.py`` / ``modeling_gpt2.py``) and where `DecoderLM` takes it:

- RMSNorm epsilon: ``LlamaRMSNorm.variance_epsilon`` (``MistralRMSNorm``, ``Qwen2RMSNorm``
  alike), per norm module (`norm_eps`);
- LayerNorm epsilon (GPT-2): ``nn.LayerNorm.eps``: the module is called;
- attention scale: ``self_attn.scaling`` / GPT-2's ``attn.scaling`` (set at ``__init__``
  from ``head_dim``, ``scale_attn_weights``, ``scale_attn_by_inverse_layer_idx``), per
  layer (`attn_scale`);
- head width: ``self_attn.head_dim`` / ``attn.head_dim`` (``view(..., -1, head_dim)``: the
  head counts follow from the projections' widths), and the layers run: Llama's
  ``layers[:config.num_hidden_layers]`` (its forward reads the config there), every
  block of GPT-2's ``h`` (`module_arch`);
- RoPE: the rotary module's ``inv_freq`` buffer, ``attention_scaling`` and ``rope_type``
  (`check_rope_type`; `DecoderLM.rope_table` reads the first two);
- activation: ``mlp.act_fn`` / GPT-2's ``mlp.act``: the module is called.

The sliding window is the config's (`arch.sliding_window`): the attention mask
transformers builds reads ``config.sliding_window``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Sequence, Tuple

from torch import nn

from .arch import LLMArch, ROPE_TYPES

#: plain attributes of transformers' modules that neither their forward (in eval mode)
#: nor `DecoderLM`'s reads: the generator's step graphs do not guard them (a change
#: changes no logit). Dropout (``attention_dropout``, ``Dropout.p``: DecoderLM computes
#: the eval-mode logits), sizes kept for reference (``hidden_size``, ``intermediate_size``,
#: GPT-2's ``embed_dim``, ``num_heads``), flags read at ``__init__`` only (GPT-2's
#: ``scale_attn_weights``, ``scale_attn_by_inverse_layer_idx``: ``scaling`` holds their
#: effect), GPT-2's ``reorder_and_upcast_attn`` (the same fp32 attention by another
#: order of operations), ``is_cross_attention``, the dynamic-RoPE bookkeeping
#: (``max_seq_len_cached``, ``original_max_seq_len``) and Qwen2's per-layer window
#: fields (``layer_type``, ``sliding_window``: the mask reads the config's).
UNREAD_ATTRIBUTES = frozenset({
    "attention_dropout", "p", "hidden_size", "intermediate_size", "embed_dim", "num_heads",
    "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
    "is_cross_attention", "max_seq_len_cached", "original_max_seq_len", "layer_type",
    "sliding_window"})


def norm_eps(norm: nn.Module, default: float) -> float:
    """The epsilon an RMSNorm module's forward adds: ``variance_epsilon`` (transformers'
    Llama/Mistral/Qwen2 RMSNorm), else ``eps`` (``torch.nn.RMSNorm``), else ``default``."""
    for name in ("variance_epsilon", "eps"):
        v = getattr(norm, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return default


def attn_scale(attn: nn.Module, default: float) -> float:
    """The scale on Q·Kᵀ an attention module's forward passes its attention function:
    its ``scaling`` (Llama family and GPT-2 in transformers 5), else ``default`` (the
    config's, `LLMArch.attn_scales`)."""
    v = getattr(attn, "scaling", None)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def _attn(layer: nn.Module) -> nn.Module:
    return layer.attn if hasattr(layer, "attn") else layer.self_attn


def _heads(arch: LLMArch, layers: Sequence[nn.Module]) -> Tuple[int, int, int]:
    """(head_dim, query heads, key/value heads) of ``layers`` as their forward views the
    projections: ``attn.head_dim`` and the projections' widths over it."""
    if not layers:
        return arch.head_dim, arch.num_heads, arch.num_kv_heads
    seen = set()
    for layer in layers:
        a = _attn(layer)
        d = int(getattr(a, "head_dim", arch.head_dim))
        if arch.family == "gpt2":
            width = int(getattr(a, "split_size", arch.hidden_size))
            seen.add((d, width // d, width // d))
        else:
            seen.add((d, a.q_proj.out_features // d, a.k_proj.out_features // d))
    if len(seen) > 1:
        raise ValueError(f"opencann.llm runs layers of one head layout, this {arch.model_type} "
                         f"model's attention modules have (head_dim, heads, kv_heads) "
                         f"{sorted(seen)}; give every layer's attention the same head_dim")
    d, hq, hkv = seen.pop()
    if hq < 1 or hkv < 1 or hq % hkv:
        raise ValueError(f"opencann.llm does not support {hq} query heads over {hkv} key/value "
                         f"heads (head_dim {d}; query heads must be a multiple of key/value heads)")
    return d, hq, hkv


def module_arch(arch: LLMArch, layers: Sequence[nn.Module], norm: nn.Module
                ) -> Tuple[LLMArch, List[nn.Module]]:
    """(``arch`` with the values the modules hold, the layers the forward runs):
    Llama family ``layers[:num_hidden_layers]``, GPT-2 every block; ``head_dim`` and head
    counts (`_heads`), per-layer ``attn_scales`` (`attn_scale`), ``norm_eps`` of the
    final norm (`norm_eps`; each norm's own is what runs). Raises ValueError (one line)
    for layers of different head layouts or heads that do not divide evenly."""
    run = list(layers) if arch.family == "gpt2" else list(layers)[:arch.num_layers]
    d, hq, hkv = _heads(arch, run)
    scales = tuple(attn_scale(_attn(layer), s) for layer, s in
                   zip(run, list(arch.attn_scales) + [d ** -0.5] * len(run)))
    return dataclasses.replace(arch, num_layers=len(run), head_dim=d, num_heads=hq,
                               num_kv_heads=hkv, attn_scales=scales,
                               norm_eps=norm_eps(norm, arch.norm_eps)), run


def check_rope_type(rotary: Any, arch: LLMArch) -> None:
    """Raise ValueError (one line) when the rotary module's ``rope_type`` (what its
    forward's ``dynamic_rope_update`` reads) is one whose frequencies change with the
    sequence length (not in `ROPE_TYPES`)."""
    rt = getattr(rotary, "rope_type", "default")
    if not isinstance(rt, str) or rt not in ROPE_TYPES:
        raise ValueError(f"opencann.llm does not support RoPE type {rt!r} (the rotary module's "
                         f"rope_type; model_type {arch.model_type!r}): frequencies that change "
                         f"with the sequence length; supported: {', '.join(ROPE_TYPES)}")


__all__ = ["UNREAD_ATTRIBUTES", "attn_scale", "check_rope_type", "module_arch", "norm_eps"]
