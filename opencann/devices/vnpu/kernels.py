"""Functional vnpu kernels that compute directly in NPU formats (executed on the host with torch).

* `conv2d_nc1hwc0`: NC1HWC0 activations x FRACTAL_Z weights -> NC1HWC0.  Patches are
  gathered in the blocked layout (``unfold`` over H and W of the 5-D tensor, giving
  (c1, kh, kw, c0)-ordered rows, the FRACTAL_Z row order) and multiplied by the fractal
  weight matrix (C1*KH*KW*C0) x (N1*16), as the Cube's img2col + matmul does (Liao et
  al., Hot Chips 31, 2019: img2col in the MTE, matmul in the Cube).  Padded input
  channels meet zero weight rows, padded output channels have zero weight columns, so
  padding contributes zero.  Grouped / depthwise (``groups`` > 1): GE's grouped FRACTAL_Z
  (`formats.fz_groups`) holds G block-diagonal weights of e groups each; block b reads the
  e*Cin_g input channels of its groups (zero-padded to Cin_opt) and writes their e*Cout_g
  output channels: one GEMM per block, as the Cube runs it (its zero off-diagonal entries
  are skipped, so NaN/Inf stay in their group as in eager).
* `matmul_nz`: FRACTAL_NZ x FRACTAL_NZ -> FRACTAL_NZ, a blocked matmul whose M and N stay
  in fractal blocks and whose K is contracted fractal by fractal (batch dims broadcast).
* `elementwise`: any function on tensors in one storage format, re-zeroing the padding.
* `trans_data`: re-exported from `formats`.

Accumulation follows the Cube: fp16/bf16 products accumulate in fp32 (L0C is fp32) and
the result is cast back to the input dtype; int8 accumulates exactly and returns int32.
An int8 convolution's ``offset_x`` (CANN Conv2D's attribute: the input's quantization
offset) is the value its spatial padding reads, so a padded tap contributes
``offset_x * w`` exactly as a real zero-valued input does; the graph's int32 bias carries
``-offset_x * sum(w)`` per output channel (the AMCT bias correction), which cancels it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from .formats import (NI, c0_for, format_name, format_shape, from_fractal_nz, fz_groups, to_fractal_nz,
                      trans_data, valid_mask)

__all__ = ["conv2d_nc1hwc0", "matmul_nz", "elementwise", "trans_data"]


def _pair(v: int | Sequence[int], name: str) -> tuple[int, int]:
    if isinstance(v, int):
        v = (v, v)
    v = tuple(int(i) for i in v)
    if len(v) != 2:
        raise ValueError(f"{name} must be an int or a pair of ints, got {v}")
    return v  # type: ignore[return-value]


def _acc_dtype(dt: torch.dtype) -> torch.dtype:
    if dt in (torch.float16, torch.bfloat16, torch.float32):
        return torch.float32
    if dt == torch.float64:
        return torch.float64
    return torch.float64  # integers: exact up to 2**53, then cast to int32


def _out_dtype(dt: torch.dtype) -> torch.dtype:
    return dt if dt.is_floating_point else torch.int32


def _check_conv_operands(x: torch.Tensor, w_fz: torch.Tensor, in_channels: int, out_channels: int,
                         kh: int, kw: int, c0: int | None, groups: int = 1) -> None:
    """Raise ValueError unless ``x`` is NC1HWC0 holding ``in_channels`` and ``w_fz`` the
    FRACTAL_Z of an (out_channels, in_channels, kh, kw) weight at x's C0."""
    if x.dim() != 5:
        raise ValueError(f"conv2d_nc1hwc0: x must be NC1HWC0 (rank 5), got shape {tuple(x.shape)}")
    if w_fz.dim() != 4:
        raise ValueError(f"conv2d_nc1hwc0: w_fz must be FRACTAL_Z (rank 4), got shape {tuple(w_fz.shape)}")
    _, c1, _, _, k = x.shape
    k_expected = c0_for(x.dtype, c0)
    if k != k_expected or c1 != -(-in_channels // k):
        raise ValueError(f"conv2d_nc1hwc0: x shape {tuple(x.shape)} does not hold {in_channels} channels with "
                         f"C0={k_expected} for {x.dtype}")
    if groups < 1 or in_channels % groups or out_channels % groups:
        raise ValueError(f"conv2d_nc1hwc0: groups={groups} must divide in_channels={in_channels} and "
                         f"out_channels={out_channels}")
    expected_w = format_shape((out_channels, in_channels // groups, kh, kw), "FRACTAL_Z", w_fz.dtype, c0=k,
                              groups=groups)
    if tuple(w_fz.shape) != expected_w:
        raise ValueError(f"conv2d_nc1hwc0: w_fz shape {tuple(w_fz.shape)} disagrees with weight "
                         f"({out_channels}, {in_channels}, {kh}, {kw}); expected {expected_w}")


def conv2d_nc1hwc0(x: torch.Tensor, w_fz: torch.Tensor, *, in_channels: int, out_channels: int,
                   kernel_size: int | Sequence[int], stride: int | Sequence[int] = 1,
                   padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1,
                   bias: torch.Tensor | None = None, c0: int | None = None, groups: int = 1,
                   offset_x: int = 0) -> torch.Tensor:
    """2-D convolution with NC1HWC0 input, FRACTAL_Z weight, NC1HWC0 output.

    Args:
        x: (N, C1, H, W, C0) activations, C1 = ceil(in_channels / C0), pad channels zero.
        w_fz: (C1*KH*KW, N1, 16, C0) weight, N1 = ceil(out_channels / 16) (`to_fractal_z`).
        in_channels, out_channels: logical channel counts (the formats hide them).
        kernel_size, stride, padding, dilation: as torch.nn.functional.conv2d.
        bias: optional (out_channels,) tensor.
        c0: override C0 (must match how x and w_fz were laid out).
        groups: convolution groups; w_fz is then GE's grouped FRACTAL_Z of the
            (out_channels, in_channels / groups, KH, KW) weight (`to_fractal_z(..., groups=)`).
        offset_x: the value spatial padding reads (an int8 input's quantization offset,
            CANN Conv2D's ``offset_x``; 0 for floating point).
    Returns: (N, ceil(out_channels / C0), Ho, Wo, C0) in x's dtype (int32 for integer
        inputs), pad channels zero.
    Raises ValueError: ranks, C0/C1/N1 or kernel size that disagree with the shapes.
    """
    kh, kw = _pair(kernel_size, "kernel_size")
    sh, sw = _pair(stride, "stride")
    ph, pw = _pair(padding, "padding")
    dh, dw = _pair(dilation, "dilation")
    _check_conv_operands(x, w_fz, in_channels, out_channels, kh, kw, c0, groups)
    n, c1, h, wd, k = x.shape
    acc = _acc_dtype(x.dtype)
    if offset_x and (ph or pw):     # pad with the int8 offset (module docstring), then convolve unpadded
        x = F.pad(x, (0, 0, pw, pw, ph, ph), value=int(offset_x))
        n, c1, h, wd, k = x.shape
        ph = pw = 0
    if groups != 1:
        out = _grouped_conv(x, w_fz, in_channels, out_channels, groups, (kh, kw), (sh, sw), (ph, pw), (dh, dw), acc)
        return _pack_out(out, bias, out_channels, n, x.dtype, acc, c0)
    # spatial zero padding on the 5-D tensor: (C0 none, W, H)
    xp = F.pad(x, (0, 0, pw, pw, ph, ph))
    eff_h, eff_w = (kh - 1) * dh + 1, (kw - 1) * dw + 1
    ho = (h + 2 * ph - eff_h) // sh + 1
    wo = (wd + 2 * pw - eff_w) // sw + 1
    if ho <= 0 or wo <= 0:
        raise ValueError(f"conv2d_nc1hwc0: kernel {kh}x{kw} (dilation {dh},{dw}) larger than padded input "
                         f"{h + 2 * ph}x{wd + 2 * pw}")
    # img2col in the blocked layout: (N, C1, Ho, Wo, C0, eff_h, eff_w) -> dilate -> rows (c1, kh, kw, c0)
    patches = xp.unfold(2, eff_h, sh).unfold(3, eff_w, sw)[..., ::dh, ::dw]
    patches = patches.permute(0, 2, 3, 1, 5, 6, 4).reshape(n * ho * wo, c1 * kh * kw * k)
    # fractal weight matrix: rows (c1, kh, kw, c0), columns (n1, n0)
    n1 = w_fz.shape[1]
    wmat = w_fz.permute(0, 3, 1, 2).reshape(c1 * kh * kw * k, n1 * NI)
    out = patches.to(acc) @ wmat.to(acc)                    # (N*Ho*Wo, N1*16)
    return _pack_out(out.reshape(n, ho, wo, n1 * NI), bias, out_channels, n, x.dtype, acc, c0)


def _grouped_conv(x: torch.Tensor, w_fz: torch.Tensor, cin: int, cout: int, groups: int, k: tuple,
                  stride: tuple, padding: tuple, dilation: tuple, acc: torch.dtype) -> torch.Tensor:
    """Grouped conv as G block-diagonal GEMMs over GE's grouped FRACTAL_Z; returns
    (N, Ho, Wo, Cout) in ``acc``."""
    n, c1, h, wd, c0 = x.shape
    kh, kw = k
    cin_g, cout_g = cin // groups, cout // groups
    e, cin_opt, cout_opt, g_blocks = fz_groups(cin_g, cout_g, groups, c0)
    x4 = x.permute(0, 1, 4, 2, 3).reshape(n, c1 * c0, h, wd)[:, :cin].to(acc)
    x4 = F.pad(x4, (0, 0, 0, 0, 0, g_blocks * e * cin_g - cin))      # groups past `groups`: zero
    # storage (G*C1b*KH*KW, Cout_opt/16, 16, C0) read as (G, C1b, KH, KW, Cout_opt, C0)
    dense = w_fz.reshape(g_blocks, cin_opt // c0, kh, kw, cout_opt, c0).permute(0, 4, 1, 5, 2, 3)
    dense = dense.reshape(g_blocks, cout_opt, cin_opt, kh, kw).to(acc)
    # the e diagonal (Cout_g, Cin_g) sub-blocks of each block, read from the storage
    diag = torch.cat([dense[:, ev * cout_g:(ev + 1) * cout_g, ev * cin_g:(ev + 1) * cin_g] for ev in range(e)], 1)
    outs = []
    for b in range(g_blocks):   # one block-diagonal GEMM per block (the Cube's loop over G)
        xb = x4[:, b * e * cin_g:(b + 1) * e * cin_g]
        # only the diagonal is contracted: a NaN/Inf in one group stays out of the others, as
        # in eager (NaN * 0 of the zero off-diagonal fractal entries is not simulated)
        outs.append(F.conv2d(xb, diag[b], stride=stride, padding=padding, dilation=dilation, groups=e))
    return torch.cat(outs, 1)[:, :cout].permute(0, 2, 3, 1)


def _pack_out(out: torch.Tensor, bias: torch.Tensor | None, out_channels: int, n: int, in_dtype: torch.dtype,
              acc: torch.dtype, c0: int | None) -> torch.Tensor:
    """(N, Ho, Wo, >= Cout) accumulator + bias -> NC1HWC0 in the output dtype, pad zero."""
    out = out.clone() if bias is not None else out
    if bias is not None:
        if bias.shape != (out_channels,):
            raise ValueError(f"conv2d_nc1hwc0: bias must have shape ({out_channels},), got {tuple(bias.shape)}")
        out[..., :out_channels] += bias.to(acc)
    od = _out_dtype(in_dtype)
    ko = c0_for(od, c0)
    c1o = -(-out_channels // ko)
    _, ho, wo, _ = out.shape
    out = out[..., :out_channels]
    out = F.pad(out, (0, c1o * ko - out_channels))
    out = out.reshape(n, ho, wo, c1o, ko).permute(0, 3, 1, 2, 4)
    return out.to(od).contiguous()


def matmul_nz(a: torch.Tensor, b: torch.Tensor, a_shape: Sequence[int], b_shape: Sequence[int],
              c0: int | None = None) -> torch.Tensor:
    """Batched matmul on FRACTAL_NZ operands, result in FRACTAL_NZ.

    Args:
        a: FRACTAL_NZ of A with logical shape a_shape = (..., M, K): (..., K1, M1, 16, C0).
        b: FRACTAL_NZ of B with logical shape b_shape = (..., K, N): (..., N1, Kb1, 16, C0).
        a_shape, b_shape: logical shapes (batch dims broadcast like torch.matmul).
        c0: override C0 of the inputs.
    Returns: FRACTAL_NZ of C = A @ B, logical shape (broadcast batch..., M, N), in the
        input dtype (int32 for integer inputs), pad zero.
    Raises ValueError: ranks < 2, K mismatch, storage shapes that disagree.
    """
    a_shape, b_shape = tuple(a_shape), tuple(b_shape)
    if len(a_shape) < 2 or len(b_shape) < 2:
        raise ValueError(f"matmul_nz: logical shapes must have rank >= 2, got {a_shape} and {b_shape}")
    if a_shape[-1] != b_shape[-2]:
        raise ValueError(f"matmul_nz: inner dimensions differ: A {a_shape} @ B {b_shape}")
    for t, s, nm in ((a, a_shape, "a"), (b, b_shape, "b")):
        exp = format_shape(s, "FRACTAL_NZ", t.dtype, c0=c0)
        if tuple(t.shape) != exp:
            raise ValueError(f"matmul_nz: {nm} storage shape {tuple(t.shape)} disagrees with logical shape {s} "
                             f"(expected {exp})")
    acc = _acc_dtype(a.dtype)
    nb_a = a.dim() - 4
    # A fractals: (..., K1, M1, 16, k0) -> (..., M1, 16, K1*k0)
    pa = list(range(nb_a)) + [nb_a + 1, nb_a + 2, nb_a, nb_a + 3]
    a_blk = a.permute(*pa).flatten(-2)
    # B fractals: (..., N1, Kb1, 16, n0) -> (..., N1, Kb1*16, n0)
    b_blk = b.flatten(-3, -2)
    kc = min(a_blk.shape[-1], b_blk.shape[-2])        # both pads beyond K are zero
    a_blk, b_blk = a_blk[..., :kc].to(acc), b_blk[..., :kc, :].to(acc)
    # contract K fractal-pair by fractal-pair; M1/N1 fractal indices stay blocked
    c = torch.einsum("...mik,...nkj->...nmij", a_blk, b_blk)   # (..., N1, M1, 16, n0)
    od = _out_dtype(a.dtype)
    batch = torch.broadcast_shapes(a_shape[:-2], b_shape[:-2])
    out_shape = (*batch, a_shape[-2], b_shape[-1])
    c = c.to(od)
    if c.shape[-1] != c0_for(od, c0):          # int8 -> int32 changes C0: re-block
        plain = from_fractal_nz(c.contiguous(), out_shape, c0=c.shape[-1])
        return to_fractal_nz(plain, c0=c0_for(od, c0))
    return c.contiguous()


def elementwise(fn: Callable[..., torch.Tensor], *xs: Any, fmt: Any, origin_shape: Sequence[int],
                origin_format: Any = None, c0: int | None = None) -> torch.Tensor:
    """Apply `fn` elementwise to tensors stored in `fmt`, keeping the padding zero.

    Elementwise ops are layout-agnostic: every real element sits at one storage position
    in every operand, so `fn` can run on the storage tensors directly.  Only the padding
    needs care: functions with f(0) != 0 (sigmoid, exp, cos, x + 1, ...) would write
    non-zero values (or inf/nan, e.g. log(0), 0/0) into it, and later Cube ops rely on a
    zero pad.  After `fn`, this re-zeroes every padding position (``torch.where`` on a
    mask from `valid_mask`), so the pad is zero whatever `fn` does.

    Args:
        fn: function of tensors, e.g. ``torch.sigmoid`` or ``lambda a, b: a + b``.
        xs: operands; tensors in `fmt`'s storage shape or broadcastable to it (scalars,
            per-channel tensors shaped like (1, C1, 1, 1, C0)).
        fmt: the storage format of the tensor operands.
        origin_shape, origin_format: logical shape (and its plain format) of the output.
        c0: override C0.
    Returns: fn's result in the storage format with zero padding.
    Raises ValueError: no tensor operand, or a tensor operand not broadcastable to the
        storage shape.
    """
    fmt = format_name(fmt)
    tensors = [x for x in xs if isinstance(x, torch.Tensor)]
    if not tensors:
        raise ValueError("elementwise: at least one operand must be a tensor")
    ref = max(tensors, key=lambda t: t.dim())
    storage = format_shape(origin_shape, fmt, ref.dtype, origin_format=origin_format, c0=c0)
    for t in tensors:
        try:
            torch.broadcast_shapes(t.shape, storage)
        except RuntimeError:
            raise ValueError(f"elementwise: operand shape {tuple(t.shape)} does not broadcast to the {fmt} storage "
                             f"shape {storage} of origin shape {tuple(origin_shape)}") from None
    out = fn(*xs)
    if tuple(out.shape) != storage:
        out = out.expand(storage)
    if fmt in ("ND", "NCHW", "NHWC"):
        return out
    mask = valid_mask(origin_shape, fmt, ref.dtype, origin_format=origin_format, c0=c0)
    return torch.where(mask, out, torch.zeros((), dtype=out.dtype))
