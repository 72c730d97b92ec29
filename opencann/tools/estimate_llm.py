"""``estimate --llm``: prefill latency (TTFT) and decode latency per token of a decoder LLM on a
virtual NPU, from `opencann.llm`'s step graphs on the vnpu cost model.

How (the model is never run, and never built whole):

1. The transformers config (a built-in name, ``llama2-7b`` / ``llama2-70b``, a config object
   or a local model directory) is split for tensor parallelism over ``cards`` C
   (Megatron-style: attention heads, KV heads, MLP intermediate size and vocabulary divided
   by C; hidden size kept), then cut to ONE and to TWO decoder layers.
2. Each cut is a `DecoderLM` (`opencann.llm.builder`) made on the meta device and given
   uninitialised storage in ``dtype`` (``to_empty``: the weights' values never matter, and
   untouched pages cost no RAM), with the KV cache [B, Hkv/C, context, D] in ``dtype`` as
   graph inputs (fake tensors). The prefill step (``prompt`` tokens) and the decode step
   (1 token) are compiled for the vnpu and costed by `opencann.tools.estimate.estimate`
   (weights and KV cache in HBM; DecodeAttention reads the whole cache: memory-bound).
3. One layer's cost = (2-layer graph) - (1-layer graph); the rest (embedding, RoPE tables,
   final norm, LM head) = (1-layer graph) - one layer; a model of L layers costs
   rest + L · layer, plus, with C > 1, two all-reduces of the hidden state per layer
   (`opencann.devices.vnpu.cost_model.allreduce_cost`, HCCS) - Megatron's row-parallel
   o_proj and down_proj.
4. Graph mode (TorchAir max-autotune, GE's graph sink): kernels back to back, each paying
   the device launch (`NpuSpec.kernel_launch_us`). Eager (single-op mode): the same fused
   kernels (TorchAir's reference runs its fused torch_npu ops - RMSNorm, RoPE, incremental
   FlashAttention - in both modes) issued one by one from the host, each costing
   max(host dispatch, device time) (`eager_time_us`: the host enqueues asynchronously;
   small decode kernels are dispatch-bound).

Calibration against TorchAir's published Llama2 figures: `opencann.devices.vnpu.calibration`
(the ``[TA-7B]`` / ``[TA-70B]`` rows) and docs/guide/vnpu.md.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from ..devices import parse_device
from ..devices.vnpu import NpuSpec
from ..devices.vnpu.cost_model import allreduce_cost, dispatch_us
from .estimate import EstimateReport, estimate

GiB = float(1 << 30)

#: Llama-2 configs by name (transformers ``LlamaConfig`` values of meta-llama/Llama-2-7b-hf and
#: Llama-2-70b-hf: Touvron et al. 2023, "Llama 2", Table 1 and the released config.json files).
LLAMA2_CONFIGS: Dict[str, Dict[str, Any]] = {
    "llama2-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5),
    "llama2-70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       intermediate_size=28672, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5),
}
MODES = ("graph", "eager")


@dataclass
class StepEstimate:
    """One step (prefill or decode) of the whole model on one card, µs: ``layer_us`` (one
    decoder layer's kernels), ``rest_us`` (embedding, RoPE tables, final norm, LM head),
    ``allreduce_us`` (the two per-layer all-reduces, 0 on one card), ``layers`` L, and the
    kernel counts; ``total_us`` = rest + L · (layer + all-reduce)."""

    tokens: int
    layer_us: float
    rest_us: float
    allreduce_us: float
    layers: int
    layer_kernels: int
    rest_kernels: int
    layer_hbm_bytes: float
    rest_hbm_bytes: float

    @property
    def total_us(self) -> float:
        """Whole-model step time, µs."""
        return self.rest_us + self.layers * (self.layer_us + self.allreduce_us)

    @property
    def kernels(self) -> int:
        """Kernels per step (all-reduces included)."""
        return self.rest_kernels + self.layers * (self.layer_kernels + (2 if self.allreduce_us else 0))

    @property
    def hbm_bytes(self) -> float:
        """HBM bytes read + written per step on one card."""
        return self.rest_hbm_bytes + self.layers * self.layer_hbm_bytes


@dataclass
class LlmEstimate:
    """What `estimate_llm` found: ``prefill`` (TTFT for ``prompt`` tokens) and ``decode``
    (one token at ``context``) in graph mode, ``prefill_eager`` / ``decode_eager`` (None
    unless asked), per-card weight and KV-cache bytes against the preset's HBM, and notes."""

    model: str
    device: str
    spec: NpuSpec
    dtype: str
    batch: int
    cards: int
    prompt: int
    context: int
    layers: int
    prefill: StepEstimate
    decode: StepEstimate
    prefill_eager: Optional[StepEstimate]
    decode_eager: Optional[StepEstimate]
    weights_bytes: float
    kv_cache_bytes: float
    notes: List[str] = field(default_factory=list)

    @property
    def ttft_ms(self) -> float:
        """Prefill latency (time to first token), ms, graph mode."""
        return self.prefill.total_us / 1e3

    @property
    def decode_ms(self) -> float:
        """Decode latency per token, ms, graph mode."""
        return self.decode.total_us / 1e3

    @property
    def hbm_needed_bytes(self) -> float:
        """Weights + KV cache per card, bytes (activations are small beside them)."""
        return self.weights_bytes + self.kv_cache_bytes

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready dict (times in µs and ms, sizes in bytes)."""
        def step(s: Optional[StepEstimate]):
            return None if s is None else dict(vars(s), total_us=s.total_us, kernels=s.kernels, hbm_bytes=s.hbm_bytes)
        return {"model": self.model, "device": self.device, "preset": self.spec.name, "dtype": self.dtype,
                "batch": self.batch, "cards": self.cards, "prompt": self.prompt, "context": self.context,
                "layers": self.layers, "ttft_ms": self.ttft_ms, "decode_ms": self.decode_ms,
                "prefill": step(self.prefill), "decode": step(self.decode),
                "prefill_eager": step(self.prefill_eager), "decode_eager": step(self.decode_eager),
                "weights_bytes_per_card": self.weights_bytes, "kv_cache_bytes_per_card": self.kv_cache_bytes,
                "hbm_capacity_bytes": self.spec.hbm_bytes, "notes": self.notes}

    def to_json(self, path: Optional[str] = None) -> str:
        """The estimate as JSON (written to ``path`` when given)."""
        s = json.dumps(self.to_dict(), indent=2, default=str)
        if path:
            with open(path, "w") as f:
                f.write(s)
        return s

    def to_text(self) -> str:
        """Readable summary: TTFT, decode ms/token and tokens/s, the split per layer, memory."""
        tp = f" x {self.cards} cards (tensor parallel)" if self.cards > 1 else ""
        lines = [f"opencann estimate --llm: {self.model} on {self.device} ({self.spec.name}){tp}, {self.dtype}, "
                 f"batch {self.batch}, prompt {self.prompt}, context {self.context}"]
        for name, g, e in (("prefill (TTFT)", self.prefill, self.prefill_eager),
                           ("decode / token", self.decode, self.decode_eager)):
            lines.append(f"  {name:15s} {g.total_us / 1e3:9.2f} ms graph mode"
                         + (f", {e.total_us / 1e3:.2f} ms eager" if e is not None else "")
                         + f"  ({self.layers} x {g.layer_us:.1f} us per layer"
                         + (f" + {g.allreduce_us:.1f} us all-reduce" if g.allreduce_us else "")
                         + f" + {g.rest_us:.1f} us embedding/head; {g.kernels} kernels, "
                         f"{g.hbm_bytes / 1e9:.2f} GB HBM traffic)")
        lines.append(f"  decode throughput: {1e6 * self.batch / self.decode.total_us:.1f} tokens/s "
                     f"({self.batch} sequences)")
        lines.append(f"  memory per card: weights {self.weights_bytes / GiB:.2f} GiB + KV cache "
                     f"{self.kv_cache_bytes / GiB:.2f} GiB = {self.hbm_needed_bytes / GiB:.2f} GiB of "
                     f"{self.spec.hbm_bytes / GiB:.0f} GiB HBM")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# -- configs --------------------------------------------------------------------------------

def llm_config(model: Any):
    """A transformers config from ``model``: a `LLAMA2_CONFIGS` name, a
    ``transformers.PretrainedConfig``, a transformers model (its ``config``), or a local model directory / hub id already in the cache
    (``AutoConfig.from_pretrained``, offline). Raises ValueError (one line) otherwise."""
    from transformers import AutoConfig, LlamaConfig, PretrainedConfig
    if isinstance(model, PretrainedConfig):
        return model
    if isinstance(getattr(model, "config", None), PretrainedConfig):   # a transformers model
        return model.config
    if isinstance(model, str) and model.lower() in LLAMA2_CONFIGS:
        return LlamaConfig(**LLAMA2_CONFIGS[model.lower()])
    try:
        return AutoConfig.from_pretrained(model)
    except (OSError, ValueError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        shown = repr(model) if isinstance(model, (str, os.PathLike)) else type(model).__name__
        raise ValueError(f"--llm {shown}: not a built-in config ({', '.join(LLAMA2_CONFIGS)}) and no readable "
                         f"transformers config ({first}); give a name, a model directory with config.json, "
                         "or a transformers config") from None


def shard_config(cfg, cards: int):
    """``cfg`` as ONE card of ``cards``-way tensor parallelism (Megatron-LM, Shoeybi et al. 2019):
    heads, KV heads (at least 1 per card: replicated when fewer than the cards), MLP
    intermediate size and vocabulary divided by ``cards``; ``head_dim`` kept. Raises ValueError
    when a size does not divide."""
    from ..llm.arch import read_arch
    a = read_arch(cfg)
    if cards == 1:
        return cfg
    kv = max(1, a.num_kv_heads // cards)
    for what, n in (("attention heads", a.num_heads), ("MLP intermediate size", a.intermediate_size),
                    ("vocabulary", a.vocab_size)):
        if n % cards:
            raise ValueError(f"--cards {cards}: the {what} ({n}) do not split evenly over {cards} cards; "
                             "use a number of cards that divides it")
    if a.num_kv_heads >= cards and a.num_kv_heads % cards:
        raise ValueError(f"--cards {cards}: the {a.num_kv_heads} KV heads do not split evenly over {cards} cards; "
                         "use a number of cards that divides them")
    d = cfg.to_dict()
    d.update(num_attention_heads=a.num_heads // cards, num_key_value_heads=kv, head_dim=a.head_dim,
             intermediate_size=a.intermediate_size // cards, vocab_size=a.vocab_size // cards)
    return type(cfg)(**d)


def _layers_config(cfg, layers: int):
    d = cfg.to_dict()
    d["num_hidden_layers"] = layers
    return type(cfg)(**d)


def _empty_lm(cfg, dtype: torch.dtype):
    """A `DecoderLM` of ``cfg`` with uninitialised weights in ``dtype`` (the RoPE frequencies
    recomputed: ``to_empty`` drops buffers' values)."""
    from transformers import AutoModelForCausalLM
    from ..llm.builder import DecoderLM
    with torch.device("meta"):
        lm = DecoderLM(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32))
    lm = lm.to(dtype).to_empty(device="cpu")
    if lm.rotary is not None:
        fresh = type(lm.rotary)(cfg)                 # transformers' own frequencies, on the host
        lm.rotary.inv_freq = fresh.inv_freq.float()
        lm.rotary.attention_scaling = fresh.attention_scaling
    return lm


# -- costing ----------------------------------------------------------------------------------

def _step_report(lm, batch: int, tokens: int, context: int, device: str, dtype: torch.dtype,
                 fused: bool) -> EstimateReport:
    a = lm.arch
    caches = [torch.empty(batch, a.num_kv_heads, context, a.head_dim, dtype=dtype) for _ in range(2 * a.num_layers)]
    ex = (torch.zeros(batch, tokens, dtype=torch.long), torch.zeros(batch, dtype=torch.long),
          torch.full((batch,), tokens, dtype=torch.long), *caches)
    return estimate(lm, ex, device=device, batch=batch, fused=fused, check_fit=False, fusion_comparison=False)


def _time(rep: EstimateReport, eager: bool, spec: NpuSpec) -> float:
    """µs of a report's kernels: graph mode as costed; eager: each kernel max(host dispatch, device)."""
    if not eager:
        return rep.total_time_us
    return sum(max(dispatch_us("flash_attention" if r.op == "FlashAttention" else "matmul", spec), r.time_us)
               for r in rep.rows if r.bound != "fused")


def _step(one: EstimateReport, two: EstimateReport, layers: int, tokens: int, batch: int, hidden: int,
          itemsize: int, cards: int, spec: NpuSpec, eager: bool) -> StepEstimate:
    t1, t2 = _time(one, eager, spec), _time(two, eager, spec)
    k1 = sum(r.bound != "fused" for r in one.rows)
    k2 = sum(r.bound != "fused" for r in two.rows)
    layer = max(0.0, t2 - t1)
    ar = 2 * allreduce_cost(batch * tokens * hidden * itemsize, cards, spec).time_us
    if eager and cards > 1:
        ar = 2 * max(dispatch_us("matmul", spec), ar / 2)
    hb1, hb2 = one.total_hbm_bytes, two.total_hbm_bytes
    return StepEstimate(tokens, layer, max(0.0, t1 - layer), ar, layers, k2 - k1, max(0, 2 * k1 - k2),
                        max(0.0, hb2 - hb1), max(0.0, 2 * hb1 - hb2))


def estimate_llm(model: Any, device: str = "vnpu:ascend910b", dtype: str = "float16", prompt: int = 1024,
                 context: Optional[int] = None, batch: int = 1, cards: int = 1, eager: bool = False) -> LlmEstimate:
    """Estimate prefill latency (TTFT) and decode latency per token of a decoder LLM on a vnpu.

    Args:
        model: a built-in name (``llama2-7b``, ``llama2-70b``), a transformers config, or a local
            model directory (its config.json; weights are never read). Families: those of
            `opencann.llm.arch.read_arch` (Llama, Mistral, Qwen2, GPT-2).
        device: ``vnpu:<preset>`` or ``vnpu:<spec.json|.toml>``.
        dtype: weights, activations and KV cache: 'float16', 'bfloat16' or 'float32'.
        prompt: prompt length N (tokens) of the prefill step.
        context: KV-cache length (tokens) each decode step attends over; None: the model's
            position limit (TorchAir preallocates the cache at ``max_position_embeddings`` and
            its decode attention reads it whole), else ``prompt``.
        batch: sequences B per step.
        cards: tensor-parallel cards C (weights and KV heads split; two HCCS all-reduces of
            the [B, T, hidden] state per layer).
        eager: also estimate single-op (eager) mode: the same kernels, each paying
            max(host dispatch, device time).
    Returns: `LlmEstimate` (µs / ms per step, bytes per card).
    Raises:
        ValueError: not a vnpu device, an unknown preset or model, a dtype that is not a
            float, prompt / context / batch / cards < 1, context < prompt, sizes that do not split over the
            cards, or cards > 1 on a preset without HCCS figures (one line each, naming the fix).
    """
    spec = parse_device(device, kind="vnpu").spec
    dt = _check_args(prompt, context, batch, cards, dtype)
    cfg = llm_config(model)
    from ..llm.arch import read_arch
    full = read_arch(cfg)
    if context is None:
        context = max(prompt, full.max_positions or prompt)
    if cards > 1:
        allreduce_cost(1, cards, spec)      # a preset without HCCS figures fails here, before any compile
    card = shard_config(cfg, cards)
    itemsize = torch.empty((), dtype=dt).element_size()
    reps: Dict[tuple, EstimateReport] = {}
    for n in (1, 2):
        lm = _empty_lm(_layers_config(card, n), dt)
        for tokens, ctx in ((prompt, max(prompt, context)), (1, context)):
            reps[(n, tokens)] = _step_report(lm, batch, tokens, ctx, device, dt, fused=True)
        del lm
    a = read_arch(card)

    def step(tokens: int, e: bool) -> StepEstimate:
        return _step(reps[(1, tokens)], reps[(2, tokens)], full.num_layers, tokens, batch,
                     full.hidden_size, itemsize, cards, spec, e)
    w1, w2 = reps[(1, 1)].weights_bytes, reps[(2, 1)].weights_bytes
    weights = (w1 - (w2 - w1)) + full.num_layers * (w2 - w1)
    kv = a.kv_cache_bytes(batch, context, itemsize) / a.num_layers * full.num_layers
    name = model if isinstance(model, str) else getattr(cfg, "_name_or_path", "") or cfg.model_type
    out = LlmEstimate(str(name), device, spec, str(dtype), batch, cards, prompt, context, full.num_layers,
                      step(prompt, False), step(1, False), step(prompt, True) if eager else None,
                      step(1, True) if eager else None, weights, kv)
    out.notes += _notes(out, reps[(1, 1)].fallbacks)
    return out


def _check_args(prompt, context, batch, cards, dtype) -> torch.dtype:
    """The torch dtype of ``dtype``; ValueError (one line) for a count < 1, a context shorter
    than the prompt or a dtype that is no float."""
    for name, v in (("prompt", prompt), ("batch", batch), ("cards", cards)) + ((("context", context),) if context is not None else ()):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"estimate_llm: {name} must be an integer >= 1, got {v!r}")
    if context is not None and context < prompt:
        raise ValueError(f"estimate_llm: context {context} is shorter than the prompt {prompt}: the "
                         f"KV cache holds the prompt and every generated token; give context >= prompt")
    dt = getattr(torch, str(dtype), None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"estimate_llm: dtype {dtype!r} is not a float dtype; use float16, bfloat16 or float32")
    return dt


def _notes(out: LlmEstimate, fallbacks: Dict[str, int]) -> List[str]:
    """How the estimate was built, whether it fits in HBM, and the ops without a cost function."""
    notes = [f"built from the step graphs of 1 and 2 decoder layers at the real shapes"
             f"{' of one card' if out.cards > 1 else ''}, scaled to {out.layers} layers "
             "(the whole model is never instantiated)"]
    if out.hbm_needed_bytes > out.spec.hbm_bytes:
        notes.append(f"does NOT fit: {out.hbm_needed_bytes / GiB:.1f} GiB of weights + KV cache per card > "
                     f"{out.spec.hbm_bytes / GiB:.0f} GiB HBM; use more cards, a smaller batch or context")
    if fallbacks:
        notes.append("costed with the memory-bound fallback: " + ", ".join(f"{k} x{v}" for k, v in fallbacks.items()))
    return notes


__all__ = ["LLAMA2_CONFIGS", "LlmEstimate", "MODES", "StepEstimate", "estimate_llm", "llm_config", "shard_config"]


# -- calibration against TorchAir's published Llama2 figures ----------------------------------

_LLM_NOTES = {
    ("llama2-70b", 1, "decode", "graph"): "FITTED: sets hccs_latency_us (the 160 all-reduces per token are latency-bound)",
    ("llama2-70b", "prefill"): "not matched: the estimate is ~1.5x faster; the published figure is the FIRST generate() "
                               "step (Python-side input, mask and position preparation for a 1024 x 4096 mask are in "
                               "it) and uses the matmul + all-reduce MC2 op, neither modelled; per-kernel GEMM rates "
                               "are calibrated separately (GEMM rows)",
    ("llama2-70b", 4, "decode", "eager"): "not matched: 8 deepspeed processes dispatch from one arm host; the published "
                                          "eager step costs ~44 us per kernel, twice the single-process torch.mm dispatch "
                                          "(op_dispatch_us) the model uses",
}


def llm_calibration_table(batches_70b=(1, 4, 8, 16, 32, 48), device: str = "vnpu:ascend910b") -> List[Dict[str, Any]]:
    """Calibration rows (`opencann.devices.vnpu.calibration.calibration_row`) of `estimate_llm` against
    TorchAir's published Llama2 step times (`TORCHAIR_LLAMA2`: [TA-7B] one card batch 4, [TA-70B] 8 cards
    batch 1-48), fp16, prompt 1024, context 4096. Unit ``steps/s`` (1000 / ms), so ratio = published ms /
    estimated ms (> 1: the model is optimistic). ``batches_70b`` limits the 70B batches estimated (each is
    one `estimate_llm` call, a few seconds)."""
    from ..devices.vnpu.calibration import TORCHAIR_LLAMA2, calibration_row
    cache: Dict[tuple, LlmEstimate] = {}
    rows = []
    for pub in TORCHAIR_LLAMA2:
        key = (pub["model"], pub["cards"], pub["batch"])
        if pub["model"] == "llama2-70b" and pub["batch"] not in batches_70b:
            continue
        if key not in cache:
            cache[key] = estimate_llm(pub["model"], device, "float16", prompt=1024, context=4096,
                                      batch=pub["batch"], cards=pub["cards"], eager=True)
        est = cache[key]
        s = {("prefill", "graph"): est.prefill, ("decode", "graph"): est.decode,
             ("prefill", "eager"): est.prefill_eager, ("decode", "eager"): est.decode_eager}[(pub["step"], pub["mode"])]
        note = _LLM_NOTES.get((pub["model"], pub["batch"], pub["step"], pub["mode"]),
                              _LLM_NOTES.get((pub["model"], pub["step"]), ""))
        ratio = pub["ms"] / (s.total_us / 1e3)
        miss = abs(ratio - 1) > 0.25
        rows.append(calibration_row(
            f"{pub['model']} {pub['step']} {pub['mode']} mode, {pub['cards']} card(s), batch {pub['batch']}, fp16",
            "ascend910b", pub["source"], "steps/s", 1e3 / pub["ms"], 1e6 / s.total_us, note=note,
            known_miss=miss, fitted=note.startswith("FITTED")))
    return rows


__all__ += ["llm_calibration_table"]
