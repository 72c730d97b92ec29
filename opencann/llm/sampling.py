"""Token selection for `opencann.llm` generation: greedy (argmax) and multinomial
sampling over logits processed by transformers' own LogitsProcessor classes
(``RepetitionPenaltyLogitsProcessor``, ``MinLengthLogitsProcessor``,
``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``,
``MinPLogitsWarper``) in the order transformers' ``generate`` applies them
(``GenerationMixin._get_logits_processor``), so a run equals transformers' with the same
settings; transformers is the dependency because these rules are its (and users know its
parameter names).

Settings resolve as in transformers' ``generate``: the call's keywords over the model's
``generation_config`` over transformers' global defaults (``top_k`` 50 when sampling); a
keyword given as None sets None (no stop token for ``eos_token_id=None``, no top-k for
``top_k=None``), as transformers' ``GenerationConfig.update`` does, while a keyword not
given (`UNSET`) leaves the generation_config's value. Every GenerationConfig field set
to something other than transformers' default must be one this generator applies
(`APPLIED`) or one that cannot change the tokens of one greedy or sampled sequence per
prompt (`NEUTRAL`); any other is refused in one line (`resolve`), so a field transformers
adds later is refused until it is applied here.
Sampling draws with ``torch.multinomial`` from a ``torch.Generator`` seeded by ``seed``
(reproducible, independent of the global RNG), or from the global RNG when ``seed`` is
None (as transformers does, so ``torch.manual_seed(s)`` before both gives the same draws).
"""
from __future__ import annotations

import copy
import functools
import numbers
from typing import Any, Dict, FrozenSet, Optional, Sequence

import numpy as np
import torch

#: GenerationConfig fields the generator applies (here, or its stop tokens and length)
APPLIED = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
           "eos_token_id", "pad_token_id", "max_new_tokens", "max_length", "min_length",
           "min_new_tokens")
#: GenerationConfig fields that leave the tokens of one greedy or sampled sequence per
#: prompt as they are: special ids used only without input_ids or by encoder-decoders,
#: the cache and compile choices of transformers' own run, what it returns beside the
#: tokens (only with ``return_dict_in_generate``, which is refused), beam-search-only
#: settings (``num_beams`` > 1 is refused), and the version stamp
NEUTRAL = ("bos_token_id", "decoder_start_token_id", "use_cache", "cache_implementation",
           "cache_config", "compile_config", "disable_compile", "output_attentions",
           "output_hidden_states", "output_scores", "output_logits", "early_stopping",
           "length_penalty", "transformers_version")


class _Unset:
    """A `Generator.generate` keyword not given: the generation_config's value applies."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<generation_config's>"


#: the default of `Generator.generate`'s settings: not given (None given sets None)
UNSET = _Unset()


@functools.lru_cache(maxsize=1)
def _fields() -> FrozenSet[str]:
    """The settings transformers' ``GenerationConfig`` knows (its public attributes)."""
    from transformers import GenerationConfig
    return frozenset(k for k in vars(GenerationConfig()) if not k.startswith("_")) | \
        frozenset(_defaults())


def _defaults() -> Dict[str, Any]:
    """transformers' global defaults of the GenerationConfig fields that have one."""
    from transformers import GenerationConfig
    return dict(getattr(GenerationConfig, "_get_default_generation_params", dict)())


def _is_default(value: Any, default: Any) -> bool:
    """Whether a field's ``value`` asks for nothing: None or transformers' ``default``."""
    if value is None:
        return True
    try:
        return default is not None and bool(value == default)
    except (TypeError, ValueError, RuntimeError):   # an array / tensor of several values
        return False


def resolve(model_config: Any, **given: Any):
    """The transformers ``GenerationConfig`` for one ``generate`` call: the ``given``
    keywords (each one passed in the call, None included: None sets None, as transformers'
    ``update``) over ``model_config`` (the model's generation_config, or None) over
    transformers' defaults (``max_length`` left None where neither sets it: the caller
    then takes transformers' default length). Raises ValueError (one line) for a keyword
    that is not a generation setting, or for a field set (in the call or in
    ``model_config``) to other than transformers' default that is neither in `APPLIED`
    nor in `NEUTRAL` (beam search, n-gram blocking, top-h, watermarking, stop strings,
    ...): the generator would not apply it, and its tokens would differ from
    transformers'."""
    from transformers import GenerationConfig
    unknown = sorted(k for k in given if k not in _fields())
    if unknown:
        raise ValueError(f"generate() does not take {', '.join(unknown)}: not a transformers "
                         "generation setting; it takes input_ids, attention_mask, seed, streamer "
                         f"and the settings {', '.join(APPLIED)}")
    gc = copy.deepcopy(model_config) if model_config is not None else GenerationConfig()
    defaults = _defaults()
    for k, v in defaults.items():      # transformers' global defaults fill what is unset
        if k != "max_length" and getattr(gc, k, None) is None:
            setattr(gc, k, v)
    for k, v in given.items():
        setattr(gc, k, v)
    bad = sorted(k for k in _fields() - set(APPLIED) - set(NEUTRAL)
                 if not _is_default(getattr(gc, k, None), defaults.get(k)))
    if bad:
        k = bad[0]
        where = "from the call: drop it" if k in given else \
            f"from the model's generation_config: unset it with gen.generation_config.{k} = None"
        shown = ", ".join(f"{b}={getattr(gc, b)!r:.40}" for b in bad)
        raise ValueError(f"generate() does not apply {shown} ({where}); it applies "
                         f"{', '.join(APPLIED)} (greedy or sampling, one sequence per prompt)")
    return gc


def _real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _integer(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _check_types(gc) -> None:
    """One ValueError line for a setting of the wrong type, whatever the decoding mode."""
    if gc.do_sample is not None and not isinstance(gc.do_sample, (bool, np.bool_)):
        raise ValueError(f"do_sample must be True (sampling) or False (greedy), got "
                         f"{gc.do_sample!r}")
    for k in ("temperature", "top_p", "min_p", "repetition_penalty"):
        v = getattr(gc, k)
        if v is not None and not _real(v):
            raise ValueError(f"{k} must be a number, got {type(v).__name__} {v!r:.40}")
    for k in ("top_k", "min_length", "min_new_tokens"):
        v = getattr(gc, k)
        if v is not None and not (_integer(v) and v >= 0):
            raise ValueError(f"{k} must be an int >= 0 (0: off), got {v!r:.40}")


def _check(gc) -> None:
    _check_types(gc)
    if gc.do_sample:
        if gc.temperature is not None and not gc.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {gc.temperature!r}; use "
                             "do_sample=False for greedy decoding")
        if gc.top_p is not None and not 0 < gc.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {gc.top_p!r}")
        if gc.min_p is not None and not 0 <= gc.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {gc.min_p!r}")
    rp = gc.repetition_penalty
    if rp is not None and not rp > 0:
        raise ValueError(f"repetition_penalty must be a float > 0 (1.0: off), got {rp!r}")


def min_length(gc, prompt_len: int) -> int:
    """The sequence length (prompt as given plus new tokens) before which the stop tokens
    cannot be chosen: ``min_new_tokens`` + ``prompt_len`` when ``min_new_tokens`` is set
    (it overrides ``min_length``, as transformers' ``_prepare_generated_length``), else
    ``min_length`` (0: none)."""
    if gc.min_new_tokens is not None:
        return int(gc.min_new_tokens) + prompt_len
    return int(gc.min_length or 0)


def logits_processors(gc, padding: Optional[torch.Tensor] = None, stops: Sequence[int] = (),
                      prompt_len: int = 0):
    """transformers' ``LogitsProcessorList`` for GenerationConfig ``gc``: repetition
    penalty (ignoring each row's ``padding`` [B] left-pad tokens, as ``generate`` does),
    the stop tokens ``stops`` suppressed before `min_length` (``prompt_len``: the prompts'
    padded length), then, when sampling, temperature, top-k, top-p and min-p warpers.
    Raises ValueError (one line) for a setting of the wrong type or out of range."""
    from transformers import (LogitsProcessorList, MinLengthLogitsProcessor, MinPLogitsWarper,
                              RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                              TopKLogitsWarper, TopPLogitsWarper)
    _check(gc)
    procs = LogitsProcessorList()
    if gc.repetition_penalty is not None and gc.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(float(gc.repetition_penalty),
                                                      prompt_ignore_length=padding))
    least = min_length(gc, prompt_len)
    if least > 0 and len(stops):
        procs.append(MinLengthLogitsProcessor(least, list(stops)))
    if gc.do_sample:
        if gc.temperature is not None and gc.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(float(gc.temperature)))
        if gc.top_k:
            procs.append(TopKLogitsWarper(top_k=int(gc.top_k), min_tokens_to_keep=1))
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
    """Picks each step's next token per row: ``Sampler(gc, padding, seed, stops,
    prompt_len)`` then ``sampler(sequences, logits) -> LongTensor [B]``.

    ``gc``: a resolved GenerationConfig (`resolve`); ``padding`` [B] int64, each row's
    left-pad count in ``sequences`` (for the repetition penalty); ``seed``: an int for a
    private ``torch.Generator`` (reproducible), None for the global RNG; ``stops``: the
    stop token ids and ``prompt_len`` the prompts' padded length (for `min_length`).
    ``sequences`` [B, L] int64 (prompt as given plus generated tokens), ``logits``
    [B, vocab] float32. Raises ValueError (one line) for a bad setting or seed."""

    def __init__(self, gc, padding: Optional[torch.Tensor] = None, seed: Optional[int] = None,
                 stops: Sequence[int] = (), prompt_len: int = 0):
        self.processors = logits_processors(gc, padding, stops, prompt_len)
        self.do_sample = bool(gc.do_sample)
        if seed is not None and not (_integer(seed) and 0 <= int(seed) < 2 ** 64):
            raise ValueError(f"seed must be an int in [0, 2**64) (torch.Generator's range), or None "
                             f"for the global RNG, got {seed!r:.40}")
        self.generator = torch.Generator().manual_seed(int(seed)) if seed is not None else None

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


__all__ = ["APPLIED", "NEUTRAL", "Sampler", "UNSET", "greedy", "logits_processors", "min_length",
           "resolve"]
