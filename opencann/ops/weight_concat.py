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

import ctypes
import mmap
import sys
from typing import Optional, Sequence, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

_MADV_DONTNEED = 4   # <sys/mman.h> on Linux


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


def file_mapping(ptr: int) -> Optional[Tuple[int, int, str, str]]:
    """(start, end, device:inode, path) of this process's PRIVATE file mapping holding
    address ``ptr`` (``/proc/self/maps``: a safetensors file mmapped by transformers'
    ``from_pretrained``), or None (anonymous memory, a shared mapping, not Linux). Never
    raises."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= ptr < hi:
                    path = parts[5].strip() if len(parts) > 5 else ""
                    if parts[1].endswith("p") and parts[4] != "0" and path.startswith("/"):
                        return lo, hi, f"{parts[3]}:{parts[4]}", path
                    return None
    except (OSError, ValueError, IndexError):
        pass
    return None


def drop_file_pages(ptr: int, nbytes: int, mapping: Tuple[int, int, str, str]) -> int:
    """Give back the resident pages of ``nbytes`` at ``ptr`` in the private file mapping
    ``mapping`` (`file_mapping`'s, recorded while the memory was in use; checked again
    here), now that no tensor views them: ``madvise(MADV_DONTNEED)`` on the whole pages
    inside the range (the pages it shares with neighbouring tensors stay). A mapped file
    keeps its pages resident while the mapping lives, which is as long as any tensor of
    the file does, so freeing one tensor of an mmapped checkpoint frees none of its RSS.
    Returns the bytes given back (0: not that mapping any more, or less than a page).
    Source: madvise(2) ("subsequent accesses of pages in the range will ... repopulate
    the memory contents from the up-to-date contents of the underlying mapped file" for
    private file mappings). Never raises."""
    if file_mapping(ptr) != mapping:
        return 0
    page = mmap.PAGESIZE
    start, end = -(-ptr // page) * page, (ptr + nbytes) // page * page
    start, end = max(start, mapping[0]), min(end, mapping[1])
    if end <= start:
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED) == 0
    except (OSError, AttributeError):
        return 0
    return end - start if ok else 0


def concatenate_in_place(params: Sequence[torch.Tensor], row_major: bool = False) -> torch.Tensor:
    """Lay the module tensors ``params`` (sibling nn.Linear weights [n_i, k], or their
    biases [n_i]; one dtype, CPU) out as ONE concatenation and make each ``p.data`` a
    view of its block: the values and shapes stay, the old memory is freed when nothing
    else holds it. Returns the concatenation, as the GEMM kernels take it:
    ``row_major`` False: [Σn, k] contiguous, each weight rows [o_i, o_i + n_i) (a
    contiguous view); True: [k, Σn] contiguous (2-D weights only), each weight the
    transpose of columns [o_i, o_i + n_i) (a view with strides (1, Σn)); biases: [Σn].
    Nothing is copied when the tensors are laid out so already (`concat_view`). Old
    memory in a private file mapping (an mmapped safetensors checkpoint) that no tensor
    holds any more is given back too (`drop_file_pages`: freeing a tensor alone leaves
    the file's pages resident). Runs
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
    olds = {}
    for p in params:   # weak references: the old memory must be free to be given back
        st = p.untyped_storage()
        olds.setdefault(st.data_ptr(), (StorageWeakRef(st), st.nbytes(), file_mapping(st.data_ptr())))
    del st
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
    del views
    for ptr, (ref, nbytes, mapping) in olds.items():
        if mapping is not None and ref.expired():
            drop_file_pages(ptr, nbytes, mapping)
    return cat


__all__ = ["concat_view", "concatenate_in_place", "drop_file_pages", "file_mapping"]
