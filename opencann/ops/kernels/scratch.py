"""A thread's scratch buffer for the temporaries a kernel makes and drops within one call.

A kernel whose result is its planned output but which needs a temporary on the way
(GatedMLP's [M, 2N] product before SiLU and the gate, the explicit attention's score
block) would otherwise allocate it on every call. Large fresh blocks come from glibc
malloc as new mappings, unmapped again on free, so each call faults every page back in
(4 KiB at a time, zeroed by the kernel; see `opencann.devices.cpu_malloc`): a 512-token
Llama-125M prefill's twelve GatedMLPs each allocated 12 MiB per call, 2-3 ms of faults
per layer. `thread_scratch` keeps one buffer per thread and dtype, grown to the largest
request up to `KEEP_MAX_BYTES` (a larger request, e.g. an 8192-token prefill's 128 MiB
GatedMLP product, gets a fresh tensor that is not kept: its faults are small beside its
compute, and a thread does not hold that much for its life): a temporary must not outlive
the kernel call that took it (the next kernel on the thread reuses the memory), and
concurrent calls in other threads never share it.
"""
from __future__ import annotations

import threading

import torch

_LOCAL = threading.local()
KEEP_MAX_BYTES = 64 << 20   # the most scratch one thread keeps per dtype


def thread_scratch(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A 1-D tensor of ``n`` elements of ``dtype``: this thread's scratch (contents
    undefined), valid until this thread's next `thread_scratch` call (a fresh tensor
    above `KEEP_MAX_BYTES`)."""
    bufs = getattr(_LOCAL, "bufs", None)
    if bufs is None:
        bufs = _LOCAL.bufs = {}
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < n:
        buf = torch.empty(n, dtype=dtype)
        if n * buf.element_size() > KEEP_MAX_BYTES:
            return buf          # served fresh, not kept
        bufs[dtype] = buf
    return buf[:n]


__all__ = ["thread_scratch"]
