"""The facade's process state: devices, allocations (integer "pointers"), handles.

Device memory is host memory (torch uint8 tensors) addressed by its real address, so
a pointer is an ``int`` as in pyACL and ``ptr + offset`` addresses inside a buffer.
Allocations on a device count against that device's memory size."""
from __future__ import annotations

import bisect
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from ..devices import Device

lock = threading.RLock()
initialized = False
finalized_once = False
device_names: List[str] = []        # device id -> opencann device ("cpu", "vnpu:ascend310")
devices: List[Device] = []          # device id -> its `Device` (parsed once, by acl.init)
device_used: Dict[int, int] = {}     # device id -> bytes malloc'ed
current_device: Optional[int] = None
contexts: Dict[int, int] = {}        # context handle -> device id
streams: Dict[int, int] = {}         # stream handle -> device id
data_buffers: Dict[int, tuple] = {}  # handle -> (ptr, size)
datasets: Dict[int, List[int]] = {}  # handle -> data buffer handles
models: Dict[int, Any] = {}          # model id -> CompiledModel
model_mem: Dict[int, tuple] = {}     # model id -> (device id, bytes counted)
model_descs: Dict[int, Optional[int]] = {}  # desc handle -> model id (None before get_desc)
model_shapes: Dict[int, Any] = {}    # model id -> acl.model_shapes.ModelShapes
dataset_values: Dict[int, Dict[str, int]] = {}   # input dataset -> gear set by set_dynamic_*
dataset_descs: Dict[int, Dict[int, int]] = {}    # dataset -> {index: tensor desc} (dynamic shapes)
model_values: Dict[int, Dict[str, int]] = {}     # model id -> the last execution's dim values
tensor_descs: Dict[int, tuple] = {}  # handle -> (acl dtype, dims, format)
attrs: Dict[int, Dict[str, Any]] = {}
_handles = itertools.count(0x10000)


def new_handle() -> int:
    """A fresh opaque handle (an int from 0x10000 up, never reused in the process)."""
    return next(_handles)


@dataclass
class Region:
    """One addressable byte range: ``mem`` (uint8 tensor), ``device`` (id or None for
    host memory), ``owned`` (malloc'ed here, so it may be freed), ``keep`` (an object
    kept alive for a borrowed range, e.g. a numpy array)."""
    base: int
    mem: torch.Tensor
    device: Optional[int]
    owned: bool = True
    keep: Any = field(default=None, repr=False)


_bases: List[int] = []               # the bases of `regions`, sorted, each once
regions: Dict[int, List[Region]] = {}   # base -> the regions starting there


def add_region(r: Region) -> None:
    """Register byte range ``r``. Regions may overlap or nest (two arrays over one buffer,
    a view inside an allocation) and share a base: each stays addressable until
    `del_region` drops it, and `find` takes any one holding a whole range."""
    at = regions.get(r.base)
    if at is None:
        bisect.insort(_bases, r.base)
        regions[r.base] = at = []
    at.append(r)


def del_region(r: Region) -> None:
    """Forget region ``r`` (this object; others at its base stay). Raises ValueError when
    it is not registered."""
    at = regions.get(r.base, [])
    k = next((i for i, x in enumerate(at) if x is r), None)   # identity: Region has no ==
    if k is None:
        raise ValueError(f"no region {r!r} is registered")
    del at[k]
    if not at:
        del regions[r.base]
        _bases.pop(bisect.bisect_left(_bases, r.base))


def allocation(ptr: Any) -> Optional[Region]:
    """The allocation (``owned`` region: acl.rt.malloc / malloc_host) starting at ``ptr``,
    or None."""
    if not isinstance(ptr, int) or isinstance(ptr, bool):
        return None
    return next((r for r in regions.get(ptr, ()) if r.owned), None)


def all_regions() -> List[Region]:
    """Every registered region (a copy of the list: callers may drop some)."""
    return [r for at in regions.values() for r in at]


def find(ptr: int, nbytes: int) -> Optional[tuple]:
    """(region, uint8 view of ``nbytes`` at ``ptr``) from a region holding all of
    [ptr, ptr + nbytes) — the nearest base at or below ``ptr`` first, then lower ones (an
    enclosing buffer behind a registered view of it) — or None if no region holds it all."""
    if not isinstance(ptr, int) or isinstance(ptr, bool) or not isinstance(nbytes, int) \
            or isinstance(nbytes, bool) or nbytes < 0:
        return None
    for i in range(bisect.bisect_right(_bases, ptr) - 1, -1, -1):
        for r in reversed(regions[_bases[i]]):   # the latest registered first
            mem = r.mem
            off = ptr - r.base
            if off + nbytes <= mem.numel():
                return r, mem[off:off + nbytes]
    return None


def device_capacity(dev: int) -> int:
    """Memory size of device ``dev`` in bytes: the vnpu preset's HBM, or host RAM."""
    return devices[dev].memory_bytes


def reset() -> None:
    """Drop every allocation and handle (`acl.finalize`)."""
    global current_device
    for d in (device_used, contexts, streams, data_buffers, datasets, models, model_mem, model_descs,
              model_shapes, dataset_values, dataset_descs, model_values, tensor_descs, attrs,
              regions):
        d.clear()
    _bases.clear()
    current_device = None
