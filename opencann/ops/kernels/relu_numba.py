"""In-place ReLU on a dense bf16 or fp32 tensor through its integer bits: one compare per
element on the int16 / int32 view, no float conversion, eager's NaN / ±inf / -0.0
results (the convolutions' ReLU, which stays a separate pass because every oneDNN ReLU
post-op turns NaN into 0; ``opencann.ops.kernels.cpu``).

An IEEE value whose sign bit is set reads as a negative integer; with e the all-ones
exponent and m the mantissa, the negative integers are, ascending: -0.0 (the type's
minimum integer), the negative finite values from the largest magnitude down, -inf
(``0xff80`` / ``0xff800000``: -128 / -8388608), then the negative NaNs (-127..-1 /
-8388607..-1). So ``relu(x)`` sets to +0.0 exactly the integers in [min + 1, -inf's]:
negative finite values (denormals included) and -inf become +0.0, while NaN (either
sign) and -0.0 keep their bits, as eager's ``torch.relu`` keeps them (its vectorized
``clamp_min`` returns -0.0 for -0.0 and a NaN for a NaN; its scalar path may canonicalize
a NaN's payload, which no comparison sees). torch's bf16 ``relu_`` converts each element
to fp32 and back; this loop compares 16-bit integers on the calling thread, for tensors
under `SERIAL_MAX` elements (above it eager's two-thread ``relu_`` runs: the figures at
`SERIAL_MAX`). ResNet-50 bf16, batch 1 (49 ReLU passes; the same executor bound both
ways, one process, interleaved, 2-core Xeon with AMX): 29.0 → 27.9 ms median at load ~6,
29.7 → 29.0 at load ~3, the same output bits. In fp32 no gain was measured (118 / 115 ms
at batch 1, within the noise), so fp32 keeps ``torch.relu_``. Source of the bit layout: IEEE 754-2008 §3.4 (binary32; bf16 is
its top 16 bits)."""
from __future__ import annotations

import numpy as np
import torch
from .numba_cache import njit

# per dtype: (the integer view's dtype, the integer of -inf: values from the type's
# minimum + 1 up to it are the negative finite values and -inf)
_BITS = {torch.bfloat16: (torch.int16, -128), torch.float32: (torch.int32, -8388608)}


#: elements from which eager's ``torch.relu_`` (both intra-op threads) runs instead: on
#: one thread this pass won at ResNet-50 bf16 batch 1 (every ReLU output under 0.8 M
#: elements; medians against eager's relu_, interleaved: 27.9 vs 29.0 ms at load ~6, 29.0
#: vs 29.7 at load ~3), while at batch 8 (outputs up to 6.4 M elements) the result moved
#: with the load: 251 vs 310 ms at load ~6 (a parallel numba launch), 167-224 vs 156-215
#: at load ~3.5
SERIAL_MAX = 1 << 20


@njit(cache=True, nogil=True)
def _relu_bits_serial(v, neg_inf, minimum):  # pragma: no cover - compiled by numba
    for i in range(v.size):
        b = v[i]
        if b <= neg_inf and b != minimum:
            v[i] = 0


def relu_(x: torch.Tensor) -> torch.Tensor:
    """``torch.relu_(x)`` (same values, NaN and -0.0 kept) for any float tensor; a dense
    (contiguous in some memory order) bf16 or fp32 one takes one numba pass over its
    integer bits on the calling thread (module docstring) below `SERIAL_MAX` elements;
    any other ``torch.relu_``. Returns ``x``."""
    bits = _BITS.get(x.dtype)
    if bits is None or x.numel() == 0 or not (x.is_contiguous() or (
            x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))):
        return torch.relu_(x)
    itype, neg_inf = bits
    n = x.numel()
    if n >= SERIAL_MAX:
        return torch.relu_(x)
    v = x.view(itype).as_strided((n,), (1,)).numpy()
    _relu_bits_serial(v, v.dtype.type(neg_inf), v.dtype.type(np.iinfo(v.dtype).min))
    return x


__all__ = ["relu_"]
