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


_bases: List[int] = []
regions: Dict[int, Region] = {}


def add_region(r: Region) -> None:
    """Register byte range ``r`` at ``r.base`` (replacing a region at the same base), kept sorted
    for `find`."""
    if r.base in regions:
        del_region(r.base)
    bisect.insort(_bases, r.base)
    regions[r.base] = r


def del_region(base: int) -> None:
    """Forget the region at ``base``. Raises KeyError when there is none."""
    regions.pop(base)
    _bases.pop(bisect.bisect_left(_bases, base))


def find(ptr: int, nbytes: int) -> Optional[tuple]:
    """(region, uint8 view of ``nbytes`` at ``ptr``) or None if not all inside one region."""
    if not isinstance(ptr, int) or isinstance(ptr, bool):
        return None
    i = bisect.bisect_right(_bases, ptr) - 1
    if i < 0:
        return None
    r = regions[_bases[i]]
    off = ptr - r.base
    if nbytes < 0 or off + nbytes > r.mem.numel():
        return None
    return r, r.mem[off:off + nbytes]


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
