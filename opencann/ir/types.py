"""Tensor descriptions of the IR: data types, storage formats and `TensorDesc`.

Names follow CANN's GE (``ge::DataType``, ``ge::Format``, ``ge::TensorDesc``): a tensor
has a logical *origin* shape/format (what the framework sees) and a storage
shape/format (what the device stores, e.g. NC1HWC0 on an Ascend-style NPU).
Source: CANN "Graph Engine" developer guide, sections on Format and TensorDesc.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import Tuple, Union

import torch

Dim = Union[int, str]  # an int, or a symbol name such as "batch" or "seq"


def numel(shape) -> int:
    """Number of elements of ``shape`` (a sequence of ints or int-like sizes; () -> 1).
    Raises TypeError/ValueError for a symbolic size that is not bound to an int."""
    return math.prod(int(s) for s in shape)


class DataType(enum.Enum):
    """Element types, with their torch equivalents and sizes in bytes."""

    FLOAT = "float32"
    FLOAT16 = "float16"
    BF16 = "bfloat16"
    DOUBLE = "float64"
    INT8 = "int8"
    UINT8 = "uint8"
    INT16 = "int16"
    INT32 = "int32"
    INT64 = "int64"
    BOOL = "bool"
    COMPLEX64 = "complex64"

    @property
    def torch(self) -> torch.dtype:
        """The torch dtype of the same name (``DataType.FLOAT.torch`` is torch.float32)."""
        return getattr(torch, self.value)

    @property
    def itemsize(self) -> int:
        """Bytes per element (torch's ``element_size``: 4 for float32, 1 for bool)."""
        return self.torch.itemsize

    @property
    def is_floating(self) -> bool:
        """True for float16, bfloat16, float32 and float64 (torch's ``is_floating_point``)."""
        return self.torch.is_floating_point

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> "DataType":
        """Map a torch dtype; raises ValueError for dtypes the IR does not model."""
        name = str(dtype).replace("torch.", "")
        try:
            return cls(name)
        except ValueError:
            raise ValueError(
                f"unsupported dtype {dtype}: opencann's IR models "
                f"{', '.join(d.value for d in cls)}; cast the tensor before compiling"
            ) from None

    def __repr__(self) -> str:
        return self.value


class Format(enum.Enum):
    """Storage formats (``ge::Format``). NC1HWC0 splits C into C1 blocks of C0 (16 for
    fp16); FRACTAL_Z and FRACTAL_NZ store conv weights / matrices as 16×C0 fractals."""

    ND = "ND"
    NCHW = "NCHW"
    NHWC = "NHWC"
    NC1HWC0 = "NC1HWC0"
    FRACTAL_Z = "FRACTAL_Z"
    FRACTAL_NZ = "FRACTAL_NZ"

    def __repr__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TensorDesc:
    """Shape (ints or symbol names), dtype and format of one tensor.

    ``origin_shape``/``origin_format`` keep the framework-visible view when the storage
    format differs (after TransData). For ND/NCHW tensors they equal shape/format.
    """

    shape: Tuple[Dim, ...]
    dtype: DataType
    format: Format = Format.ND
    origin_shape: Tuple[Dim, ...] | None = None
    origin_format: Format | None = None

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(self.shape))
        if self.origin_shape is None:
            object.__setattr__(self, "origin_shape", self.shape)
        if self.origin_format is None:
            object.__setattr__(self, "origin_format", self.format)

    @classmethod
    def of(cls, t: torch.Tensor, fmt: Format = Format.ND) -> "TensorDesc":
        """The description of tensor ``t``: its shape (ints), dtype and the storage
        format ``fmt`` (default ND). Raises ValueError for a dtype the IR does not model."""
        return cls(tuple(int(s) for s in t.shape), DataType.from_torch(t.dtype), fmt)

    @property
    def rank(self) -> int:
        """Number of dimensions (of the storage shape)."""
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        """True when every dimension is an int (no symbol names)."""
        return all(isinstance(d, int) for d in self.shape)

    @property
    def numel(self) -> int:
        """Number of elements; raises ValueError for a symbolic shape."""
        if not self.is_static:
            raise ValueError(f"shape {self.shape} is symbolic; bind the symbols first")
        return numel(self.shape)

    @property
    def nbytes(self) -> int:
        """Storage bytes: ``numel`` (of the storage shape, padding included) x
        ``dtype.itemsize``. Raises ValueError for a symbolic shape."""
        return self.numel * self.dtype.itemsize

    def with_(self, **kw) -> "TensorDesc":
        """A copy with the given fields replaced (``desc.with_(dtype=DataType.FLOAT16)``);
        ``origin_shape``/``origin_format`` are kept unless given."""
        return replace(self, **kw)

    def __str__(self) -> str:
        dims = ",".join(str(d) for d in self.shape)
        fmt = "" if self.format in (Format.ND, Format.NCHW) else f"@{self.format.value}"
        return f"{self.dtype.value}[{dims}]{fmt}"


def is_dense(shape, strides) -> bool:
    """True if ``strides`` (elements) lay ``shape`` out densely: a permutation of the
    contiguous layout, size-1 dims ignored (no gaps, no overlap, no stride 0)."""
    expect = 1
    for st, sz in sorted((st, sz) for st, sz in zip(strides, shape) if sz != 1):
        if st != expect:
            return False
        expect *= sz
    return True
