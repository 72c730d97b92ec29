"""The pieces ``opencann generate``, the demo's chat turn and the tests share: a prompt
turned into token ids (optionally through the tokenizer's chat template), a generator
streamer that prints text as tokens arrive, and eager transformers ``generate`` timed the
way `opencann.llm`'s ``Generator.stats`` times the compiled one.

Streaming text uses transformers' ``TextStreamer`` (incremental decoding that holds back a
partial word or an incomplete UTF-8 sequence until it is complete), so no detokenization
is written here. Eager timing uses transformers' ``BaseStreamer`` hook, which ``generate``
calls once with the prompt and then once per new token.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch


def encode_prompt(tokenizer, text: str, chat: bool = False) -> torch.Tensor:
    """Token ids int64 [1, S] of ``text``; with ``chat`` the text is one user message put
    through the tokenizer's chat template with the assistant's turn opened
    (``add_generation_prompt``). Without ``chat`` the tokenizer's own special tokens (a BOS)
    are added as it does by default.

    Raises ValueError (one line) for an empty prompt, ``chat`` with a tokenizer that has no
    chat template, or a text that encodes to no token."""
    if not text.strip():
        raise ValueError("the prompt is empty: give some text with --prompt")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: drop --chat and "
                             "give the whole prompt text")
        enc = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
    else:
        enc = tokenizer(text, return_tensors="pt")
    ids = enc["input_ids"].to(torch.int64)
    if ids.shape[-1] == 0:
        raise ValueError(f"the prompt {text!r} encodes to no token: give other text")
    return ids


def eos_ids(model, tokenizer) -> List[int]:
    """The stop tokens: the model's generation config ``eos_token_id`` (an int or a list),
    else the tokenizer's ``eos_token_id``; [] when neither has one. ``model``: a
    transformers model or an ``opencann.llm`` Generator. Ids outside the model's
    vocabulary are dropped (the model can never generate them), as ``opencann.llm``
    drops such a stop token of the generation_config: a small-vocabulary model whose
    config keeps another model's eos (GPT-2's 50256) generates to its length."""
    cfg = getattr(model, "generation_config", None)
    eos = getattr(cfg, "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    ids = [int(e) for e in (eos if isinstance(eos, (list, tuple, set)) else [eos])]
    vocab = _vocab_size(model)
    return [e for e in ids if vocab is None or 0 <= e < vocab]


def _vocab_size(model) -> Optional[int]:
    """Ids ``model`` can generate: a Generator's ``arch.vocab_size``, a transformers
    model's output embedding rows (its ``config.vocab_size`` without one), else None."""
    arch = getattr(model, "arch", None)
    if arch is not None:
        return int(arch.vocab_size)
    out = getattr(model, "get_output_embeddings", lambda: None)()
    if out is not None and getattr(out, "weight", None) is not None:
        return int(out.weight.shape[0])
    return getattr(getattr(model, "config", None), "vocab_size", None)


def text_streamer(tokenizer):
    """A streamer for ``Generator.generate`` (and transformers' ``generate``): transformers'
    ``TextStreamer``, which skips the prompt the generator puts first, then prints on stdout
    the text each step's new tokens int64 [1] complete (special tokens skipped); the
    generator's closing ``end()`` prints the rest and a newline.

    Raises ValueError (from ``TextStreamer.put``) for a batch of more than one sequence."""
    from transformers import TextStreamer
    return TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


@dataclass
class EagerRun:
    """Eager transformers ``generate``: ``tokens`` int64 [B, S+new], ``prompt_len`` S,
    ``ttft_s`` (seconds from the call to the first new token), ``decode_tokens_per_s`` (steps
    after the first per second of the steps that made them: tokens/s of one sequence; the
    batch makes B times as many) and ``total_s`` (seconds, the whole call)."""
    tokens: torch.Tensor
    prompt_len: int
    ttft_s: float
    decode_tokens_per_s: float
    total_s: float

    @property
    def new_tokens(self) -> torch.Tensor:
        """The generated tokens int64 [B, new] (the prompt cut off)."""
        return self.tokens[:, self.prompt_len:]


def _step_clock():
    """A transformers ``BaseStreamer`` that records when each step's tokens arrive (the
    first ``put`` is the prompt, and is not a step)."""
    from transformers.generation.streamers import BaseStreamer

    class StepClock(BaseStreamer):
        def __init__(self):
            self.times: List[float] = []
            self.prompt_seen = False

        def put(self, value):
            if self.prompt_seen:
                self.times.append(time.perf_counter())
            self.prompt_seen = True

        def end(self):
            pass
    return StepClock()


def eager_generate(model, input_ids: torch.Tensor, max_new_tokens: int,
                   attention_mask: Optional[torch.Tensor] = None, **kwargs) -> EagerRun:
    """Run ``model.generate`` (eager transformers; its default dynamic KV cache unless
    ``cache_implementation`` says otherwise) on ``input_ids`` int64 [B, S] for up to
    ``max_new_tokens`` and time it (wall clock, ``time.perf_counter``, step times from a
    streamer). ``kwargs`` go to ``generate`` (``do_sample``, ``eos_token_id`` ...); greedy
    by default. Raises what ``generate`` raises."""
    clock = _step_clock()
    kwargs.setdefault("do_sample", False)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(input_ids, attention_mask=attention_mask,
                             max_new_tokens=max_new_tokens, streamer=clock, **kwargs)
        t1 = time.perf_counter()
    ts = clock.times
    ttft = (ts[0] - t0) if ts else t1 - t0
    rate = (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 and ts[-1] > ts[0] else float("nan")
    return EagerRun(out, input_ids.shape[-1], ttft, rate, t1 - t0)
