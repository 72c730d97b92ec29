"""The one-line check of a kernel function's ``out=`` argument.

Why: opencann's CPU kernels write through a NumPy view of ``out``'s memory (or copy into
it), so an ``out`` of another dtype was written silently cast (an int32 ``out``
truncated, a float64 one widened) or failed deep inside numba, and one of another shape
was filled by broadcasting, where eager's ``out=`` raises. Each public kernel function
that takes ``out`` checks it first (`check_out`).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def check_out(fn: str, out: Optional[torch.Tensor], shape: Optional[Sequence[int]],
              dtype: torch.dtype = torch.float32, numel: Optional[int] = None) -> None:
    """Raise ValueError (one line, naming ``fn``) unless ``out`` is None or a tensor of
    ``dtype`` with ``shape`` (None: any shape) and, where given, ``numel`` elements."""
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"{fn}: out must be a tensor, got {type(out).__name__}")
    if out.dtype != dtype or (shape is not None and tuple(out.shape) != tuple(shape)) \
            or (numel is not None and out.numel() != numel):
        want = (f"{list(shape)}" if shape is not None else
                f"of {numel} elements" if numel is not None else "(any shape)")
        raise ValueError(f"{fn}: out must be {str(dtype).replace('torch.', '')} {want}, got "
                         f"{tuple(out.shape)} {out.dtype}; pass a tensor like the result or none")


__all__ = ["check_out"]
