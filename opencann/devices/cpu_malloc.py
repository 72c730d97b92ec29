"""glibc malloc giving freed memory back to the OS, and `keep_freed_memory` to stop it.

torch's CPU tensors come from glibc's malloc. glibc serves a request of
``M_MMAP_THRESHOLD`` bytes or more with a mapping of its own, unmapped again on free,
and returns the free top of its heap to the OS beyond ``M_TRIM_THRESHOLD`` (by default
both follow the sizes freed, the mapping threshold up to 32 MiB on 64-bit: mallopt(3),
glibc ``malloc.c``). A block of the size just freed is then faulted in again page by
page, each 4 KiB page zeroed by the kernel. A compiled model's planned intermediates
live in its arena (allocated once), but the values a kernel allocates itself (oneDNN's
convolution outputs: ``mkldnn._convolution_pointwise`` has no ``out=``) are fresh on
every call: zoo ResNet-50 at batch 8 faulted 24-35 K pages (95-140 MiB) per call, at
batch 1 about 100.

`keep_freed_memory` raises both thresholds (``mallopt``) so that freed blocks up to that
size stay in malloc's heap and are reused without faults, at the price of the process
keeping them (its resident memory does not drop after large tensors are freed, as with
an arena). Process-wide, as ``mallopt`` is, and glibc only; opencann never calls it on
its own. Measured (docs/performance.md, "fp32 ResNet-50: where the call goes"):
ResNet-50 batch 8, 2 threads, one process alternating the thresholds, 8 calls each,
load 1.7: 236.8 (222.2) ms median (min) with 128 KiB thresholds, 204.9 (194.1) ms with
1 GiB, faults per call 35 K -> 2 K (again at load 2.5: 460.9 -> 408.5 ms); batch 1:
56.4 -> 55.7 ms. glibc's default thresholds faulted 24-30 K pages per call there.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1   # glibc malloc.h
M_MMAP_THRESHOLD = -3
_INT_MAX = 2 ** 31 - 1  # mallopt takes an int
_MMAP_MAX_ALWAYS = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: accepted by every glibc

_kept = 0        # the thresholds set here so far (bytes; 0: none)
_MALLOPT = None  # glibc's mallopt, False where there is none (None: not looked up yet)


def _mallopt():
    global _MALLOPT
    if _MALLOPT is None:
        _MALLOPT = False
        name = ctypes.util.find_library("c")
        try:
            fn = ctypes.CDLL(name).mallopt if name else None
        except (OSError, AttributeError):
            fn = None
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            _MALLOPT = fn
    return _MALLOPT or None


def kept_bytes() -> int:
    """The size up to which freed blocks are kept (bytes), as `keep_freed_memory` last
    set it in this process; 0 when it has not."""
    return _kept


def keep_freed_memory(nbytes: int = 1 << 30) -> bool:
    """Keep freed blocks of up to ``nbytes`` bytes (default 1 GiB, at most 2**31 - 1) in
    glibc malloc's heap instead of returning them to the OS, so that tensors allocated
    afresh on every call (oneDNN's convolution outputs) reuse memory without page faults
    (module docstring). Sets ``M_MMAP_THRESHOLD`` (32 MiB where glibc refuses more) and
    ``M_TRIM_THRESHOLD`` with ``mallopt``; never lowers what an earlier call set.
    Process-wide; the process's resident memory then stays at its peak.

    Returns True when the thresholds are set (or already were), False where there is no
    glibc ``mallopt`` (another C library) or it refused. Raises ValueError for an
    ``nbytes`` that is not a positive whole number."""
    global _kept
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"keep_freed_memory: nbytes must be a positive whole number of bytes, "
                         f"got {nbytes!r} (e.g. 1 << 30 for 1 GiB)")
    nbytes = min(nbytes, _INT_MAX)
    if nbytes <= _kept:
        return True
    fn = _mallopt()
    if fn is None:
        return False
    mapped = fn(M_MMAP_THRESHOLD, nbytes) == 1 or fn(M_MMAP_THRESHOLD, min(nbytes, _MMAP_MAX_ALWAYS)) == 1
    if not (mapped and fn(M_TRIM_THRESHOLD, nbytes) == 1):
        return False
    _kept = nbytes
    return True


__all__ = ["M_MMAP_THRESHOLD", "M_TRIM_THRESHOLD", "keep_freed_memory", "kept_bytes"]
