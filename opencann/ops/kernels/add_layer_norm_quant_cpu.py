"""CPU kernel of AddLayerNormQuant (CANN's ``aclnnAddLayerNormQuant``): x = x1 + x2, y the
LayerNorm of x over the last axis in float32 (the residual stream, the caller's value) and
y_q its uint8 quantization for the int8 Linear that reads it: one node where a bf16 graph
with int8 linears had AddLayerNormCast (writing y and its bf16 cast) then an AscendQuant
of that bf16 tensor.

One numba pass over the rows (`add_layer_norm_numba.add_ln_quant`, AddLayerNorm's row code):
each addend read once (a bf16 one widened exactly as it is read), y and y_q written in the
same row loop. It replaced ATen's ``add``, ``native_layer_norm`` and a quantization pass
(three passes over the activation, five reads and writes of it) and fresh outputs: in a
BERT-base int8 + bf16 graph the node took ~200 µs there against ~70 µs alone, its inputs
evicted from L2 by the int8 GEMM before it. In the graph, median of its 24 nodes' calls:
193 → 118 µs (BERT-base), 107 → 81 µs (MiniLM), load 3.3, ``bench/add_layer_norm_quant.py``
(docs/performance.md).

Values: y is LayerNorm's float32 result to rounding: mean and variance in float64 (ATen: a
float32 Welford pass), the normalization in float32, so y may differ from ATen's
``native_layer_norm`` (eager's) by float32 rounding, a few ulp (measured at [128, 768], γ,
β ~ N(0, 1): max |y − exact| 1.2e-6 where ATen's is 2.0e-6 with float32 addends, 1.1e-6
against 1.4e-6 with a bf16 one; `tests/unit/test_add_layer_norm_quant.py` bounds it by twice
ATen's); the int8 graph's own error (a uint8 step of the next layer's input, ~0.03) is 10^4
times larger. y_q quantizes y itself (`quant_numba.saturate_u8`, the rounding of
`quant_numba.quantize_dense`: ``saturate(round_half_even(y / step) + offset)``, NaN → 0,
+inf → 255, -inf → 0): one uint8 step at most from quantizing eager's y (where the float32
rounding crosses a rounding boundary) and from the unfused chain (norm, Cast to bf16,
AscendQuant: where the bf16 rounding crosses one; y_q is the closer).
Special values: a row out of `norm_range.layer_norm_limits`' range (NaN or ±inf in the sum,
|x| near 1e19), γ or β not `affine_in_range` (inf, NaN, huge), an fp16 addend or a strided
input run ATen's ``add`` + ``native_layer_norm`` then the quantization instead (only those
rows for a row out of range; the others keep the one pass's values): eager's NaN rows
(quantized to 0) and values.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from ...ir import Node, TensorDesc
from ..parity.norm_range import affine_in_range, layer_norm_limits
from .add_layer_norm_cast_cpu import add_layer_norm_f32
from .int8_cpu import quantize_u8

_NUMBA_DTYPES = (torch.float32, torch.bfloat16)


def add_layer_norm_quant(x1: torch.Tensor, x2: torch.Tensor, weight, bias, eps: float,
                         step: float, offset: int):
    """(y, y_q) for x1, x2 [..., D] of one shape (float32 or bf16/fp16 each; the sum is
    float32), ``weight`` γ and ``bias`` β [D] float32 or None: y = LayerNorm(float(x1) +
    float(x2)) over the last axis (float32), y_q = y quantized to uint8 at ``step`` (> 0)
    and ``offset`` (the zero point, in [0, 255]); both fresh (y_q with y's strides). One
    numba pass when both addends are float32 or bf16 and contiguous (`OnePass`); ATen's ops
    otherwise and for rows out of range (module docstring). Raises ValueError (one line)
    when x1 and x2 differ in shape or the sum is not float32."""
    d = x1.shape[-1] if x1.dim() else 0
    if x1.shape == x2.shape and d > 0 and OnePass.takes(x1, x2, d):
        one = OnePass(weight, bias, eps, step, offset, d)
        if one.affine_ok:
            return one(x1, x2)
    return aten_chain(x1, x2, weight, bias, eps, step, offset)


def aten_chain(x1, x2, weight, bias, eps: float, step: float, offset: int):
    """(y, y_q) by eager's ops: ATen's ``add`` + ``native_layer_norm`` (`add_layer_norm_f32`,
    its ValueErrors), then `int8_cpu.quantize_u8` of y."""
    y = add_layer_norm_f32(x1, x2, weight, bias, eps, "add_layer_norm_quant")
    return y, quantize_u8(y, step, offset)


class OnePass:
    """The one numba pass of AddLayerNormQuant for one (γ, β, eps, step, offset) and row
    length d, its per-call arguments prepared once (a kernel factory builds one per node:
    the Python work around a [128, 768] launch was 34 of 125 µs before). ``affine_ok``:
    whether γ, β are `affine_in_range` (else the caller runs `aten_chain`)."""

    def __init__(self, weight, bias, eps: float, step: float, offset: int, d: int):
        ok = all(t is None or (t.dtype == torch.float32 and t.is_contiguous() and tuple(t.shape) == (d,))
                 for t in (weight, bias))
        self.affine_ok = ok and affine_in_range(weight, bias, d, torch.float32)
        self.args = (weight, bias, eps, step, offset)
        self.d = d
        self.g = (torch.ones(d, dtype=torch.float32) if weight is None else weight).detach().numpy()
        self.be = (torch.zeros(d, dtype=torch.float32) if bias is None else bias).detach().numpy()
        bound, rstd_max = layer_norm_limits(d, torch.float32)
        self.p = np.array([np.float32(eps), np.float32(1.0 / step), offset, bound, rstd_max], np.float64)

    @staticmethod
    def takes(x1: torch.Tensor, x2: torch.Tensor, d: int) -> bool:
        """Whether the pass reads x1, x2: float32 or bf16 (one float32), contiguous, not empty."""
        return (x1.dtype in _NUMBA_DTYPES and x2.dtype in _NUMBA_DTYPES
                and (x1.dtype == torch.float32 or x2.dtype == torch.float32)
                and x1.is_contiguous() and x2.is_contiguous() and x1.numel() > 0)

    def __call__(self, x1: torch.Tensor, x2: torch.Tensor, out=None):
        """(y, y_q) of x1, x2 (`takes` them, one shape): `add_layer_norm_numba.add_ln_quant`
        (its serial twin when `numba_cache.launch_threads` gives one thread), then
        `aten_chain` on the rows out of range only (a row's LayerNorm depends on that row
        alone: the other rows keep their values whatever NaN another row holds). Written
        into ``out`` = (y float32, y_q uint8), contiguous of x1's shape, when given (the
        planned buffers: reused memory, where a fresh [128, 768] allocation page-faults),
        else into fresh arrays."""
        import numba   # loads at the first call only

        from .add_layer_norm_numba import add_ln_quant, add_ln_quant_serial
        from .numba_cache import launch
        d, shape = self.d, tuple(x1.shape)
        if out is not None:
            y, yq = out[0].numpy(), out[1].numpy()
        else:
            y, yq = np.empty(shape, np.float32), np.empty(shape, np.uint8)
        y2, yq2 = y.reshape(-1, d), yq.reshape(-1, d)     # numpy views: torch's view costs ~2 µs
        bad = np.empty(y2.shape[0], np.uint8)
        with launch(y.size):
            kernel = add_ln_quant if numba.get_num_threads() > 1 else add_ln_quant_serial
            outside = kernel(_rows(x1, d), _rows(x2, d), self.g, self.be, self.p, y2, yq2, bad)
        if outside:
            rows = torch.from_numpy(bad).nonzero().view(-1)
            yr, qr = aten_chain(x1.reshape(-1, d)[rows], x2.reshape(-1, d)[rows], *self.args)
            torch.from_numpy(y2)[rows], torch.from_numpy(yq2)[rows] = yr, qr
        return tuple(out) if out is not None else (torch.from_numpy(y), torch.from_numpy(yq))


def _rows(x: torch.Tensor, d: int):
    """x (contiguous float32 or bf16) as a numpy [rows, d] array: float32, or bf16 bits as
    int16 (`add_layer_norm_numba.widen` reads them)."""
    if x.requires_grad:
        x = x.detach()
    if x.dtype == torch.bfloat16:
        x = x.view(torch.int16)
    return x.numpy().reshape(-1, d)


def make_add_layer_norm_quant_kernel(node: Node, in_descs: Sequence[TensorDesc],
                                     consts: Sequence) -> Callable:
    """Kernel factory of AddLayerNormQuant(x1, x2, γ, β; attrs eps, scale (AscendQuant's:
    1 / step), offset) -> (y float32, y uint8): ``run(x1, x2, γ, β)``
    (`add_layer_norm_quant`; `OnePass` prepared once when γ and β are constants), written
    into ``out`` = (y buffer, y_q buffer) when given (the op is ``out_capable``: the
    arena's planned buffers), else into fresh tensors."""
    eps = float(node.attrs["eps"])
    step, offset = 1.0 / float(node.attrs["scale"]), int(node.attrs["offset"])
    iw = node.attrs["weight"].index if node.attrs.get("weight") is not None else None
    ib = node.attrs["bias"].index if node.attrs.get("bias") is not None else None
    cg, cb = (None if i is None else consts[i] for i in (iw, ib))
    static = (iw is None or cg is not None) and (ib is None or cb is not None)
    ones = {}      # the node's OnePass per row length (γ, β constants: prepared once)

    def run(*xs, out=None):
        x1, x2 = xs[0], xs[1]
        g, be = None if iw is None else xs[iw], None if ib is None else xs[ib]
        d = x1.shape[-1] if x1.dim() else 0
        outs_ok = out is None or (out[0] is not None and out[1] is not None and out[0].is_contiguous()
                                  and out[1].is_contiguous() and out[0].shape == x1.shape == out[1].shape)
        if static and outs_ok and x1.shape == x2.shape and d > 0 and OnePass.takes(x1, x2, d):
            one = ones.get(d)
            if one is None:
                one = ones[d] = OnePass(g, be, eps, step, offset, d)
            if one.affine_ok:
                return one(x1, x2, out)
        y, yq = add_layer_norm_quant(x1, x2, g, be, eps, step, offset)
        if out is None:
            return y, yq
        return tuple(t if o is None else o.copy_(t) for o, t in zip(out, (y, yq)))
    return run


__all__ = ["OnePass", "add_layer_norm_quant", "aten_chain", "make_add_layer_norm_quant_kernel"]
