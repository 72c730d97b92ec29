"""Prompts for `Generator.generate`: a batch given as a LongTensor (with an optional
left-padding ``attention_mask``, as transformers' ``generate`` takes it) or as a list of
prompts of different lengths, checked and brought to one form (`PromptBatch`). Every
bad input is one ValueError line naming the problem and the fix; nothing here touches
the generator's state, so a refused call leaves it usable."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import numpy as np
import torch


def _is_id(x) -> bool:
    """Whether ``x`` is one token id as transformers' ``generate`` (through
    ``torch.tensor``) takes it: a Python or NumPy integer, or a 0-d integer tensor."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and not x.dtype.is_floating_point and not x.dtype.is_complex \
            and x.dtype != torch.bool
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


@dataclass
class PromptBatch:
    """A checked batch: ``sequences`` [B, L] int64 (the prompts as given, left-padded
    with ``pad_token_id``: what ``generate`` returns them as), ``lengths`` [B] int64
    (real tokens per row), ``padding`` [B] int64 (left-pad tokens per row, L - lengths),
    ``rows`` (each row's real tokens, [lengths[b]] int64)."""

    sequences: torch.Tensor
    lengths: torch.Tensor
    padding: torch.Tensor
    rows: List[torch.Tensor]

    @property
    def batch(self) -> int:
        """Rows in the batch (B)."""
        return self.sequences.shape[0]


def _with_data(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` on the host; ValueError (one line) for a tensor without data (the meta
    device: shapes only, nothing to read the ids from)."""
    if t.device.type == "meta":
        raise ValueError(f"{what} is on the meta device (a shape without data): pass the "
                         f"token ids in a cpu tensor or a list")
    return t.cpu()


def _from_list(prompts: Sequence, pad_token_id: int) -> "tuple[torch.Tensor, torch.Tensor]":
    rows = []
    for i, p in enumerate(prompts):
        try:
            if isinstance(p, (list, tuple)) and all(_is_id(x) for x in p):
                p = torch.tensor([int(x) for x in p], dtype=torch.long)
            t = torch.as_tensor(p)
        except (OverflowError, RuntimeError, TypeError, ValueError):
            big = [int(x) for x in p if _is_id(x) and not -2 ** 63 <= int(x) < 2 ** 63] \
                if isinstance(p, (list, tuple)) else []
            raise ValueError(f"prompt {i} must be a list or 1-D tensor of token ids" +
                             (f"; id {big[0]} is outside int64 (and the vocabulary)" if big
                              else f", got {type(p).__name__}")) from None
        if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"prompt {i} must be a 1-D list or tensor of token ids, got "
                             f"{tuple(t.shape)} {t.dtype}")
        rows.append(_with_data(t, f"prompt {i}").long())
    L = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), L), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, L - len(r):], mask[i, L - len(r):] = r, 1
    return ids, mask


def _check_mask(mask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"attention_mask must be a tensor of input_ids' shape {tuple(ids.shape)}, "
                         f"got {got}")
    if mask.dtype != torch.bool and ((mask != 0) & (mask != 1)).any():   # before any cast:
        bad = mask[(mask != 0) & (mask != 1)][0].item()                  # 0.5 is no 0
        raise ValueError(f"attention_mask must hold 0 (padding) and 1 (prompt token) only, "
                         f"got {bad!r}")
    m = mask.to(torch.long)
    if (m[:, 1:] < m[:, :-1]).any():
        raise ValueError("attention_mask must be left padding (zeros before each prompt, ones "
                         "after): pad on the left (tokenizer.padding_side = 'left') or pass a "
                         "list of prompts")
    return m


def mask_pad_id(pad_token_id: Any, eos_token_id: Any) -> Optional[int]:
    """The id transformers' ``generate`` infers an attention mask from when a call gives
    none (``GenerationMixin._prepare_special_tokens`` and
    ``_prepare_attention_mask_for_generation``): ``pad_token_id`` when it is set and is
    not one of ``eos_token_id`` (an id, a list or a tensor of ids); None otherwise (an
    unset pad becomes the first stop id there, which then infers nothing)."""
    if isinstance(pad_token_id, torch.Tensor) and pad_token_id.numel() == 1:
        pad_token_id = pad_token_id.reshape(()).item()
    if not _is_id(pad_token_id):
        return None
    eos = eos_token_id.tolist() if isinstance(eos_token_id, (torch.Tensor, np.ndarray)) else eos_token_id
    eos = [] if eos is None else list(eos) if isinstance(eos, (list, tuple, set)) else [eos]
    return None if int(pad_token_id) in [int(e) for e in eos if _is_id(e)] else int(pad_token_id)


def _inferred_mask(ids: torch.Tensor, pad: Optional[int]) -> Optional[torch.Tensor]:
    """The attention mask transformers' ``generate`` infers for ``ids`` [B, L] given
    without one: ``ids != pad`` where ``pad`` (`mask_pad_id`) occurs in them, else None
    (every id a prompt token). Raises ValueError (one line) where that mask leaves a row
    no token, or is not left padding (a pad id after a prompt token: right padding, or
    the pad id used as a token), which the generator does not run (transformers runs
    it, positions and all, as no unpadded prompt would)."""
    if pad is None or not bool((ids == pad).any()):
        return None
    m = (ids != pad).long()
    rows = (m.sum(1) == 0).nonzero()
    if rows.numel():
        raise ValueError(f"input_ids row {int(rows[0, 0])} holds only pad_token_id {pad}, and no "
                         f"attention_mask was given: transformers' generate then masks every "
                         f"pad_token_id out, which leaves the row no prompt; pass attention_mask "
                         f"(1 for every real token, pad_token_id ones included) or a list of prompts")
    rows = (m[:, 1:] < m[:, :-1]).any(1).nonzero()
    if rows.numel():
        raise ValueError(f"input_ids row {int(rows[0, 0])} holds pad_token_id {pad} after a prompt "
                         f"token, and no attention_mask was given: transformers' generate then "
                         f"masks every pad_token_id out, which opencann.llm runs for left padding "
                         f"only; pad on the left, pass attention_mask (1 for every real token, "
                         f"pad_token_id ones included) or pass a list of prompts")
    return m


def prepare(input_ids, attention_mask: Optional[torch.Tensor], *, vocab_size: int,
            max_batch: int, pad_token_id: int, mask_pad: Optional[int] = None) -> PromptBatch:
    """Check and normalise a call's prompts. ``input_ids``: LongTensor [B, L] or [L] (one
    prompt), a flat list of ids (one prompt; Python or NumPy integers or 0-d integer
    tensors), or a list of prompts (lists or 1-D tensors of ids, lengths may differ:
    left-padded with ``pad_token_id`` here); ``attention_mask`` [B, L] of 0/1 (any
    dtype; each value checked before it is cast) with the zeros on the left (None: no
    padding; for a tensor of ids holding ``mask_pad``, `mask_pad_id`, the mask
    transformers infers from it, `_inferred_mask`). Raises ValueError (one line) for a
    float/bool or >2-D tensor, a tensor without data (meta device), an empty batch or
    prompt, more than ``max_batch`` rows, an id outside [0, ``vocab_size``), a mask of another
    shape, with a value other than 0 and 1, or not left padding."""
    mask_pad = mask_pad if isinstance(input_ids, torch.Tensor) else None   # a list: its own lengths
    if isinstance(input_ids, (list, tuple)) and input_ids and all(_is_id(x) for x in input_ids):
        input_ids = [input_ids]   # one prompt's ids, as a tokenizer returns for one text
    if isinstance(input_ids, (list, tuple)):
        if attention_mask is not None:
            raise ValueError("attention_mask is built from a list of prompts; pass either a list "
                             "of prompts or a padded tensor with its attention_mask")
        input_ids, attention_mask = _from_list(input_ids, pad_token_id)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype.is_floating_point \
            or input_ids.dtype == torch.bool or input_ids.dim() not in (1, 2):
        what = (f"{tuple(input_ids.shape)} {input_ids.dtype}" if isinstance(input_ids, torch.Tensor)
                else type(input_ids).__name__)
        raise ValueError(f"input_ids must be a LongTensor [batch, tokens] (or a list of prompts), "
                         f"got {what}")
    ids = _with_data(input_ids, "input_ids").long()
    ids = ids[None] if ids.dim() == 1 else ids
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        try:   # a nested list of 0/1, as transformers' tokenizers return without tensors
            attention_mask = torch.as_tensor(attention_mask)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"attention_mask must be a tensor or nested list of 0/1 shaped as "
                             f"input_ids, got {type(attention_mask).__name__}") from None
    if attention_mask is not None and attention_mask.dim() == 1 and input_ids.dim() == 1:
        attention_mask = attention_mask[None]   # one prompt [L] with its mask [L]
    if attention_mask is None:
        attention_mask = _inferred_mask(ids, mask_pad)
    mask = torch.ones_like(ids) if attention_mask is None else \
        _check_mask(_with_data(attention_mask, "attention_mask"), ids)
    lengths = mask.sum(1)
    if ids.shape[0] == 0 or (lengths == 0).any():
        raise ValueError("empty prompt: every row needs at least one token (a BOS token for an "
                         "unconditional start)")
    if ids.shape[0] > max_batch:
        raise ValueError(f"batch of {ids.shape[0]} prompts exceeds max_batch {max_batch}; compile "
                         f"with opencann.llm.compile(..., max_batch={ids.shape[0]}) or split the batch")
    live = ids[mask.bool()]
    if live.numel() and (live.min() < 0 or live.max() >= vocab_size):
        bad = live[(live < 0) | (live >= vocab_size)][0].item()
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    padding = ids.shape[1] - lengths
    rows = [ids[b, padding[b]:] for b in range(ids.shape[0])]
    return PromptBatch(ids, lengths, padding, rows)


__all__ = ["PromptBatch", "mask_pad_id", "prepare"]
