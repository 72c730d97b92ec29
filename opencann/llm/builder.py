"""`DecoderLM`: a transformers causal LM rewritten for generation with a preallocated
KV cache, using the two opencann custom ops (`opencann.ops.llm_torch`):
``torch.ops.opencann.kv_cache_update`` writes each layer's new keys/values into its cache
in place (scatter-update semantics of ``torch_npu.scatter_update_``), and
``torch.ops.opencann.decode_attention`` attends one query per row over the cache with
the live lengths as data (``npu_incre_flash_attention`` with ``actual_seq_lengths``).

The module holds the transformers model's own submodules and parameters (shared, not
copied: tied embeddings stay one tensor); the caches are forward INPUTS, written in
place, so one traced graph serves every position (`opencann.llm.generator`). The math
follows transformers' modeling files (``modeling_llama.py``, ``modeling_gpt2.py``) op for
op - RMSNorm in fp32, RoPE ``q * cos + rotate_half(q) * sin``, GPT-2's ``addmm`` Conv1D -
so logits equal transformers' eager logits to fp32 rounding.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import llm_torch  # noqa: F401  (registers torch.ops.opencann.*)
from .arch import LLMArch, read_arch
from .module_values import UNREAD_ATTRIBUTES, attn_scale, check_rope_type, module_arch, norm_eps


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: x * rsqrt(mean(x^2) + eps) in fp32, times weight."""
    dt = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dt)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _conv1d(x: torch.Tensor, mod: nn.Module) -> torch.Tensor:
    """transformers' GPT-2 Conv1D (weight [in, out]): addmm(bias, x, weight)."""
    return torch.addmm(mod.bias, x.reshape(-1, x.shape[-1]), mod.weight).view(*x.shape[:-1], -1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor,
           scale: float, last: Optional[torch.Tensor] = None,
           padded: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Write ``k``/``v`` [B, Hkv, T, D] into the caches [B, Hkv, S_max, D] at
    ``positions`` [B] (in place) and attend ``q`` [B, Hq, T, D]; returns [B, Hq, T, D].
    T == 1 (decode): DecodeAttention over cache positions 0 .. lengths[b]-1 (lengths
    [B] int64, data). T > 1 (prefill from position 0): causal attention over the T new
    tokens (SDPA, GQA when Hq > Hkv); rows shorter than T are right-padded and causality
    keeps the padding from reaching real tokens: ``padded`` ([B, 1, T, 1] bool, True at
    a row's padding, `pad_positions`) replaces the padded keys and values by zeros
    first (a select, not a product), as a masked key's value still enters SDPA's
    P·V as 0 x value, and 0 x NaN or 0 x Inf is NaN: a non-finite value computed at a
    padded position (a pad id's embedding, a position-table row only padding reaches)
    never reaches a real token. ``last`` (a prefill's last layer:
    [B] int64, each row's last live token, lengths - positions - 1): only that query
    attends, as a decode step does, over the cache just written (DecodeAttention over
    positions 0 .. lengths[b]-1, the keys causal attention gives it); returns
    [B, Hq, 1, D] (the other rows reach no logit: `_keep_last`)."""
    if padded is not None:
        k, v = torch.where(padded, 0.0, k), torch.where(padded, 0.0, v)
    torch.ops.opencann.kv_cache_update(k_cache, k, positions)
    torch.ops.opencann.kv_cache_update(v_cache, v, positions)
    if last is not None:
        idx = last.view(-1, 1, 1, 1).expand(q.shape[0], q.shape[1], 1, q.shape[3])
        q = torch.gather(q, 2, idx)
    if q.shape[2] == 1:    # the op returns float32; a no-op for the float32 models DecoderLM runs, and
        # a reduced-precision graph built for estimates (opencann.tools.estimate_llm) stays in its dtype
        return torch.ops.opencann.decode_attention(q, k_cache, v_cache, lengths, scale).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def pad_positions(pos: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, 1] bool, True where new token t of row b is padding: its cache position
    ``pos`` [B, T] (positions[b] + t) at or past the row's live length ``lengths`` [B]
    (a prompt right-padded to its bucket), for `attend`'s ``padded``. From ``pos``,
    which the step computes anyway: no constant of the bucket's length in the graph."""
    return (pos >= lengths[:, None])[:, None, :, None]


def _keep_last(h: torch.Tensor, last: Optional[torch.Tensor]) -> torch.Tensor:
    """The residual ``h`` [B, T, hidden], cut to each row's last live token [B, 1,
    hidden] when ``last`` ([B] int64 indices into T) is given: a prefill's last layer,
    whose other rows reach no logit, so its attention (`attend`'s ``last``: one query
    per row), output projection and MLP run on one row per sequence instead of T
    (llama.cpp's ``inp_out_ids``, ``ggml_get_rows`` in the last layer: at a 512-token
    prompt of a 12-layer model, ~6% of the prefill's GEMM FLOPs, and that layer's
    causal attention). Row-wise ops: the kept rows' values are those of the full
    computation, up to the GEMMs' rounding at another row count and the attention
    kernel's summation order."""
    if last is None:
        return h
    return torch.gather(h, 1, last.view(-1, 1, 1).expand(h.shape[0], 1, h.shape[2]))


class LlamaBlock(nn.Module):
    """One Llama/Mistral/Qwen2 decoder layer (RMSNorm, RoPE, GQA, gated MLP) over the
    transformers layer's own submodules."""

    def __init__(self, layer: nn.Module, arch: LLMArch):
        super().__init__()
        self.attn, self.mlp = layer.self_attn, layer.mlp
        self.ln1, self.ln2 = layer.input_layernorm, layer.post_attention_layernorm
        self.arch = arch

    def forward(self, h: torch.Tensor, rope: Tuple[torch.Tensor, torch.Tensor],
                positions: torch.Tensor, lengths: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, last: Optional[torch.Tensor] = None,
                padded: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``h`` [B, T, hidden] float32, ``rope`` (cos, sin) [B, T, D] -> [B, T, hidden]
        ([B, 1, hidden] with ``last``, [B] int64, each row's last live token: `attend`,
        `_keep_last`; ``padded``: a prompt's padding, `attend`); writes this layer's caches
        (`attend`). The norms' epsilons and the attention scale are the modules' own, read
        here (`module_values`)."""
        a, B, T = self.arch, h.shape[0], h.shape[1]
        x = _rms_norm(h, self.ln1.weight, norm_eps(self.ln1, a.norm_eps))
        q = self.attn.q_proj(x).view(B, T, a.num_heads, a.head_dim).transpose(1, 2)
        k = self.attn.k_proj(x).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
        v = self.attn.v_proj(x).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
        cos, sin = rope[0].unsqueeze(1), rope[1].unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        o = attend(q, k, v, k_cache, v_cache, positions, lengths,
                   attn_scale(self.attn, a.head_dim ** -0.5), last, padded)
        Tq = o.shape[2]   # 1 with ``last``
        o = o.transpose(1, 2).reshape(B, Tq, a.num_heads * a.head_dim)
        h = _keep_last(h, last) + self.attn.o_proj(o)
        x = _rms_norm(h, self.ln2.weight, norm_eps(self.ln2, a.norm_eps))
        return h + self.mlp.down_proj(self.mlp.act_fn(self.mlp.gate_proj(x)) * self.mlp.up_proj(x))


class GPT2Block(nn.Module):
    """One GPT-2 decoder layer (LayerNorm, fused QKV Conv1D, GELU MLP) over the
    transformers layer's own submodules."""

    def __init__(self, layer: nn.Module, arch: LLMArch):
        super().__init__()
        self.attn, self.mlp, self.ln1, self.ln2 = layer.attn, layer.mlp, layer.ln_1, layer.ln_2
        self.arch = arch

    def forward(self, h: torch.Tensor, rope, positions: torch.Tensor, lengths: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                last: Optional[torch.Tensor] = None,
                padded: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``h`` [B, T, hidden] float32 -> [B, T, hidden] ([B, 1, hidden] with ``last``, [B]
        int64, each row's last live token: `attend`, `_keep_last`; ``padded``: a prompt's
        padding, `attend`); ``rope`` is unused (learned positions); writes this layer's
        caches (`attend`). The attention scale is the module's ``scaling``
        (`module_values`); the LayerNorms are the modules, called."""
        a, B, T = self.arch, h.shape[0], h.shape[1]
        width = a.num_heads * a.head_dim    # GPT2Attention's split_size
        x = self.ln1(h)
        q, k, v = _conv1d(x, self.attn.c_attn).split(width, dim=2)
        q, k, v = (t.view(B, T, a.num_heads, a.head_dim).transpose(1, 2) for t in (q, k, v))
        o = attend(q, k, v, k_cache, v_cache, positions, lengths,
                   attn_scale(self.attn, a.head_dim ** -0.5), last, padded)
        Tq = o.shape[2]   # 1 with ``last``
        h = _keep_last(h, last) + _conv1d(o.transpose(1, 2).reshape(B, Tq, width),
                                          self.attn.c_proj)
        x = self.ln2(h)
        return h + _conv1d(self.mlp.act(_conv1d(x, self.mlp.c_fc)), self.mlp.c_proj)


def _parts(model: nn.Module, arch: LLMArch):
    """(embedding, position embedding or None, layers, final norm, LM head, rotary
    embedding or None) of a transformers causal LM; ValueError naming what is missing."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        raise ValueError(f"{type(model).__name__} has no causal LM head (lm_head); load the "
                         "model with AutoModelForCausalLM")
    if arch.family == "gpt2":
        t = model.transformer
        return t.wte, t.wpe, t.h, t.ln_f, head, None
    m = model.model
    return m.embed_tokens, None, m.layers, m.norm, head, m.rotary_emb


class DecoderLM(nn.Module):
    """A transformers causal LM (GPT-2, Llama, Mistral, Qwen2 families; `read_arch`)
    for generation over a preallocated KV cache, sharing the model's parameters.

    ``forward(input_ids, positions, lengths, *caches) -> logits``:
    ``input_ids`` [B, T] int64 (T == 1: a decode step; T > 1: a prompt from position 0,
    rows right-padded to T); ``positions`` [B] int64, the cache position of each row's
    first new token (zeros for a prompt); ``lengths`` [B] int64, each row's live length
    after this call (prompt lengths; positions + 1 when decoding); ``caches`` 2 * L
    tensors K0, V0, K1, V1, ... [B, Hkv, S_max, D] float32 (`new_caches`), written in
    place. Returns float32 logits [B, vocab] of each row's last live token (index
    lengths - positions - 1 of the T new tokens).

    Its forward calls no dropout and nothing else that reads a module's ``training``
    flag: it computes the eval-mode logits whatever the model's train/eval mode, and
    does not change that mode (``_opencann_unwatched``: the compiled step graphs do not
    guard the flag, nor the attributes neither forward reads, `UNREAD_ATTRIBUTES`).
    Every value transformers' forward reads from a module (norm epsilons, attention
    scales, head width, the rotary module's frequencies and scaling) is read from that
    module, not from the config (`module_values`); ``arch`` holds them (the final norm's
    epsilon as ``norm_eps``).

    Raises ValueError (one line) for an unsupported architecture (`read_arch`), a model
    without a causal LM head, parameters that are not float32 (the decode attention
    kernel is fp32: load with ``torch_dtype=torch.float32``) or that are inference
    tensors (made under ``torch.inference_mode()``)."""

    #: module attributes its forward never reads (`AttributeGuard` does not watch them)
    _opencann_unwatched = frozenset({"training"}) | UNREAD_ATTRIBUTES

    def __init__(self, model: nn.Module):
        super().__init__()
        if getattr(model, "config", None) is None:
            raise ValueError(f"opencann.llm takes a transformers causal LM (a model with a "
                             f".config, e.g. AutoModelForCausalLM.from_pretrained(...)), got "
                             f"{type(model).__name__}; use opencann.compile for other modules")
        self.arch = arch = read_arch(model.config)
        dtypes = {p.dtype for p in model.parameters()}
        if dtypes != {torch.float32}:
            raise ValueError(f"opencann.llm runs float32 models, this one has "
                             f"{sorted(str(d) for d in dtypes)} parameters; load it with "
                             "torch_dtype=torch.float32 or call model.float()")
        made = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
                if t.is_inference()]
        if made:
            raise ValueError(f"the model's {made[0]!r} is an inference tensor (the model was "
                             "created or loaded under torch.inference_mode()): load it outside "
                             "inference_mode (torch.no_grad() is enough); generate() may then "
                             "run inside it")
        self.embed, self.pos_embed, layers, self.norm, self.lm_head, rotary = _parts(model, arch)
        # the values transformers' forward reads from the modules, from the modules
        arch, layers = module_arch(arch, layers, self.norm)
        self.arch = arch
        if rotary is not None:
            check_rope_type(rotary, arch)
        block = GPT2Block if arch.family == "gpt2" else LlamaBlock
        self.blocks = nn.ModuleList(block(layer, arch) for layer in layers)
        self.rotary = rotary
        self.config = model.config
        # this module's parameter/buffer names -> the model's (errors name the user's)
        self._source_class = type(model).__name__
        self._source_names = _source_names(self, model)

    def source_name(self, name: str) -> str:
        """The transformers model's name of this module's parameter or buffer ``name``
        (e.g. ``blocks.1.mlp.up_proj.weight`` -> ``model.layers.1.mlp.up_proj.weight``), with
        the model's class: ``"'model.layers.1.mlp.up_proj.weight' of the LlamaForCausalLM"``."""
        return f"{self._source_names.get(name, name)!r} of the {self._source_class}"

    def source_attribute(self, name: str) -> str:
        """The transformers model's name of this module's submodule attribute ``name``
        (``blocks.0.ln1.variance_epsilon`` -> ``model.layers.0.input_layernorm.variance_epsilon``),
        quoted, with the model's class (as `source_name`)."""
        path, _, attr = name.rpartition(".")
        mod = self._source_names.get(("module", path), path)
        return f"{(mod + '.' if mod else '') + attr!r} of the {self._source_class}"

    def new_caches(self, max_batch: int, max_seq_len: int) -> List[torch.Tensor]:
        """Zeroed caches K0, V0, ... [max_batch, Hkv, max_seq_len, D] float32 (2 * L
        tensors, `LLMArch.kv_cache_bytes` in all; `new_caches`)."""
        return new_caches(self.arch, max_batch, max_seq_len)

    def rope_table(self, positions: int) -> None:
        """Compute (cos, sin) once for positions 0 .. ``positions`` - 1 (buffers
        ``rope_cos``/``rope_sin`` [positions, D] float32, not saved in a state dict): each
        step then gathers its rows (one Embedding each) instead of computing them (a
        cast, a multiply, a concatenation, cos and sin per step: 5 small ops, ~0.1 ms of a
        decode step after the weights streamed through the caches). Same bits as the
        per-step formula (`_rope`: the same elementwise ops on the same values). A
        position at or past ``positions`` then fails the gather; opencann.llm's generator
        calls this with its ``max_seq_len``. No-op for learned positions (GPT-2)."""
        if self.rotary is None:
            return
        with torch.inference_mode(False):   # read by graphs built later, in any mode
            for name in ("rope_cos", "rope_sin"):   # made from the rotary module's values now
                self._buffers.pop(name, None)
            cos, sin = self._rope(torch.arange(positions, dtype=torch.long)[None], torch.float32)
            self.register_buffer("rope_cos", cos[0].contiguous(), persistent=False)
            self.register_buffer("rope_sin", sin[0].contiguous(), persistent=False)
            self._rope_from = (self.rotary.inv_freq.detach().clone(), self.rotary.attention_scaling)

    def rope_table_current(self) -> bool:
        """Whether the table `rope_table` made still holds the rotary module's values (its
        ``inv_freq`` and ``attention_scaling`` unchanged since; True without a table): the
        eager step backend remakes it otherwise, as transformers' rotary module reads them
        at every call (compiled step graphs guard them instead)."""
        made = getattr(self, "_rope_from", None)
        if made is None:
            return True
        inv = self.rotary.inv_freq
        return (made[1] == self.rotary.attention_scaling and inv.shape == made[0].shape
                and bool(torch.equal(inv, made[0])))

    def _rope(self, pos: torch.Tensor, dtype: torch.dtype):
        """(cos, sin) [*pos.shape, D] for positions ``pos`` ([B, T] or [B]), as transformers' rotary
        embedding computes them (its inv_freq and attention scaling); rows of the table
        `rope_table` made, when it did."""
        table = getattr(self, "rope_cos", None)
        if table is not None:
            return (F.embedding(pos, table).to(dtype), F.embedding(pos, self.rope_sin).to(dtype))
        freqs = pos[..., None].float() * self.rotary.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        s = self.rotary.attention_scaling
        if s == 1.0:   # x * 1.0 is x, bit for bit: two graph nodes fewer per step
            return emb.cos().to(dtype), emb.sin().to(dtype)
        return (emb.cos() * s).to(dtype), (emb.sin() * s).to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor,
                *caches: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] float32 of each row's last live token; writes the caches
        in place (see the class docstring for shapes)."""
        if len(caches) != 2 * len(self.blocks):
            raise ValueError(f"DecoderLM takes {2 * len(self.blocks)} caches (K and V per layer, "
                             f"from new_caches), got {len(caches)}")
        B, T = input_ids.shape
        if T == 1:
            # a decode step gathers by ``positions`` [B] itself and views the rows as
            # [B, 1, D]: views of planned buffers, made once at bind time, where
            # positions[:, None] + arange(1) were two ops a step, run on caches the last
            # step's weights streamed through (same values: an integer add of 0)
            pos, rows = positions, (lambda t: t[:, None])
        else:
            pos = positions[:, None] + torch.arange(T, dtype=positions.dtype, device=positions.device)
            rows = (lambda t: t)
        h = self.embed(input_ids)
        if self.pos_embed is not None:
            h = h + rows(self.pos_embed(pos))
        rope = tuple(map(rows, self._rope(pos, h.dtype))) if self.rotary is not None else None
        # a prompt: the last layer keeps each row's last live token only (`_keep_last`);
        # its padding's keys and values are zeroed before attention (`attend`)
        last = lengths - positions - 1 if T > 1 else None
        padded = pad_positions(pos, lengths) if T > 1 else None
        n = len(self.blocks)
        for i, blk in enumerate(self.blocks):
            h = blk(h, rope, positions, lengths, caches[2 * i], caches[2 * i + 1],
                    last if i == n - 1 else None, padded)
        h = h[:, 0] if n or last is None else _keep_last(h, last)[:, 0]
        h = self.norm(h) if self.arch.family == "gpt2" else _rms_norm(
            h, self.norm.weight, norm_eps(self.norm, self.arch.norm_eps))
        return self.lm_head(h).float()


def _source_names(lm: nn.Module, model: nn.Module) -> Dict[Any, str]:
    """``lm``'s parameter and buffer names -> ``model``'s names of the same tensors (the
    first name transformers lists for a tied tensor), and ``("module", path)`` of each
    of ``lm``'s submodules that is one of ``model``'s -> its path there."""
    theirs: Dict[int, str] = {}
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        theirs.setdefault(id(t), n)
    mine = list(lm.named_parameters()) + list(lm.named_buffers())
    out: Dict[Any, str] = {n: theirs[id(t)] for n, t in mine if id(t) in theirs}
    mods = {id(m): n for n, m in model.named_modules()}
    out.update({("module", n): mods[id(m)] for n, m in lm.named_modules() if id(m) in mods})
    return out


def new_caches(arch: LLMArch, max_batch: int, max_seq_len: int) -> List[torch.Tensor]:
    """Zeroed caches K0, V0, ... [max_batch, Hkv, max_seq_len, D] float32 for ``arch``
    (2 * L tensors, `LLMArch.kv_cache_bytes` in all): float32 whatever torch's default
    dtype, normal tensors (not inference tensors) even under ``torch.inference_mode()``."""
    with torch.inference_mode(False):   # written in place by every call, in any mode
        return [torch.zeros(max_batch, arch.num_kv_heads, max_seq_len, arch.head_dim,
                            dtype=torch.float32) for _ in range(2 * arch.num_layers)]


def shared_parameters(a: nn.Module, b: nn.Module) -> Sequence[str]:
    """Names of ``a``'s parameters whose storage is also one of ``b``'s (what a
    `DecoderLM` shares with the transformers model it was built from)."""
    ptrs = {p.untyped_storage().data_ptr() for p in b.parameters()}
    return [n for n, p in a.named_parameters() if p.untyped_storage().data_ptr() in ptrs]


__all__ = ["DecoderLM", "GPT2Block", "LlamaBlock", "attend", "new_caches", "pad_positions",
           "shared_parameters"]
