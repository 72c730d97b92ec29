"""``acl.rt``: devices, contexts, streams and memory (pyACL's names and returns).

Pointers are ints (real host addresses of the buffers backing "device" memory);
``acl.rt.malloc`` counts bytes against the current device's memory size. Streams run
nothing asynchronously: work submitted to a stream is done when the call returns."""
from __future__ import annotations

import torch

from . import _state as S
from .errors import (ACL_ERROR_BAD_ALLOC, ACL_ERROR_INVALID_PARAM, ACL_ERROR_RT_CONTEXT_NULL,
                     ACL_ERROR_RT_INVALID_DEVICEID, ACL_ERROR_RT_MEMORY_ALLOCATION,
                     ACL_ERROR_RT_PARAM_INVALID, ACL_SUCCESS, check_init, fail)
from .types import (ACL_HOST, ACL_MEMCPY_DEVICE_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST,
                    ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_HOST_TO_HOST)


def _init(api: str) -> int:
    return check_init(api)


def _device_ok(device_id, api: str) -> int:
    rc = _init(api)
    if rc:
        return rc
    if not isinstance(device_id, int) or not 0 <= device_id < len(S.device_names):
        return fail(ACL_ERROR_RT_INVALID_DEVICEID, api, f"device id {device_id!r} does not exist; "
                    f"devices: {dict(enumerate(S.device_names))}")
    return ACL_SUCCESS


def get_device_count():
    """(number of devices, ret)."""
    return len(S.device_names), _init("acl.rt.get_device_count")


def set_device(device_id: int) -> int:
    """Make ``device_id`` current. ACL_ERROR_RT_INVALID_DEVICEID if it does not exist."""
    ret = _device_ok(device_id, "acl.rt.set_device")
    if ret == ACL_SUCCESS:
        S.current_device = device_id
    return ret


def reset_device(device_id: int) -> int:
    """Release ``device_id``'s memory and streams."""
    ret = _device_ok(device_id, "acl.rt.reset_device")
    if ret:
        return ret
    with S.lock:
        for r in S.all_regions():
            if r.device == device_id:
                S.del_region(r)
        # loaded models stay loaded (and counted) until acl.mdl.unload
        S.device_used[device_id] = sum(n for d, n in S.model_mem.values() if d == device_id)
        for h in [h for h, d in S.streams.items() if d == device_id]:
            del S.streams[h]
        if S.current_device == device_id:
            S.current_device = None
    return ACL_SUCCESS


def get_device():
    """(current device id, ret)."""
    if S.current_device is None:
        return -1, fail(ACL_ERROR_RT_CONTEXT_NULL, "acl.rt.get_device", "no current device: "
                        "call acl.rt.set_device")
    return S.current_device, ACL_SUCCESS


def get_run_mode():
    """(ACL_HOST, ret): the application runs on the host."""
    return ACL_HOST, _init("acl.rt.get_run_mode")


def create_context(device_id: int):
    """(context, ret); the context's device becomes current."""
    ret = _device_ok(device_id, "acl.rt.create_context")
    if ret:
        return 0, ret
    h = S.new_handle()
    S.contexts[h] = device_id
    S.current_device = device_id
    return h, ACL_SUCCESS


def destroy_context(context: int) -> int:
    """aclrtDestroyContext: forget ``context`` (from ``create_context``). Returns ACL_SUCCESS, or
    ACL_ERROR_INVALID_PARAM (logged) when it is not live."""
    if S.contexts.pop(context, None) is None:
        return fail(ACL_ERROR_INVALID_PARAM, "acl.rt.destroy_context", f"{context!r} is not a live "
                    "context (destroyed twice?)")
    return ACL_SUCCESS


def set_context(context: int) -> int:
    """aclrtSetCurrentContext: make ``context``'s device the current one. Returns ACL_SUCCESS, or
    ACL_ERROR_INVALID_PARAM (logged) when it is not live."""
    if context not in S.contexts:
        return fail(ACL_ERROR_INVALID_PARAM, "acl.rt.set_context", f"{context!r} is not a live context")
    S.current_device = S.contexts[context]
    return ACL_SUCCESS


def create_stream():
    """(stream, ret) on the current device."""
    if _init("acl.rt.create_stream"):
        return 0, _init("acl.rt.create_stream")
    if S.current_device is None:
        return 0, fail(ACL_ERROR_RT_CONTEXT_NULL, "acl.rt.create_stream", "no current device: "
                       "call acl.rt.set_device first")
    h = S.new_handle()
    S.streams[h] = S.current_device
    return h, ACL_SUCCESS


def synchronize_stream(stream: int) -> int:
    """Wait for the stream's work (all of it is done already: calls run synchronously)."""
    if stream not in S.streams and stream != 0:
        return fail(ACL_ERROR_INVALID_PARAM, "acl.rt.synchronize_stream", f"{stream!r} is not a "
                    "live stream")
    return ACL_SUCCESS


def destroy_stream(stream: int) -> int:
    """aclrtDestroyStream: forget ``stream`` (from ``create_stream``). Returns ACL_SUCCESS, or
    ACL_ERROR_INVALID_PARAM (logged) when it is not live."""
    if S.streams.pop(stream, None) is None:
        return fail(ACL_ERROR_INVALID_PARAM, "acl.rt.destroy_stream", f"{stream!r} is not a live "
                    "stream (destroyed twice?)")
    return ACL_SUCCESS


def _alloc(size, device, api: str):
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        return 0, fail(ACL_ERROR_INVALID_PARAM, api, f"size {size!r} must be a positive int")
    try:
        mem = torch.empty(size, dtype=torch.uint8)
    except RuntimeError as e:
        return 0, fail(ACL_ERROR_BAD_ALLOC, api, f"host allocation of {size} bytes failed: {e}")
    S.add_region(S.Region(mem.data_ptr(), mem, device))
    return mem.data_ptr(), ACL_SUCCESS


def malloc(size: int, policy: int = 0):
    """(device pointer, ret): ``size`` bytes on the current device. ``policy``:
    ACL_MEM_MALLOC_HUGE_FIRST / _HUGE_ONLY / _NORMAL_ONLY (all the same here).
    ACL_ERROR_RT_MEMORY_ALLOCATION when the device's memory would be exceeded."""
    api = "acl.rt.malloc"
    rc = _init(api)
    if rc:
        return 0, rc
    dev = S.current_device
    if dev is None:
        return 0, fail(ACL_ERROR_RT_CONTEXT_NULL, api, "no current device: call acl.rt.set_device")
    if policy not in (0, 1, 2):
        return 0, fail(ACL_ERROR_INVALID_PARAM, api, f"policy {policy!r} is not an "
                       "ACL_MEM_MALLOC_* value")
    with S.lock:
        used, cap = S.device_used.get(dev, 0), S.device_capacity(dev)
        if isinstance(size, int) and used + size > cap:
            return 0, fail(ACL_ERROR_RT_MEMORY_ALLOCATION, api,
                           f"{size} bytes requested, {cap - used} of {cap} free on device {dev} "
                           f"({S.device_names[dev]})")
        ptr, ret = _alloc(size, dev, api)
        if ret == ACL_SUCCESS:
            S.device_used[dev] = used + size
    return ptr, ret


def malloc_host(size: int):
    """(host pointer, ret)."""
    api = "acl.rt.malloc_host"
    ret = _init(api)
    return (0, ret) if ret else _alloc(size, None, api)


def _free(ptr, host: bool, api: str) -> int:
    rc = _init(api)
    if rc:
        return rc
    with S.lock:
        r = S.allocation(ptr)
        if r is None or (r.device is None) != host:
            return fail(ACL_ERROR_INVALID_PARAM, api, f"{ptr!r} is not a live "
                        f"{'host' if host else 'device'} allocation (freed twice, or not "
                        f"from acl.rt.malloc{'_host' if host else ''})")
        S.del_region(r)
        if r.device is not None:
            S.device_used[r.device] -= r.mem.numel()
    return ACL_SUCCESS


def free(dev_ptr: int) -> int:
    """Free device memory from `malloc`. ACL_ERROR_INVALID_PARAM on a double free."""
    return _free(dev_ptr, False, "acl.rt.free")


def free_host(host_ptr: int) -> int:
    """aclrtFreeHost: free host memory from ``malloc_host``. Returns ACL_SUCCESS,
    ACL_ERROR_UNINITIALIZE before ``acl.init``, or ACL_ERROR_INVALID_PARAM (logged) for a
    pointer that is not a live host allocation."""
    return _free(host_ptr, True, "acl.rt.free_host")


def get_mem_info(attr: int = 0):
    """(free bytes, total bytes, ret) of the current device."""
    dev = S.current_device
    if dev is None:
        return 0, 0, fail(ACL_ERROR_RT_CONTEXT_NULL, "acl.rt.get_mem_info", "no current device")
    cap = S.device_capacity(dev)
    return cap - S.device_used.get(dev, 0), cap, ACL_SUCCESS


_KINDS = {ACL_MEMCPY_HOST_TO_HOST: (True, True), ACL_MEMCPY_HOST_TO_DEVICE: (True, False),
          ACL_MEMCPY_DEVICE_TO_HOST: (False, True), ACL_MEMCPY_DEVICE_TO_DEVICE: (False, False)}


def memcpy(dst: int, dest_max: int, src: int, count: int, kind: int) -> int:
    """Copy ``count`` bytes from ``src`` to ``dst`` (``dest_max`` bytes available there).
    ``kind``: ACL_MEMCPY_HOST_TO_DEVICE etc., checked against where the pointers live."""
    api = "acl.rt.memcpy"
    rc = _init(api)
    if rc:
        return rc
    if kind not in _KINDS:
        return fail(ACL_ERROR_INVALID_PARAM, api, f"kind {kind!r} is not an ACL_MEMCPY_* value")
    if not isinstance(count, int) or count < 0 or count > dest_max:
        return fail(ACL_ERROR_INVALID_PARAM, api, f"count {count!r} exceeds dest_max {dest_max!r}")
    s, d = S.find(src, count), S.find(dst, count)
    for what, hit, ptr in (("src", s, src), ("dst", d, dst)):
        if hit is None:
            return fail(ACL_ERROR_RT_PARAM_INVALID, api, f"{what} {ptr!r}: {count} bytes there are "
                        "not inside one allocation (freed, or too small)")
    src_host, dst_host = _KINDS[kind]
    if (s[0].device is None) != src_host or (d[0].device is None) != dst_host:
        where = lambda r: "host" if r.device is None else "device"  # noqa: E731
        return fail(ACL_ERROR_INVALID_PARAM, api, f"kind {kind} does not match: src is {where(s[0])}"
                    f" memory, dst is {where(d[0])} memory")
    # overlapping ranges are copied as memmove does (through a temporary)
    same = s[0] is d[0] and abs(src - dst) < count
    d[1].copy_(s[1].clone() if same else s[1])
    return ACL_SUCCESS


def memset(dev_ptr: int, max_size: int, value: int, count: int) -> int:
    """aclrtMemset: set ``count`` bytes at ``dev_ptr`` to ``value`` (a byte, 0..255).
    ACL_ERROR_INVALID_PARAM (logged) for another value or a range outside one allocation."""
    api = "acl.rt.memset"
    rc = _init(api)
    if rc:
        return rc
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
        return fail(ACL_ERROR_INVALID_PARAM, api, f"value {value!r} is not a byte (0..255)")
    hit = S.find(dev_ptr, count) if isinstance(count, int) and count <= max_size else None
    if hit is None:
        return fail(ACL_ERROR_INVALID_PARAM, "acl.rt.memset", f"{count!r} bytes at {dev_ptr!r} are "
                    "not inside one allocation (or exceed max_size)")
    hit[1].fill_(value)
    return ACL_SUCCESS
