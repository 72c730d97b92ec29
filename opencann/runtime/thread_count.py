"""Intra-op thread counts set for the calling thread only, never the process default.

What ``torch.set_num_threads(n)`` sets (ATen ``ParallelOpenMP.cpp``, torch 2.x): ATen's
process-wide ``num_threads``; the calling thread's OpenMP ``nthreads-var`` ICV
(``omp_set_num_threads``; a per-thread ICV, OpenMP 4.5 §2.3.3); MKL's thread-local
count (``mkl_set_num_threads_local``); and it clears the calling thread's ideep conv
cache. ``at::init_num_threads``, which ATen runs lazily on a thread's first parallel
region (``lazy_init_num_threads``, once per thread), copies the process-wide
``num_threads`` into that thread's ICV. So a runtime calling ``torch.set_num_threads``
around its own work hands its count, for that window, to every thread that starts its
first parallel region then, for good: a caller thread initialised during another call's
stream 0 kept 1 intra-op thread (and "restored" 1 afterwards).

`set_this_thread` sets only the calling thread's count: ATen's lazy init first (so a
later init cannot overwrite it), then ``omp_set_num_threads`` and
MKL's ``MKL_Set_Num_Threads_Local`` (its C entry point, int by value; the lower-case
``mkl_set_num_threads_local`` symbol is the Fortran one, taking a pointer) called through
ctypes in the OpenMP runtime and MKL that torch itself calls (`torch_openmp_library`: not
another package's copy, e.g. scikit-learn's libgomp). ``torch.get_num_threads()`` on the thread
reads the new count (it returns ``omp_get_max_threads()``). ctypes (standard library)
because torch exposes no per-thread setter. Where no OpenMP runtime is found (not Linux,
or ATen's native thread pool, whose count is process-wide anyway) `available` is False
and the setters change nothing: streams then run with the caller's count. Not done:
ideep's conv computation cache is not cleared (its symbol is not exported); its cached
primitives keep the thread count they were made with (a speed matter, not values').
"""
from __future__ import annotations

import ctypes
from typing import Optional, Tuple

import torch

from ..devices.cpu_threads import loaded_library, torch_openmp_library



def _torch_openmp() -> Optional[ctypes.CDLL]:
    """The OpenMP runtime torch's kernels run on (`torch_openmp_library`: not another
    package's copy, whose counts torch never reads), opened with ctypes; None where
    torch runs no OpenMP or it exports no ``omp_set_num_threads``."""
    path = torch_openmp_library() if "OpenMP" in torch.__config__.parallel_info() else None
    try:
        lib = ctypes.CDLL(path) if path else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "omp_set_num_threads") else None


torch.get_num_threads()  # ATen (and its OpenMP runtime) loaded and initialised here
_OMP = _torch_openmp()
_MKL = loaded_library(("libtorch_cpu", "libmkl"), "MKL_Set_Num_Threads_Local") if _OMP else None
available = _OMP is not None
if _MKL is not None:
    _MKL.MKL_Set_Num_Threads_Local.restype = ctypes.c_int
    _MKL.MKL_Set_Num_Threads_Local.argtypes = [ctypes.c_int]
if _OMP is not None:
    _OMP.omp_set_num_threads.argtypes = [ctypes.c_int]

Saved = Optional[Tuple[int, int]]  # (OpenMP count, MKL local count) before; None: unchanged


def set_this_thread(n: int) -> Saved:
    """Set the calling thread's intra-op thread count to ``n`` (>= 1) and nothing else
    (ATen's process default, other threads and threads made later keep theirs); returns
    what `restore_this_thread` needs to put this thread's count back: None (nothing to
    restore) where `available` is False or the count is ``n`` already. Raises
    ValueError for ``n < 1``."""
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    before = torch.get_num_threads()  # ATen's per-thread lazy init happens here, first
    if _OMP is None or n == before:
        return None
    _OMP.omp_set_num_threads(n)
    mkl_before = _MKL.MKL_Set_Num_Threads_Local(n) if _MKL is not None else 0
    return before, mkl_before


def restore_this_thread(saved: Saved) -> None:
    """Put back the calling thread's count as `set_this_thread` found it (its OpenMP
    count and MKL's thread-local count, 0 meaning MKL's global setting)."""
    if saved is None or _OMP is None:
        return
    before, mkl_before = saved
    _OMP.omp_set_num_threads(before)
    if _MKL is not None:
        _MKL.MKL_Set_Num_Threads_Local(mkl_before)
