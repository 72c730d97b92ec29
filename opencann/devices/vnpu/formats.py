"""NPU data formats, bit-exact in both directions: NC1HWC0, FRACTAL_Z, FRACTAL_NZ.

The layouts follow CANN's definitions:

* ``NC1HWC0`` (5-D): C is cut into C1 = ceil(C / C0) slices of C0 channels; the last
  slice is zero-padded.  ``y[n, c1, h, w, c0] = x[n, c1*C0 + c0, h, w]``.
  Source: CANN aclFormat documentation ("NC1HWC0: C1 = C/C0, the last slice is padded
  to C0"), and GE ``format_transfer_nchw_nc1hwc0.cc``.
* ``FRACTAL_Z`` (conv weights, 4-D): shape (C1*KH*KW, N1, 16, C0) with N1 = ceil(Cout/16),
  ``y[c1*KH*KW + kh*KW + kw, n1, n0, c0] = w[n1*16 + n0, c1*C0 + c0, kh, kw]``; padding
  (Cout up to N1*16, Cin up to C1*C0) is zero.  Source: GE
  ``formats/format_transfers/format_transfer_fractal_z.cc`` (``TransShapeToFz``: "frac_z
  axises: (C1*H*W, No, Ni, C0)", and ``TransFormatFromNchwToFz``'s index
  ``gfi * fractal_ele_cnt + col * c0 + row`` with col the output channel in the fractal).
* ``FRACTAL_Z`` with groups (grouped / depthwise conv weights (Cout, Cin/g, KH, KW)): GE packs
  ``e`` groups into one block-diagonal weight, ``e = min(lcm(lcm(Cin_g, C0) / Cin_g,
  lcm(Cout_g, 16) / Cout_g), g)``; Cin_opt = up(e*Cin_g, C0), Cout_opt = up(e*Cout_g, 16),
  G = ceil(g / e); storage (G*C1*KH*KW, Cout_opt/16, 16, C0), C1 = Cin_opt/C0, read as
  (G, C1, KH, KW, Cout_opt, C0): group ``gi`` (G = gi // e, ev = gi % e) puts
  ``w[gi*Cout_g + n, c, kh, kw]`` at channel ``ev*Cin_g + c`` and column ``ev*Cout_g + n``.
  groups = 1 is the plain layout above.  Source: GE ``format_transfer_fractal_z.cc``
  (``TransShapeToFzWithGroups``, ``TransFormatHwcnToFzWithGroups``); shape vector from the
  metadef transformer unit test: NCHW {48, 512, 5, 5}, groups 16, fp16 -> {12800, 3, 16, 16}.
* ``FRACTAL_Z`` of a 2-D matmul weight [K, N] (origin ND): (ceil(K/C0), ceil(N/16), 16, C0),
  ``y[k1, n1, n0, k0] = x[k1*C0 + k0, n1*16 + n0]``: the layout of the same weight as a 1x1
  convolution with Cout = N, Cin = K.  Shape vectors from the metadef transformer unit test
  ``transfer_shape_from_nd_to_fz``: ND {18, 34} fp16/fp32 -> {2, 3, 16, 16}, int8 -> {1, 3, 16, 32}.
* ``FRACTAL_NZ`` (matrices, rank >= 2): (..., M, N) -> (..., N1, M1, M0, N0) with M0 = 16,
  N0 = C0, N1 = ceil(N / N0), M1 = ceil(M / 16);
  ``y[..., n1, m1, m0, n0] = x[..., m1*16 + m0, n1*N0 + n0]``.  The matrix is cut into
  16 x C0 fractals stored column-major ("N", outer) with each fractal row-major ("Z",
  inner).  Source: CANN ATB TransdataOperation docs (NZ dims {b, n1, m1m0, n0}; ND
  {8, 100, 30} fp16 -> NZ {8, 2, 112, 16}); metadef transformer unit test ND {18, 34} fp32
  -> {3, 2, 16, 16}.  A rank-1 tensor is one row (1, N), as GE's TransData does
  (``format_transfer_fractal_nz.cc`` ``TransShapeToFracNz``: {ceil(N/w0), 1, 16, w0}); the
  transformer's shape inference reads {34} as a column instead ({1, 3, 16, 16}).

C0 (elements per fractal row of a *stored* tensor) is GE's ``GetCubeSizeByDataType``: 32 for
1-byte types (int8/uint8), 16 for every other type, fp32 included: NCHW fp32 {8, 512, 5, 5}
-> NC1HWC0 {8, 32, 5, 5, 16} (metadef transformer unit test ``transfer_shape_from_nchw``).
The Cube's own operand fractals are 32 bytes wide (16 x 8 for fp32 in L0A/L0B); they exist
only inside a kernel and are modelled by the cost model (`cost_model.cube_k0`), not here.

Everything here is reshape / permute / pad on torch tensors of any dtype; no Python loop
touches elements.  torch is used because the vnpu executes on the host with torch.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "PLAIN_FORMATS", "NPU_FORMATS", "M0", "NI", "c0_for", "fz_groups", "format_name", "format_shape",
    "to_nc1hwc0", "from_nc1hwc0", "to_fractal_z", "from_fractal_z", "to_fractal_nz",
    "from_fractal_nz", "trans_data", "valid_mask",
]

PLAIN_FORMATS = ("ND", "NCHW", "NHWC")
NPU_FORMATS = ("NC1HWC0", "FRACTAL_Z", "FRACTAL_NZ")
M0 = 16   # rows per FRACTAL_NZ fractal (cube M size) - CANN ATB TransdataOperation docs
NI = 16   # output channels per FRACTAL_Z fractal (kNiSize in GE formats_definitions.h)


def format_name(fmt: Any) -> str:
    """Canonical upper-case name of a format given as a string or an Enum member.

    Raises ValueError for an unknown format.
    """
    name = getattr(fmt, "name", fmt)
    if not isinstance(name, str):
        raise ValueError(f"format must be a string or Enum, got {fmt!r}")
    name = name.upper()
    if name not in PLAIN_FORMATS + NPU_FORMATS:
        raise ValueError(f"unknown format {fmt!r}; known: {', '.join(PLAIN_FORMATS + NPU_FORMATS)}")
    return name


def c0_for(dtype: torch.dtype, c0: int | None = None) -> int:
    """C0 of a stored tensor: 32 for 1-byte types (int8/uint8), else 16 (fp16, bf16, fp32...),
    as GE's ``GetCubeSizeByDataType``; or `c0` when given.

    Raises ValueError when `c0` is not a positive int.
    """
    if c0 is not None:
        if not isinstance(c0, int) or c0 <= 0:
            raise ValueError(f"c0 must be a positive int, got {c0!r}")
        return c0
    size = torch.empty((), dtype=dtype).element_size()
    return 32 if size == 1 else 16


def fz_groups(cin_g: int, cout_g: int, groups: int, c0: int) -> tuple[int, int, int, int]:
    """GE's grouped FRACTAL_Z packing for per-group channels `cin_g`, `cout_g`:
    (e, Cin_opt, Cout_opt, G) with e groups per block (see the module docstring).

    Raises ValueError for non-positive sizes.
    """
    if min(cin_g, cout_g, groups, c0) < 1:
        raise ValueError(f"fz_groups: sizes must be >= 1, got cin_g={cin_g} cout_g={cout_g} "
                         f"groups={groups} c0={c0}")
    e = min(math.lcm(math.lcm(cin_g, c0) // cin_g, math.lcm(cout_g, NI) // cout_g), groups)
    return e, _ceil(e * cin_g, c0) * c0, _ceil(e * cout_g, NI) * NI, _ceil(groups, e)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _dtype_of(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        d = getattr(torch, dtype.replace("torch.", ""), None)
        if isinstance(d, torch.dtype):
            return d
    raise ValueError(f"dtype must be a torch.dtype or its name, got {dtype!r}")


def _check_rank(x: torch.Tensor | Sequence[int], rank: int, what: str) -> None:
    n = x.dim() if isinstance(x, torch.Tensor) else len(x)
    if n != rank:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else tuple(x)
        raise ValueError(f"{what}: expected a rank-{rank} tensor/shape, got rank {n} with shape {shape}")


def _check_storage(y: torch.Tensor, expected: Sequence[int], what: str, shape, fmt: str) -> None:
    if tuple(y.shape) != tuple(expected):
        raise ValueError(f"{what}: storage shape {tuple(y.shape)} disagrees with origin shape {tuple(shape)} "
                         f"({fmt}, dtype {y.dtype}): expected storage shape {tuple(expected)}; pass the origin "
                         f"shape the tensor was created from (and the same c0)")


# ----------------------------------------------------------------------------------
# storage shapes
# ----------------------------------------------------------------------------------

def format_shape(origin_shape: Sequence[int], fmt: Any, dtype: Any = torch.float16,
                 origin_format: Any = None, c0: int | None = None, groups: int = 1) -> tuple[int, ...]:
    """Storage shape of a tensor of logical `origin_shape` stored in `fmt`.

    Args:
        origin_shape: logical shape, read in `origin_format`.
        fmt: target format ('ND', 'NCHW', 'NHWC', 'NC1HWC0', 'FRACTAL_Z', 'FRACTAL_NZ').
        dtype: element type (decides C0, see `c0_for`).
        origin_format: format of `origin_shape`; default 'NCHW' for the 4-D formats
            (NHWC, NC1HWC0, FRACTAL_Z of a rank-4 shape) and 'ND' otherwise (FRACTAL_Z of
            a rank-2 shape is the matmul-weight layout).
        c0: override C0.
        groups: convolution groups for FRACTAL_Z (GE's grouped packing); Cout must divide.
    Returns: the storage shape as a tuple of ints.
    Raises ValueError: wrong rank for the format, unknown format, negative dims, groups
        that do not divide Cout.
    """
    fmt = format_name(fmt)
    dt = _dtype_of(dtype)
    shape = tuple(int(s) for s in origin_shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"format_shape: negative dimension in {shape}")
    matrix_fz = fmt == "FRACTAL_Z" and len(shape) == 2 and origin_format in (None, "ND")
    of = format_name(origin_format) if origin_format is not None else (
        "NCHW" if fmt in ("NHWC", "NC1HWC0", "FRACTAL_Z") and not matrix_fz else "ND")
    if of in NPU_FORMATS:
        raise ValueError(f"format_shape: origin_format must be ND, NCHW or NHWC, got {of}")
    k = c0_for(dt, c0)
    if matrix_fz:
        if groups != 1:
            raise ValueError("format_shape: groups apply to 4-D convolution weights, not a 2-D FRACTAL_Z matrix")
        kd, nd = shape
        return (_ceil(kd, k), _ceil(nd, NI), NI, k)
    if fmt in ("NCHW", "NHWC", "NC1HWC0", "FRACTAL_Z") or of != "ND":
        _check_rank(shape, 4, f"format_shape({of} -> {fmt})")
    if of == "NHWC" and fmt != "ND":
        shape = (shape[0], shape[3], shape[1], shape[2])   # to NCHW
    if fmt in ("ND", "NCHW"):
        return tuple(origin_shape) if fmt == "ND" else shape
    if fmt == "NHWC":
        return (shape[0], shape[2], shape[3], shape[1])
    if fmt == "NC1HWC0":
        n, c, h, w = shape
        return (n, _ceil(c, k), h, w, k)
    if fmt == "FRACTAL_Z":
        n, c, h, w = shape
        _check_groups(n, groups, "format_shape")
        e, cin_opt, cout_opt, g_dim = fz_groups(max(c, 1), max(n // groups, 1), groups, k)
        if groups == 1:
            return (_ceil(c, k) * h * w, _ceil(n, NI), NI, k)
        return (g_dim * (cin_opt // k) * h * w, cout_opt // NI, NI, k)
    # FRACTAL_NZ
    if len(shape) == 0:
        raise ValueError("format_shape: FRACTAL_NZ needs a tensor of rank >= 1, got a scalar")
    if len(shape) == 1:
        shape = (1,) + shape
    *batch, m, n = shape
    return (*batch, _ceil(n, k), _ceil(m, M0), M0, k)


def _check_groups(cout: int, groups: int, what: str) -> None:
    if not isinstance(groups, int) or groups < 1 or cout % groups:
        raise ValueError(f"{what}: groups={groups!r} must be a positive int dividing Cout={cout}")


# ----------------------------------------------------------------------------------
# NC1HWC0
# ----------------------------------------------------------------------------------

def to_nc1hwc0(x: torch.Tensor, src_format: Any = "NCHW", c0: int | None = None) -> torch.Tensor:
    """NCHW or NHWC tensor -> NC1HWC0 (N, C1, H, W, C0), last C1 slice zero-padded.

    Shapes: (N, C, H, W) [NCHW] or (N, H, W, C) [NHWC] -> (N, ceil(C/C0), H, W, C0).
    Any dtype; C0 from `c0_for`.  Source: CANN aclFormat docs (NC1HWC0).
    Raises ValueError: rank != 4 or src_format not NCHW/NHWC.
    """
    src = format_name(src_format)
    _check_rank(x, 4, "to_nc1hwc0")
    if src == "NHWC":
        x = x.permute(0, 3, 1, 2)
    elif src != "NCHW":
        raise ValueError(f"to_nc1hwc0: src_format must be NCHW or NHWC, got {src}")
    n, c, h, w = x.shape
    k = c0_for(x.dtype, c0)
    c1 = _ceil(c, k)
    x = F.pad(x, (0, 0, 0, 0, 0, c1 * k - c)) if c1 * k != c else x
    return x.reshape(n, c1, k, h, w).permute(0, 1, 3, 4, 2).contiguous()


def from_nc1hwc0(y: torch.Tensor, shape: Sequence[int], dst_format: Any = "NCHW",
                 c0: int | None = None) -> torch.Tensor:
    """NC1HWC0 (N, C1, H, W, C0) -> NCHW or NHWC tensor of logical `shape` (given in dst_format).

    Drops the channel padding.  Raises ValueError: rank != 5, `shape` not rank 4, or the
    storage shape disagrees with `format_shape(shape, 'NC1HWC0')`.
    """
    dst = format_name(dst_format)
    if dst not in ("NCHW", "NHWC"):
        raise ValueError(f"from_nc1hwc0: dst_format must be NCHW or NHWC, got {dst}")
    _check_rank(y, 5, "from_nc1hwc0")
    _check_rank(shape, 4, "from_nc1hwc0 origin shape")
    expected = format_shape(shape, "NC1HWC0", y.dtype, origin_format=dst, c0=c0)
    _check_storage(y, expected, "from_nc1hwc0", shape, dst)
    n, c1, h, w, k = y.shape
    c = shape[1] if dst == "NCHW" else shape[3]
    x = y.permute(0, 1, 4, 2, 3).reshape(n, c1 * k, h, w)[:, :c]
    if dst == "NHWC":
        x = x.permute(0, 2, 3, 1)
    return x.contiguous()


# ----------------------------------------------------------------------------------
# FRACTAL_Z (conv weights)
# ----------------------------------------------------------------------------------

def to_fractal_z(w: torch.Tensor, c0: int | None = None, src_format: Any = "NCHW", groups: int = 1) -> torch.Tensor:
    """Conv weight or matmul weight -> FRACTAL_Z (GE's layout, zero padding).

    Shapes: (Cout, Cin/groups, KH, KW) [NCHW] or (Cout, KH, KW, Cin/groups) [NHWC] ->
    (G*C1*KH*KW, Cout_opt/16, 16, C0) (groups = 1: (C1*KH*KW, ceil(Cout/16), 16, C0),
    ``y[c1*KH*KW + kh*KW + kw, n1, n0, c0] = w[n1*16+n0, c1*C0+c0, kh, kw]``); a 2-D
    [K, N] matmul weight (src_format 'ND') -> (ceil(K/C0), ceil(N/16), 16, C0) with
    ``y[k1, n1, n0, k0] = x[k1*C0+k0, n1*16+n0]``.  Grouped packing: see the module
    docstring.  Source: GE format_transfer_fractal_z.cc (TransFormatFromNchwToFz,
    TransFormatHwcnToFzWithGroups).
    Raises ValueError: wrong rank, unsupported src_format, groups not dividing Cout.
    """
    src = format_name(src_format)
    if w.dim() == 2 and src == "ND":
        if groups != 1:
            raise ValueError("to_fractal_z: groups apply to 4-D convolution weights, not a 2-D matrix")
        return to_fractal_z(w.t()[:, :, None, None], c0=c0)
    _check_rank(w, 4, "to_fractal_z")
    if src == "NHWC":
        w = w.permute(0, 3, 1, 2)
    elif src not in ("NCHW", "ND"):
        raise ValueError(f"to_fractal_z: src_format must be NCHW, NHWC or ND, got {src}")
    n, c, kh, kw = w.shape
    _check_groups(n, groups, "to_fractal_z")
    k = c0_for(w.dtype, c0)
    cout_g = n // groups
    e, cin_opt, cout_opt, g_dim = fz_groups(max(c, 1), max(cout_g, 1), groups, k)
    if groups == 1:
        e, cin_opt, cout_opt, g_dim = 1, _ceil(c, k) * k, _ceil(n, NI) * NI, 1
    # block-diagonal packing: e groups per block, G blocks (one copy per diagonal slot, not per element)
    wg = F.pad(w.reshape(groups, cout_g, c, kh, kw), (0, 0, 0, 0, 0, 0, 0, 0, 0, g_dim * e - groups))
    wg = wg.reshape(g_dim, e, cout_g, c, kh, kw)
    dense = w.new_zeros((g_dim, cout_opt, cin_opt, kh, kw))
    for ev in range(e):
        dense[:, ev * cout_g:(ev + 1) * cout_g, ev * c:(ev + 1) * c] = wg[:, ev]
    c1 = cin_opt // k
    y = dense.reshape(g_dim, cout_opt, c1, k, kh, kw).permute(0, 2, 4, 5, 1, 3)
    return y.reshape(g_dim * c1 * kh * kw, cout_opt // NI, NI, k).contiguous()


def from_fractal_z(y: torch.Tensor, shape: Sequence[int], c0: int | None = None,
                   dst_format: Any = "NCHW", groups: int = 1) -> torch.Tensor:
    """FRACTAL_Z -> weight of logical `shape`: (Cout, Cin/groups, KH, KW) [NCHW], the NHWC
    equivalent, or a 2-D [K, N] matmul weight (dst_format 'ND', rank-2 `shape`).

    Raises ValueError: rank != 4, storage shape disagrees with `shape`, bad groups.
    """
    dst = format_name(dst_format)
    _check_rank(y, 4, "from_fractal_z")
    if len(shape) == 2 and dst == "ND":
        expected = format_shape(shape, "FRACTAL_Z", y.dtype, c0=c0)
        _check_storage(y, expected, "from_fractal_z", shape, "ND")
        kd, nd = (int(s) for s in shape)
        return from_fractal_z(y, (nd, kd, 1, 1), c0=c0)[:, :, 0, 0].t().contiguous()
    if dst not in ("NCHW", "NHWC"):
        raise ValueError(f"from_fractal_z: dst_format must be NCHW, NHWC or ND (2-D), got {dst}")
    _check_rank(shape, 4, "from_fractal_z origin shape")
    expected = format_shape(shape, "FRACTAL_Z", y.dtype, origin_format=dst, c0=c0, groups=groups)
    _check_storage(y, expected, "from_fractal_z", shape, dst)
    n, c, kh, kw = shape if dst == "NCHW" else (shape[0], shape[3], shape[1], shape[2])
    k = y.shape[-1]
    cout_g = n // groups
    e, cin_opt, cout_opt, g_dim = fz_groups(max(c, 1), max(cout_g, 1), groups, k)
    if groups == 1:
        e, cin_opt, cout_opt, g_dim = 1, _ceil(c, k) * k, _ceil(n, NI) * NI, 1
    c1 = cin_opt // k
    dense = y.reshape(g_dim, c1, kh, kw, cout_opt, k).permute(0, 4, 1, 5, 2, 3).reshape(
        g_dim, cout_opt, cin_opt, kh, kw)
    blocks = torch.stack([dense[:, ev * cout_g:(ev + 1) * cout_g, ev * c:(ev + 1) * c] for ev in range(e)], 1)
    w = blocks.reshape(g_dim * e * cout_g, c, kh, kw)[:n]
    if dst == "NHWC":
        w = w.permute(0, 2, 3, 1)
    return w.contiguous()


# ----------------------------------------------------------------------------------
# FRACTAL_NZ (matrices)
# ----------------------------------------------------------------------------------

def to_fractal_nz(x: torch.Tensor, c0: int | None = None) -> torch.Tensor:
    """Matrix (..., M, N) -> FRACTAL_NZ (..., N1, M1, 16, C0), zero padding; rank 1 as (1, N).

    ``y[..., n1, m1, m0, n0] = x[..., m1*16+m0, n1*C0+n0]``.
    Source: CANN ATB TransdataOperation docs (NZ dims {b, n1, m1m0, n0}).
    Raises ValueError: rank 0.
    """
    if x.dim() == 0:
        raise ValueError("to_fractal_nz: expected a tensor of rank >= 1, got a scalar")
    if x.dim() == 1:
        x = x.unsqueeze(0)
    *batch, m, n = x.shape
    k = c0_for(x.dtype, c0)
    m1, n1 = _ceil(m, M0), _ceil(n, k)
    x = F.pad(x, (0, n1 * k - n, 0, m1 * M0 - m))
    x = x.reshape(*batch, m1, M0, n1, k)
    nb = len(batch)
    perm = list(range(nb)) + [nb + 2, nb, nb + 1, nb + 3]
    return x.permute(*perm).contiguous()


def from_fractal_nz(y: torch.Tensor, shape: Sequence[int], c0: int | None = None) -> torch.Tensor:
    """FRACTAL_NZ (..., N1, M1, 16, C0) -> matrix of logical `shape` (..., M, N) (or (N,)).

    Raises ValueError: rank < 4, or storage shape disagrees with `shape`.
    """
    if y.dim() < 4:
        raise ValueError(f"from_fractal_nz: expected a rank >= 4 FRACTAL_NZ tensor, got shape {tuple(y.shape)}")
    shape = tuple(int(s) for s in shape)
    expected = format_shape(shape, "FRACTAL_NZ", y.dtype, c0=c0)
    _check_storage(y, expected, "from_fractal_nz", shape, "ND")
    *batch, n1, m1, m0, k = y.shape
    nb = len(batch)
    perm = list(range(nb)) + [nb + 1, nb + 2, nb, nb + 3]
    full = (1,) + shape if len(shape) == 1 else shape
    x = y.permute(*perm).reshape(*batch, m1 * m0, n1 * k)[..., :full[-2], :full[-1]]
    return x.reshape(shape).contiguous()


# ----------------------------------------------------------------------------------
# dispatcher
# ----------------------------------------------------------------------------------

def _plain_to_plain(x: torch.Tensor, src: str, dst: str) -> torch.Tensor:
    if src == dst or "ND" in (src, dst):
        return x
    _check_rank(x, 4, f"trans_data({src} -> {dst})")
    perm = (0, 2, 3, 1) if (src, dst) == ("NCHW", "NHWC") else (0, 3, 1, 2)
    return x.permute(*perm).contiguous()


def trans_data(x: torch.Tensor, src_format: Any, dst_format: Any, origin_shape: Sequence[int] | None = None,
               origin_format: Any = None, c0: int | None = None, groups: int = 1) -> torch.Tensor:
    """Convert `x` from `src_format` to `dst_format` (CANN's TransData operator).

    Plain -> NPU format needs nothing else.  NPU format -> anything needs `origin_shape`,
    the logical shape, read in `origin_format` (default: `dst_format` when that is plain,
    else 'NCHW' for NC1HWC0/FRACTAL_Z and 'ND' for FRACTAL_NZ).  NPU -> NPU goes through
    the logical tensor.  ND is a relabel of any plain format.  ND <-> FRACTAL_Z of a rank-2
    tensor is the matmul-weight layout; `groups` selects GE's grouped FRACTAL_Z packing.

    Raises ValueError: unknown formats, missing `origin_shape`, wrong ranks, shapes that
    disagree with the storage shape.
    """
    src, dst = format_name(src_format), format_name(dst_format)
    if src == dst:
        return x
    if src in NPU_FORMATS:
        if origin_shape is None:
            raise ValueError(f"trans_data({src} -> {dst}): origin_shape is required to undo {src} padding")
        matrix = src == "FRACTAL_Z" and len(origin_shape) == 2
        of = format_name(origin_format) if origin_format is not None else (
            dst if dst in PLAIN_FORMATS and dst != "ND" and not matrix else
            ("ND" if src == "FRACTAL_NZ" or matrix else "NCHW"))
        if src == "NC1HWC0":
            plain = from_nc1hwc0(x, origin_shape, "NHWC" if of == "NHWC" else "NCHW", c0=c0)
        elif src == "FRACTAL_Z":
            plain = from_fractal_z(x, origin_shape, c0=c0, groups=groups,
                                   dst_format={"NHWC": "NHWC", "ND": "ND" if matrix else "NCHW"}.get(of, "NCHW"))
        else:
            plain = from_fractal_nz(x, origin_shape, c0=c0)
        return trans_data(plain, of, dst, c0=c0, groups=groups) if dst != of else plain
    # plain source
    if dst in PLAIN_FORMATS:
        return _plain_to_plain(x, src, dst)
    if dst == "NC1HWC0":
        return to_nc1hwc0(x, "NHWC" if src == "NHWC" else "NCHW", c0=c0)
    if dst == "FRACTAL_Z":
        if x.dim() == 2:
            return to_fractal_z(x, c0=c0, src_format="ND")
        return to_fractal_z(x, c0=c0, src_format="NHWC" if src == "NHWC" else "NCHW", groups=groups)
    return to_fractal_nz(x, c0=c0)


def valid_mask(origin_shape: Sequence[int], fmt: Any, dtype: Any, origin_format: Any = None,
               c0: int | None = None, groups: int = 1) -> torch.Tensor:
    """Boolean tensor in `fmt`'s storage shape: True on real elements, False on padding.

    `dtype` is the data's dtype (it decides C0).  Raises ValueError as `format_shape`.
    """
    fmt = format_name(fmt)
    dt = _dtype_of(dtype)
    k = c0_for(dt, c0)
    of = format_name(origin_format) if origin_format is not None else (
        "NCHW" if fmt in ("NC1HWC0", "FRACTAL_Z", "NHWC") and len(origin_shape) == 4 else "ND")
    ones = torch.ones(tuple(origin_shape), dtype=torch.bool)
    return trans_data(ones, of, fmt, c0=k, groups=groups)
