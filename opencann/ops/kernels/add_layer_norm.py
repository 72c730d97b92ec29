"""CPU kernel of AddLayerNorm (ONNX Runtime's SkipLayerNormalization): y = LayerNorm(a + b)
over the last axis, with γ and β, in one pass over the rows instead of ATen's two
kernels (``add`` writing the sum, ``native_layer_norm`` reading it back).

Why numba: one row's sum, mean, variance and output in one compiled loop, rows split
over the cores with ``prange`` (`add_layer_norm_numba.add_ln`, whose row code
AddLayerNormQuant's kernel shares; the same tool and fast-math flags as
``ops/flash_attention/cpu.py``: ``reassoc, contract`` only, so reductions vectorize and
NaN/Inf keep IEEE semantics). Measured on the 2-core AVX2 machine ([128, 768], fp32,
minimum of 50 calls, interleaved): ATen add + native_layer_norm 44 µs, this kernel
35 µs; at [1024, 768] 248 µs and 242 µs (docs/performance.md). The sum is kept in a
row-sized scratch array, never written to memory of the graph.

Numerics: the mean and the biased variance in two passes over the row (the sums in
float64; ATen: one Welford pass in float32), within 2e-7 relative of eager. Special
values: where they part (a row holding NaN or ±inf, a + b overflowing, |x| near 1e19
where ATen's float32 sum of squares overflows and it returns β while float64 does not),
the kernel's per-row mean and rstd leave the range `ops.parity.norm_range.
layer_norm_in_range` allows (tested in the row loop with `layer_norm_limits`), and the
call runs eager's ATen ``add`` + ``layer_norm`` instead: eager's NaN, inf and β exactly. Likewise for a γ or β holding inf, NaN or huge
values (`affine_in_range`).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from ..parity.norm_range import affine_in_range, layer_norm_limits
from ...ir import Node, TensorDesc

_KERNEL = None


def _compiled():
    """The numba kernel (`add_layer_norm_numba.add_ln`, shared with AddLayerNormQuant's),
    compiled (or loaded from numba's cache) on first use."""
    global _KERNEL
    if _KERNEL is None:
        from .add_layer_norm_numba import add_ln   # imports numba: only at a first bind
        _KERNEL = add_ln
    return _KERNEL


def _guard(work: int = 0):
    """A lock when numba's threading layer is ``workqueue`` (not thread-safe), else a
    no-op context; the launch of ``work`` elements gets `numba_cache.launch_threads`
    threads."""
    from .numba_cache import launch   # imports numba: only at a launch
    return launch(work)   # one process-wide lock for every opencann numba kernel


def make_add_layer_norm_kernel(node: Node, in_descs: Sequence[TensorDesc],
                               consts: Sequence) -> Callable:
    """AddLayerNorm(a [..., D], b [..., D], γ [D], β [D]; attrs eps) -> LayerNorm(a + b)
    [..., D] in a's dtype, written into ``out`` when given (the planned buffer).

    fp32 with a, b, out contiguous: the numba kernel, unless its row statistics or γ, β
    leave the range where it gives eager's special values (module docstring); otherwise
    (another dtype, strided inputs, those rows) ATen's ``add`` + ``layer_norm``, eager's
    own kernels."""
    eps = float(node.attrs["eps"])
    d = int(in_descs[0].shape[-1])
    fp32 = all(t.dtype.torch == torch.float32 for t in in_descs)

    def run_aten(a, b, g, be, out=None):
        y = torch.layer_norm(torch.add(a, b), [d], g, be, eps)
        return y if out is None else out.copy_(y)

    if not fp32:
        return run_aten
    kernel = _compiled()
    e32 = np.float32(eps)
    bound, rstd_max = layer_norm_limits(d, torch.float32)
    static = consts[2] is not None and consts[3] is not None
    affine_ok = affine_in_range(consts[2], consts[3], d, torch.float32) if static else None

    def run(a, b, g, be, out=None):
        ok = affine_ok if affine_ok is not None else affine_in_range(g, be, d, torch.float32)
        if not (ok and a.is_contiguous() and b.is_contiguous()
                and (out is None or out.is_contiguous())):
            return run_aten(a, b, g, be, out)
        y = torch.empty_like(a) if out is None else out
        with _guard(a.numel()):
            outside = kernel(a.detach().view(-1, d).numpy(), b.detach().view(-1, d).numpy(),
                             g.detach().numpy(), be.detach().numpy(), e32,
                             y.view(-1, d).numpy(), bound, rstd_max)
        return run_aten(a, b, g, be, out) if outside else y
    return run


__all__ = ["make_add_layer_norm_kernel"]
