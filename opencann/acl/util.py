"""``acl.util``: numpy arrays and bytes as pointers, and back (pyACL's helpers).

`numpy_to_ptr` returns the array's own address and registers it as host memory for as
long as the array lives: as in pyACL, the caller keeps the array alive while the pointer
is used, and the facade holds no reference (a served request's arrays are freed with it).
A view registers the whole (writable, contiguous) buffer it views, so pointers into
``images`` and ``images[1]`` address the same bytes for as long as any of them lives;
regions may nest and share a base (`_state.find` takes one holding the whole range).
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


def _register(base: int, mem: torch.Tensor, keep, source) -> int:
    """Register ``mem`` at ``base``, kept alive (with ``source``) by ``keep`` until
    `acl.finalize`, unless ``source`` (a bytearray addressed in place) is registered already."""
    with S.lock:
        if source is None or not any(isinstance(r.keep, tuple) and r.keep[1] is source
                                     for r in S.regions.get(base, ())):
            S.add_region(S.Region(base, mem, None, owned=False, keep=(keep, source)))
    return base


def _buffer_of(array: np.ndarray) -> np.ndarray:
    """The array whose memory to register for ``array``: the outermost ndarray it is a view
    of (``images`` for ``images[1]``) when that one is writable and spans contiguous memory,
    so every view of one buffer addresses the whole buffer for as long as it lives; else
    ``array`` (a view of a read-only buffer is addressed through a copy of the view only)."""
    top = array
    while isinstance(top.base, np.ndarray):
        top = top.base
    if top is not array and top.flags.writeable and (top.flags.c_contiguous
                                                     or top.flags.f_contiguous):
        return top
    return array


class _Borrowed(S.Region):
    """A numpy array's memory (all of it, in memory order), addressable while the array
    lives: a weak reference, and the region is dropped when the array is freed. A
    read-only array is addressed through a copy, dropped with the array too."""

    def __init__(self, array: np.ndarray):
        super().__init__(array.ctypes.data, torch.empty(0, dtype=torch.uint8), None, owned=False)
        self._ref = weakref.ref(array)
        self._copy = None if array.flags.writeable else torch.from_numpy(_raw(array).copy())
        weakref.finalize(array, _drop, self)

    def array(self):
        """The registered array, None once it is freed."""
        return self._ref()

    @property
    def mem(self) -> torch.Tensor:
        if self._copy is not None:
            return self._copy
        a = self._ref()
        if a is None:
            return torch.empty(0, dtype=torch.uint8)
        return torch.from_numpy(_raw(a))

    @mem.setter
    def mem(self, value) -> None:   # the dataclass __init__ assigns it
        pass


def _raw(array: np.ndarray) -> np.ndarray:
    """The bytes of a C- or F-contiguous array in memory order (a uint8 view)."""
    return array.reshape(-1, order="A").view(np.uint8)


def _drop(region: S.Region) -> None:
    with S.lock:
        if any(r is region for r in S.regions.get(region.base, ())):
            S.del_region(region)


def numpy_to_ptr(array: np.ndarray) -> int:
    """The address of a C-contiguous numpy array's data, usable as a host pointer for as long
    as the array (or the buffer it views) lives. A view registers the buffer it views, so
    pointers into ``images`` and into ``images[1]`` address the same bytes and ``p + k``
    reaches any byte of the buffer; an array inside an acl allocation registers nothing."""
    if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
        fail(ACL_ERROR_INVALID_PARAM, "acl.util.numpy_to_ptr", "needs a C-contiguous numpy array "
             "(np.ascontiguousarray)")
        return 0
    base = array.ctypes.data
    if array.nbytes == 0:
        return base
    top = _buffer_of(array)
    with S.lock:
        if any(isinstance(r, _Borrowed) and r.array() is top
               for r in S.regions.get(top.ctypes.data, ())):
            return base   # this buffer is registered already
        hit = S.find(base, array.nbytes)
        if hit is not None and not isinstance(hit[0], _Borrowed):
            return base   # inside an acl allocation (ptr_to_numpy's array) or bytes_to_ptr's
        S.add_region(_Borrowed(top))
    return base


def bytes_to_ptr(data) -> int:
    """The address of a ``bytes``/``bytearray``'s data (bytes are copied once to a
    writable buffer, since pyACL's writes into bytes would be undefined)."""
    if not isinstance(data, (bytes, bytearray)):
        fail(ACL_ERROR_INVALID_PARAM, "acl.util.bytes_to_ptr", f"needs bytes or a bytearray, got "
             f"{type(data).__name__}")
        return 0
    arr = np.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=np.uint8)
    return _register(arr.ctypes.data, torch.from_numpy(arr), arr,
                     data if isinstance(data, bytearray) else None)


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
