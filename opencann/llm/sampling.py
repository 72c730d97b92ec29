"""Token selection for `opencann.llm` generation: greedy (argmax) and multinomial
sampling over logits processed by transformers' own LogitsProcessor classes
(``RepetitionPenaltyLogitsProcessor``, ``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``, ``MinPLogitsWarper``) in the order transformers' ``generate``
applies them (``GenerationMixin._get_logits_processor``), so a run equals transformers'
with the same settings; transformers is the dependency because these rules are its
(and users know its parameter names).

Settings resolve as in transformers' ``generate``: the call's keywords over the model's
``generation_config`` over transformers' global defaults (``top_k`` 50 when sampling).
Sampling draws with ``torch.multinomial`` from a ``torch.Generator`` seeded by ``seed``
(reproducible, independent of the global RNG), or from the global RNG when ``seed`` is
None (as transformers does, so ``torch.manual_seed(s)`` before both gives the same draws).
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Optional

import numpy as np
import torch

#: GenerationConfig fields a `Sampler` applies; other set fields are refused (`resolve`)
APPLIED = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
           "eos_token_id", "pad_token_id", "max_new_tokens", "max_length")
#: fields whose non-default value asks for something this generator does not do
_REFUSED = {"num_beams": 1, "num_return_sequences": 1, "no_repeat_ngram_size": 0,
            "bad_words_ids": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
            "penalty_alpha": None, "suppress_tokens": None, "begin_suppress_tokens": None,
            "sequence_bias": None, "guidance_scale": None, "min_new_tokens": None,
            "forced_bos_token_id": None, "forced_eos_token_id": None}


def resolve(model_config: Any, **given: Any):
    """The transformers ``GenerationConfig`` for one ``generate`` call: ``given``
    keywords (None: not given) over ``model_config`` (the model's generation_config, or
    None) over transformers' defaults. Raises ValueError (one line) for a keyword or a
    model setting this generator does not apply (beam search, n-gram blocking, ...)."""
    from transformers import GenerationConfig
    gc = copy.deepcopy(model_config) if model_config is not None else GenerationConfig()
    defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()
    for k, v in defaults.items():      # transformers' global defaults fill what is unset
        if getattr(gc, k, None) is None:
            setattr(gc, k, v)
    for k, v in given.items():
        if v is not None:
            setattr(gc, k, v)
    bad = [f"{k}={getattr(gc, k, d)!r}" for k, d in _REFUSED.items()
           if getattr(gc, k, d) not in (d, None)]
    if bad:
        raise ValueError(f"opencann.llm generation does not apply {', '.join(bad)} (from the call "
                         "or the model's generation_config); it applies "
                         f"{', '.join(APPLIED)}: unset those settings")
    return gc


def _check(gc) -> None:
    if gc.do_sample:
        if gc.temperature is not None and not gc.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {gc.temperature!r}; use "
                             "do_sample=False for greedy decoding")
        if gc.top_p is not None and not 0 < gc.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {gc.top_p!r}")
        if gc.top_k is not None and (not isinstance(gc.top_k, int) or gc.top_k < 0):
            raise ValueError(f"top_k must be an int >= 0 (0: off), got {gc.top_k!r}")
    rp = gc.repetition_penalty
    if rp is not None and not (isinstance(rp, (int, float)) and rp > 0):
        raise ValueError(f"repetition_penalty must be a float > 0 (1.0: off), got {rp!r}")


def logits_processors(gc, padding: Optional[torch.Tensor] = None):
    """transformers' ``LogitsProcessorList`` for GenerationConfig ``gc``: repetition
    penalty (ignoring each row's ``padding`` [B] left-pad tokens, as ``generate`` does),
    then, when sampling, temperature, top-k, top-p and min-p warpers. Raises ValueError
    (one line) for an out-of-range setting."""
    from transformers import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                              TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    _check(gc)
    procs = LogitsProcessorList()
    if gc.repetition_penalty is not None and gc.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(float(gc.repetition_penalty),
                                                      prompt_ignore_length=padding))
    if gc.do_sample:
        if gc.temperature is not None and gc.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(float(gc.temperature)))
        if gc.top_k:
            procs.append(TopKLogitsWarper(top_k=gc.top_k, min_tokens_to_keep=1))
        if gc.top_p is not None and gc.top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p=float(gc.top_p), min_tokens_to_keep=1))
        if gc.min_p is not None:
            procs.append(MinPLogitsWarper(min_p=float(gc.min_p), min_tokens_to_keep=1))
    return procs


def greedy(scores: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(scores, dim=-1)`` for ``scores`` [B, vocab]: LongTensor [B], the first
    index of each row's largest value (the first NaN where a row holds one, as torch).
    A contiguous float32 CPU tensor goes through NumPy's argmax: torch's reduces a
    [B, 32000] row on its intra-op thread team, which costs more than the arithmetic
    (measured, 2 threads: 64 against 2 µs at B=1, 1.3 ms against 17 µs at B=8 on a
    loaded host), once per generated token."""
    if scores.dtype == torch.float32 and scores.device.type == "cpu" and scores.dim() == 2 \
            and scores.is_contiguous() and not scores.requires_grad and scores.shape[1]:
        return torch.from_numpy(scores.numpy().argmax(axis=-1).astype(np.int64, copy=False))
    return torch.argmax(scores, dim=-1)


class Sampler:
    """Picks each step's next token per row: ``Sampler(gc, padding, seed)`` then
    ``sampler(sequences, logits) -> LongTensor [B]``.

    ``gc``: a resolved GenerationConfig (`resolve`); ``padding`` [B] int64, each row's
    left-pad count in ``sequences`` (for the repetition penalty); ``seed``: an int for a
    private ``torch.Generator`` (reproducible), None for the global RNG. ``sequences``
    [B, L] int64 (prompt as given plus generated tokens), ``logits`` [B, vocab] float32."""

    def __init__(self, gc, padding: Optional[torch.Tensor] = None, seed: Optional[int] = None):
        self.processors = logits_processors(gc, padding)
        self.do_sample = bool(gc.do_sample)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int (or None for the global RNG), got {seed!r}")
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None

    def __call__(self, sequences: Optional[torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
        """Next token ids [B] (int64) from ``logits`` [B, vocab] after the processors
        (``sequences`` may be None when there are none: ``not self.processors``)."""
        scores = self.processors(sequences, logits) if self.processors else logits
        if not self.do_sample:
            return greedy(scores)
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)

    def describe(self) -> Dict[str, Any]:
        """The processors applied, by class name, and whether it samples."""
        return {"do_sample": self.do_sample,
                "processors": [type(p).__name__ for p in self.processors]}


__all__ = ["APPLIED", "Sampler", "greedy", "logits_processors", "resolve"]
