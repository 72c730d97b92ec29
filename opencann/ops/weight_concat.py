"""Concatenated weights held once: the merged GEMM operands of sibling Linears (Q/K/V,
`opencann.passes.fusion.qkv_linear`; GatedMLP's gate and up, `kernels.cpu.concat_weights`)
made as views of memory that is already laid out as their concatenation, instead of
copies beside the weights.

`concat_view` is ``torch.cat`` without the copy where the parts are adjacent slices of
one storage; `concatenate_in_place` lays a module's sibling weights out that way (one new
storage, each ``param.data`` a view of its block), so that a compile with the option
``share_weights`` finds its concatenations ready and the weights are held once: the
module and every graph read the same bytes (``opencann.llm``'s step graphs; 198 MB of
the 499 MB Llama-125M otherwise held twice, docs/performance.md). llama.cpp's
converters (``convert_hf_to_gguf.py``) and ONNX Runtime GenAI's builder store Q/K/V
fused the same way, as one tensor.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def concat_view(parts: Sequence[torch.Tensor], dim: int = 0) -> Optional[torch.Tensor]:
    """``torch.cat(parts, dim)`` as a contiguous VIEW (no copy, detached) when the parts
    are, in order, adjacent slices along ``dim`` of one contiguous block of one storage
    (same dtype, rank, strides and other sizes; each part starting where the previous
    one ends); None otherwise (also for fewer than two parts, empty, mkldnn or
    non-CPU tensors). ``parts``: tensors [..., n_i, ...] (n_i at ``dim``); returns
    [..., Σn_i, ...]. Never raises for a layout."""
    if len(parts) < 2 or not all(isinstance(p, torch.Tensor) for p in parts):
        return None
    p0 = parts[0]
    if p0.is_mkldnn or p0.device.type != "cpu" or not p0.numel() or not -p0.dim() <= dim < p0.dim():
        return None
    dim %= p0.dim()
    ptr, stride = p0.untyped_storage().data_ptr(), p0.stride()
    others = [s for i, s in enumerate(p0.shape) if i != dim]
    offset = p0.storage_offset()
    for p in parts:
        if (p.is_mkldnn or p.dtype != p0.dtype or p.dim() != p0.dim() or not p.numel()
                or p.device != p0.device or p.untyped_storage().data_ptr() != ptr
                or p.stride() != stride or p.storage_offset() != offset
                or [s for i, s in enumerate(p.shape) if i != dim] != others):
            return None
        offset += p.shape[dim] * stride[dim]
    shape = list(p0.shape)
    shape[dim] = sum(int(p.shape[dim]) for p in parts)
    try:
        view = p0.detach().as_strided(shape, stride, p0.storage_offset())
    except RuntimeError:   # beyond the storage's end
        return None
    return view if view.is_contiguous() else None


def concatenate_in_place(params: Sequence[torch.Tensor], row_major: bool = False) -> torch.Tensor:
    """Lay the module tensors ``params`` (sibling nn.Linear weights [n_i, k], or their
    biases [n_i]; one dtype, CPU) out as ONE concatenation and make each ``p.data`` a
    view of its block: the values and shapes stay, the old memory is freed when nothing
    else holds it. Returns the concatenation, as the GEMM kernels take it:
    ``row_major`` False: [Σn, k] contiguous, each weight rows [o_i, o_i + n_i) (a
    contiguous view); True: [k, Σn] contiguous (2-D weights only), each weight the
    transpose of columns [o_i, o_i + n_i) (a view with strides (1, Σn)); biases: [Σn].
    Nothing is copied when the tensors are laid out so already (`concat_view`). Runs
    under ``torch.no_grad``; the tensors' version counters, ``requires_grad`` and
    identity stay (a compiled model's weight guards see the new data pointers: lay out
    before compiling). Raises ValueError (one line) for fewer than two tensors, mixed
    dtypes or ranks, or a rank other than 1 or 2."""
    if len(params) < 2:
        raise ValueError(f"concatenate_in_place takes two or more sibling weights, got {len(params)}")
    rank, dtype = params[0].dim(), params[0].dtype
    if rank not in (1, 2) or any(p.dim() != rank or p.dtype != dtype for p in params):
        raise ValueError("concatenate_in_place takes sibling Linear weights [n_i, k] or biases [n_i] "
                         f"of one dtype, got {[(str(p.dtype), tuple(p.shape)) for p in params]}")
    row_major = row_major and rank == 2
    cat = (concat_view([p.t() for p in params], 1) if row_major else concat_view(list(params), 0))
    if cat is not None:
        return cat
    with torch.no_grad():
        if row_major:
            cat = torch.cat([p.detach().t() for p in params], dim=1)
            blocks = torch.split(cat, [int(p.shape[0]) for p in params], dim=1)
            views = [b.t() for b in blocks]
        else:
            cat = torch.cat([p.detach() for p in params], dim=0)
            views = torch.split(cat, [int(p.shape[0]) for p in params], dim=0)
        for p, v in zip(params, views):
            p.data = v
    return cat


__all__ = ["concat_view", "concatenate_in_place"]
