"""``acl.util``: numpy arrays and bytes as pointers, and back (pyACL's helpers).

`numpy_to_ptr` returns the array's own address and registers it as host memory for as
long as the array lives: as in pyACL, the caller keeps the array alive while the pointer
is used, and the facade holds no reference (a served request's arrays are freed with it).
`bytes_to_ptr` copies immutable ``bytes`` once into a buffer the pointer addresses (kept
until `acl.finalize`; a ``bytearray`` is addressed in place for as long as the facade
runs). `ptr_to_numpy` returns an array sharing the memory at a pointer."""
from __future__ import annotations

import weakref

import numpy as np
import torch

from . import _state as S
from .errors import ACL_ERROR_INVALID_PARAM, fail

# numpy type numbers (NPY_TYPES), as pyACL's ptr_to_numpy takes them
NPY_BOOL, NPY_INT8, NPY_UINT8, NPY_INT16, NPY_UINT16, NPY_INT32, NPY_UINT32 = 0, 1, 2, 3, 4, 5, 6
NPY_INT64, NPY_UINT64, NPY_FLOAT32, NPY_FLOAT64, NPY_FLOAT16 = 7, 8, 11, 12, 23
_NPY = {NPY_BOOL: np.bool_, NPY_INT8: np.int8, NPY_UINT8: np.uint8, NPY_INT16: np.int16,
        NPY_UINT16: np.uint16, NPY_INT32: np.int32, NPY_UINT32: np.uint32, NPY_INT64: np.int64,
        NPY_UINT64: np.uint64, NPY_FLOAT32: np.float32, NPY_FLOAT64: np.float64,
        NPY_FLOAT16: np.float16}


def _register(base: int, mem: torch.Tensor, keep) -> int:
    with S.lock:
        r = S.regions.get(base)
        if r is not None and r.owned and r.keep is None:
            return base   # already an acl allocation (e.g. ptr_to_numpy's array)
        S.add_region(S.Region(base, mem, None, owned=False, keep=keep))
    return base


class _Borrowed(S.Region):
    """A numpy array's memory, addressable while the array lives: a weak reference, and
    the region is dropped when the array is freed. A read-only array is addressed through
    a copy, dropped with the array too."""

    def __init__(self, base: int, array: np.ndarray):
        super().__init__(base, torch.empty(0, dtype=torch.uint8), None, owned=False)
        self._ref = weakref.ref(array)
        flat = array.reshape(-1).view(np.uint8)
        self._copy = None if array.flags.writeable else torch.from_numpy(flat.copy())
        weakref.finalize(array, _drop, base, id(self))

    @property
    def mem(self) -> torch.Tensor:
        if self._copy is not None:
            return self._copy
        a = self._ref()
        if a is None:
            return torch.empty(0, dtype=torch.uint8)
        return torch.from_numpy(a.reshape(-1).view(np.uint8))

    @mem.setter
    def mem(self, value) -> None:   # the dataclass __init__ assigns it
        pass


def _drop(base: int, token: int) -> None:
    with S.lock:
        r = S.regions.get(base)
        if r is not None and id(r) == token:
            S.del_region(base)


def numpy_to_ptr(array: np.ndarray) -> int:
    """The address of a C-contiguous numpy array's data, usable as a host pointer."""
    if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
        fail(ACL_ERROR_INVALID_PARAM, "acl.util.numpy_to_ptr", "needs a C-contiguous numpy array "
             "(np.ascontiguousarray)")
        return 0
    base = array.ctypes.data
    if array.nbytes == 0:
        return base
    with S.lock:
        r = S.regions.get(base)
        if r is not None and r.owned and r.keep is None:
            return base   # already an acl allocation (e.g. ptr_to_numpy's array)
        S.add_region(_Borrowed(base, array))
    return base


def bytes_to_ptr(data) -> int:
    """The address of a ``bytes``/``bytearray``'s data (bytes are copied once to a
    writable buffer, since pyACL's writes into bytes would be undefined)."""
    if not isinstance(data, (bytes, bytearray)):
        fail(ACL_ERROR_INVALID_PARAM, "acl.util.bytes_to_ptr", f"needs bytes or a bytearray, got "
             f"{type(data).__name__}")
        return 0
    arr = np.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=np.uint8)
    return _register(arr.ctypes.data, torch.from_numpy(arr), arr)


def ptr_to_bytes(ptr: int, size: int) -> bytes:
    """A copy of ``size`` bytes at ``ptr`` (b"" if not inside one allocation)."""
    hit = S.find(ptr, size)
    if hit is None:
        fail(ACL_ERROR_INVALID_PARAM, "acl.util.ptr_to_bytes", f"{size!r} bytes at {ptr!r} are not "
             "inside one allocation")
        return b""
    return hit[1].numpy().tobytes()


def ptr_to_numpy(ptr: int, shape, np_type) -> np.ndarray:
    """An array of ``shape`` and ``np_type`` (a numpy type number such as NPY_FLOAT32 = 11,
    or a numpy dtype) sharing the memory at ``ptr``; None if it does not fit."""
    if isinstance(np_type, int) and np_type not in _NPY:
        fail(ACL_ERROR_INVALID_PARAM, "acl.util.ptr_to_numpy", f"unknown numpy type number {np_type}")
        return None
    dtype = np.dtype(_NPY[np_type]) if isinstance(np_type, int) else np.dtype(np_type)
    n = int(np.prod(shape)) * dtype.itemsize
    hit = S.find(ptr, n)
    if hit is None:
        fail(ACL_ERROR_INVALID_PARAM, "acl.util.ptr_to_numpy", f"{n} bytes at {ptr!r} are not "
             "inside one allocation")
        return None
    return hit[1].numpy().view(dtype).reshape(shape)
