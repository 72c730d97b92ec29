"""Bytes that stand for a weight's values in the keys of caches shared between graphs.

Caches of things made from a weight's memory (the GEMM kernels' packed copies,
`opencann.ops.kernels.cpu`; merged Q/K/V weights, `opencann.passes.fusion.qkv_linear`)
are shared by every constant viewing the same memory at the same version counter. A
write through ``.data`` (``p.data.mul_(2)``, ``p.data.copy_(t)``) or a NumPy view leaves
the version counter alone (``.data`` has its own), so the key also holds `probe_bytes`:
the same rule as the compiled models' weight guards (`opencann.runtime.weight_watch`,
whose per-call probes this mirrors; the ops layer cannot import the runtime): a whole
tensor of at most `SMALL_BYTES`, else its first and last `SAMPLE` elements in memory. A
write of a whole large tensor is seen; one that leaves all those elements alone is not
(write under ``torch.no_grad()`` without ``.data``: torch records it in the version)."""
from __future__ import annotations

import torch

SMALL_BYTES = 16 * 1024
"""Tensors up to this many bytes are probed whole."""
SAMPLE = 32
"""Elements probed at each end of a larger tensor (in memory order)."""


def probe_bytes(t: torch.Tensor) -> bytes:
    """The probe of ``t`` (any shape, any dtype, CPU, strided): its bytes when it holds at
    most `SMALL_BYTES`, else those of its first and last `SAMPLE` elements in memory order
    (a transposed view is read in its storage's order: no copy of the tensor). Never
    raises for a dense or gapped view; b"" for an empty tensor."""
    n = t.numel()
    if n == 0:
        return b""
    t = t.detach()
    if not t.is_contiguous():
        perm = sorted(range(t.dim()), key=lambda i: -t.stride(i))
        p = t.permute(perm)
        t = p if p.is_contiguous() else t.contiguous()
    flat = t.reshape(-1)
    if n * t.element_size() > SMALL_BYTES and n > 2 * SAMPLE:
        flat = torch.cat([flat[:SAMPLE], flat[-SAMPLE:]])
    return flat.contiguous().view(torch.uint8).numpy().tobytes()
