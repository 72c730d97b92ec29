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
* ``FRACTAL_NZ`` (matrices, rank >= 2): (..., M, N) -> (..., N1, M1, M0, N0) with M0 = 16,
  N0 = C0, N1 = ceil(N / N0), M1 = ceil(M / 16);
  ``y[..., n1, m1, m0, n0] = x[..., m1*16 + m0, n1*N0 + n0]``.  The matrix is cut into
  16 x C0 fractals stored column-major ("N", outer) with each fractal row-major ("Z",
  inner).  Source: CANN ATB TransdataOperation docs (NZ dims {b, n1, m1m0, n0}; ND
  {8, 100, 30} fp16 -> NZ {8, 2, 112, 16}); a rank-1 tensor is treated as (1, N) as GE does.

C0 (elements per fractal row) is 32 bytes / element size by default: 16 for fp16/bf16,
8 for fp32, 32 for int8/uint8 (the 32-byte block of the Ascend C data-movement rules and
CANN's explicit ``FRACTAL_NZ_C0_{2,4,8,16,32}`` formats).  Note: GE's legacy TransData
(``GetCubeSizeByDataType``) uses C0 = 16 for *every* 2- and 4-byte type; pass ``c0=16``
to get that layout for fp32.

Everything here is reshape / permute / pad on torch tensors of any dtype; no Python loop
touches elements.  torch is used because the vnpu executes on the host with torch.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "PLAIN_FORMATS", "NPU_FORMATS", "M0", "NI", "c0_for", "format_name", "format_shape",
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
    """C0 for a dtype: 32 bytes / element size (fp16/bf16 16, fp32 8, int8 32), or `c0` if given.

    Raises ValueError when `c0` is not a positive int.
    """
    if c0 is not None:
        if not isinstance(c0, int) or c0 <= 0:
            raise ValueError(f"c0 must be a positive int, got {c0!r}")
        return c0
    size = torch.empty((), dtype=dtype).element_size()
    return max(1, 32 // size)


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
                 origin_format: Any = None, c0: int | None = None) -> tuple[int, ...]:
    """Storage shape of a tensor of logical `origin_shape` stored in `fmt`.

    Args:
        origin_shape: logical shape, read in `origin_format`.
        fmt: target format ('ND', 'NCHW', 'NHWC', 'NC1HWC0', 'FRACTAL_Z', 'FRACTAL_NZ').
        dtype: element type (decides C0).
        origin_format: format of `origin_shape`; default 'NCHW' for the 4-D formats
            (NHWC, NC1HWC0, FRACTAL_Z) and 'ND' otherwise.
        c0: override C0.
    Returns: the storage shape as a tuple of ints.
    Raises ValueError: wrong rank for the format, unknown format, negative dims.
    """
    fmt = format_name(fmt)
    dt = _dtype_of(dtype)
    shape = tuple(int(s) for s in origin_shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"format_shape: negative dimension in {shape}")
    of = format_name(origin_format) if origin_format is not None else (
        "NCHW" if fmt in ("NHWC", "NC1HWC0", "FRACTAL_Z") else "ND")
    if of in NPU_FORMATS:
        raise ValueError(f"format_shape: origin_format must be ND, NCHW or NHWC, got {of}")
    if fmt in ("NCHW", "NHWC", "NC1HWC0", "FRACTAL_Z") or of != "ND":
        _check_rank(shape, 4, f"format_shape({of} -> {fmt})")
    if of == "NHWC" and fmt != "ND":
        shape = (shape[0], shape[3], shape[1], shape[2])   # to NCHW
    if fmt in ("ND", "NCHW"):
        return tuple(origin_shape) if fmt == "ND" else shape
    if fmt == "NHWC":
        return (shape[0], shape[2], shape[3], shape[1])
    k = c0_for(dt, c0)
    if fmt == "NC1HWC0":
        n, c, h, w = shape
        return (n, _ceil(c, k), h, w, k)
    if fmt == "FRACTAL_Z":
        n, c, h, w = shape
        return (_ceil(c, k) * h * w, _ceil(n, NI), NI, k)
    # FRACTAL_NZ
    if len(shape) == 0:
        raise ValueError("format_shape: FRACTAL_NZ needs a tensor of rank >= 1, got a scalar")
    if len(shape) == 1:
        shape = (1,) + shape
    *batch, m, n = shape
    return (*batch, _ceil(n, k), _ceil(m, M0), M0, k)


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

def to_fractal_z(w: torch.Tensor, c0: int | None = None, src_format: Any = "NCHW") -> torch.Tensor:
    """Conv weight (Cout, Cin, KH, KW) [NCHW] or (Cout, KH, KW, Cin) [NHWC] -> FRACTAL_Z.

    Output shape (C1*KH*KW, N1, 16, C0), C1 = ceil(Cin/C0), N1 = ceil(Cout/16),
    ``y[c1*KH*KW + kh*KW + kw, n1, n0, c0] = w[n1*16+n0, c1*C0+c0, kh, kw]``, zero padding.
    Source: GE format_transfer_fractal_z.cc (TransFormatFromNchwToFz).
    Raises ValueError: rank != 4 or unsupported src_format.
    """
    src = format_name(src_format)
    _check_rank(w, 4, "to_fractal_z")
    if src == "NHWC":
        w = w.permute(0, 3, 1, 2)
    elif src != "NCHW":
        raise ValueError(f"to_fractal_z: src_format must be NCHW or NHWC, got {src}")
    n, c, kh, kw = w.shape
    k = c0_for(w.dtype, c0)
    c1, n1 = _ceil(c, k), _ceil(n, NI)
    w = F.pad(w, (0, 0, 0, 0, 0, c1 * k - c, 0, n1 * NI - n))
    w = w.reshape(n1, NI, c1, k, kh, kw).permute(2, 4, 5, 0, 1, 3)
    return w.reshape(c1 * kh * kw, n1, NI, k).contiguous()


def from_fractal_z(y: torch.Tensor, shape: Sequence[int], c0: int | None = None,
                   dst_format: Any = "NCHW") -> torch.Tensor:
    """FRACTAL_Z (C1*KH*KW, N1, 16, C0) -> weight of logical `shape` (Cout, Cin, KH, KW) [NCHW].

    Raises ValueError: rank != 4, or storage shape disagrees with `shape`.
    """
    dst = format_name(dst_format)
    if dst not in ("NCHW", "NHWC"):
        raise ValueError(f"from_fractal_z: dst_format must be NCHW or NHWC, got {dst}")
    _check_rank(y, 4, "from_fractal_z")
    _check_rank(shape, 4, "from_fractal_z origin shape")
    expected = format_shape(shape, "FRACTAL_Z", y.dtype, origin_format=dst, c0=c0)
    _check_storage(y, expected, "from_fractal_z", shape, dst)
    n, c, kh, kw = shape if dst == "NCHW" else (shape[0], shape[3], shape[1], shape[2])
    _, n1, _, k = y.shape
    c1 = _ceil(c, k)
    w = y.reshape(c1, kh, kw, n1, NI, k).permute(3, 4, 0, 5, 1, 2)
    w = w.reshape(n1 * NI, c1 * k, kh, kw)[:n, :c]
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
               origin_format: Any = None, c0: int | None = None) -> torch.Tensor:
    """Convert `x` from `src_format` to `dst_format` (CANN's TransData operator).

    Plain -> NPU format needs nothing else.  NPU format -> anything needs `origin_shape`,
    the logical shape, read in `origin_format` (default: `dst_format` when that is plain,
    else 'NCHW' for NC1HWC0/FRACTAL_Z and 'ND' for FRACTAL_NZ).  NPU -> NPU goes through
    the logical tensor.  ND is a relabel of any plain format.

    Raises ValueError: unknown formats, missing `origin_shape`, wrong ranks, shapes that
    disagree with the storage shape.
    """
    src, dst = format_name(src_format), format_name(dst_format)
    if src == dst:
        return x
    if src in NPU_FORMATS:
        if origin_shape is None:
            raise ValueError(f"trans_data({src} -> {dst}): origin_shape is required to undo {src} padding")
        of = format_name(origin_format) if origin_format is not None else (
            dst if dst in PLAIN_FORMATS and dst != "ND" else ("ND" if src == "FRACTAL_NZ" else "NCHW"))
        if src == "NC1HWC0":
            plain = from_nc1hwc0(x, origin_shape, "NHWC" if of == "NHWC" else "NCHW", c0=c0)
        elif src == "FRACTAL_Z":
            plain = from_fractal_z(x, origin_shape, c0=c0, dst_format="NHWC" if of == "NHWC" else "NCHW")
        else:
            plain = from_fractal_nz(x, origin_shape, c0=c0)
        return trans_data(plain, of, dst, c0=c0) if dst != of else plain
    # plain source
    if dst in PLAIN_FORMATS:
        return _plain_to_plain(x, src, dst)
    if dst == "NC1HWC0":
        return to_nc1hwc0(x, "NHWC" if src == "NHWC" else "NCHW", c0=c0)
    if dst == "FRACTAL_Z":
        return to_fractal_z(x, c0=c0, src_format="NHWC" if src == "NHWC" else "NCHW")
    return to_fractal_nz(x, c0=c0)


def valid_mask(origin_shape: Sequence[int], fmt: Any, dtype: Any, origin_format: Any = None,
               c0: int | None = None) -> torch.Tensor:
    """Boolean tensor in `fmt`'s storage shape: True on real elements, False on padding.

    `dtype` is the data's dtype (it decides C0).  Raises ValueError as `format_shape`.
    """
    fmt = format_name(fmt)
    dt = _dtype_of(dtype)
    k = c0_for(dt, c0)
    of = format_name(origin_format) if origin_format is not None else (
        "NCHW" if fmt in ("NC1HWC0", "FRACTAL_Z", "NHWC") else "ND")
    ones = torch.ones(tuple(origin_shape), dtype=torch.bool)
    return trans_data(ones, of, fmt, c0=k)
