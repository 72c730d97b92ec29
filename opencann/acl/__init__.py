"""An AscendCL-style facade over opencann, with pyACL's names and calling conventions.

    import opencann.acl as acl
    ret = acl.init()                                   # 0 == acl.ACL_SUCCESS
    ret = acl.rt.set_device(0)
    model_id, ret = acl.mdl.load_from_file("m.ocm")    # a file written by opencann.save
    ptr, ret = acl.rt.malloc(size, acl.ACL_MEM_MALLOC_HUGE_FIRST)
    ...                                                # datasets of data buffers
    ret = acl.mdl.execute(model_id, input_dataset, output_dataset)

Every call returns an ``int`` code (`errors`; ``ACL_SUCCESS == 0``) or a ``(value,
code)`` tuple where pyACL does, and logs why at ERROR on failure; none raises for
misuse. Submodules: `rt` (devices, contexts, streams, memory), `mdl` (models, model
descriptions, datasets), `op` (single-op mode), `util` (numpy/bytes <-> pointers).

Devices: ``acl.init(config_path)`` takes an optional JSON file ``{"devices": ["vnpu:ascend310",
"cpu"]}`` (device id = index); else ``OPENCANN_ACL_DEVICES`` (comma-separated), else one
device, ``vnpu`` (ascend910b). Device memory is host memory counted against the device's
size (a vnpu preset's ``hbm_bytes``; host RAM for ``cpu``). Sources: CANN pyACL API
reference (acl.init, acl.rt.*, acl.mdl.*, acl.op.execute_v2), ``acl_base.h``."""
from __future__ import annotations

import json
import os

from . import _state as S
from .errors import *  # noqa: F401,F403  (the ACL_* codes)
from .errors import (ACL_ERROR_INVALID_PARAM, ACL_ERROR_REPEAT_FINALIZE,
                     ACL_ERROR_REPEAT_INITIALIZE, ACL_ERROR_UNINITIALIZE, ACL_SUCCESS, check_init,
                     fail)
from .types import *  # noqa: F401,F403  (memory, memcpy, data type and format constants)
from .types import ACL_FORMAT_ND, ACL_DT_UNDEFINED, dtype_to_acl, acl_to_dtype  # noqa: F401

DEFAULT_DEVICES = ("vnpu",)


def init(config_path: str = "") -> int:
    """Initialize the facade. ``config_path``: "" or a JSON file (``{"devices": [...]}``).
    Returns ACL_SUCCESS, ACL_ERROR_REPEAT_INITIALIZE, ACL_ERROR_INVALID_FILE /
    ACL_ERROR_PARSE_FILE (config) or ACL_ERROR_INVALID_PARAM (unknown device)."""
    from .errors import ACL_ERROR_INVALID_FILE, ACL_ERROR_PARSE_FILE
    with S.lock:
        if S.initialized:
            return fail(ACL_ERROR_REPEAT_INITIALIZE, "acl.init", "already initialized; call "
                        "acl.finalize first")
        devices = list(DEFAULT_DEVICES)
        env = os.environ.get("OPENCANN_ACL_DEVICES", "").strip()
        if env:
            devices = [d.strip() for d in env.split(",") if d.strip()]
        if config_path:
            if not os.path.isfile(config_path):
                return fail(ACL_ERROR_INVALID_FILE, "acl.init", f"config file {config_path!r} "
                            "not found")
            try:
                with open(config_path) as f:
                    cfg = json.load(f)
            except (OSError, ValueError) as e:
                return fail(ACL_ERROR_PARSE_FILE, "acl.init", f"config {config_path!r} is not "
                            f"JSON: {e}")
            devices = list(cfg.get("devices", devices)) if isinstance(cfg, dict) else devices
        from ..devices import parse_device
        parsed = []
        for d in devices:
            try:   # ValueError naming the presets
                parsed.append(parse_device(d) if d == "cpu" else parse_device(d, kind="vnpu"))
            except ValueError as e:
                return fail(ACL_ERROR_INVALID_PARAM, "acl.init", f"device {d!r}: {e} (or 'cpu')")
        S.reset()
        S.device_names[:] = devices
        S.devices[:] = parsed
        S.initialized = True
        return ACL_SUCCESS


def finalize() -> int:
    """Release everything (models, memory, handles). Returns ACL_SUCCESS,
    ACL_ERROR_REPEAT_FINALIZE (after a finalize) or ACL_ERROR_UNINITIALIZE."""
    with S.lock:
        if not S.initialized:
            if S.finalized_once:
                return fail(ACL_ERROR_REPEAT_FINALIZE, "acl.finalize", "already finalized")
            return fail(ACL_ERROR_UNINITIALIZE, "acl.finalize", "acl.init was not called")
        S.reset()
        S.initialized, S.finalized_once = False, True
        return ACL_SUCCESS


# -- data buffers -------------------------------------------------------------------------
def create_data_buffer(data: int, size: int) -> int:
    """A data buffer handle over ``size`` bytes at pointer ``data`` (0 on bad arguments)."""
    if check_init("acl.create_data_buffer") or not isinstance(data, int) or \
            not isinstance(size, int) or size < 0:
        if S.initialized:
            fail(ACL_ERROR_INVALID_PARAM, "acl.create_data_buffer", f"data {data!r} and size "
                 f"{size!r} must be a pointer and a byte count")
        return 0
    h = S.new_handle()
    S.data_buffers[h] = (data, size)
    return h


def destroy_data_buffer(data_buffer: int) -> int:
    """Destroy a data buffer handle (not the memory it points at)."""
    if S.data_buffers.pop(data_buffer, None) is None:
        return fail(ACL_ERROR_INVALID_PARAM, "acl.destroy_data_buffer",
                    f"{data_buffer!r} is not a live data buffer (destroyed twice?)")
    return ACL_SUCCESS


def get_data_buffer_addr(data_buffer: int) -> int:
    """The pointer of a data buffer, 0 if the handle is unknown."""
    return S.data_buffers.get(data_buffer, (0, 0))[0]


def get_data_buffer_size_v2(data_buffer: int) -> int:
    """The size in bytes of a data buffer, 0 if the handle is unknown."""
    return S.data_buffers.get(data_buffer, (0, 0))[1]


get_data_buffer_size = get_data_buffer_size_v2


# -- tensor descriptions (single-op mode) ------------------------------------------------
def create_tensor_desc(data_type: int, dims, format: int = ACL_FORMAT_ND) -> int:
    """A tensor description handle: ACL data type (ACL_FLOAT...), dims (list of ints)
    and format. 0 on bad arguments."""
    if acl_to_dtype(data_type) is None or not all(isinstance(d, int) and d >= 0 for d in dims):
        fail(ACL_ERROR_INVALID_PARAM, "acl.create_tensor_desc", f"data type {data_type!r} or "
             f"dims {dims!r} invalid")
        return 0
    h = S.new_handle()
    S.tensor_descs[h] = (data_type, tuple(dims), format)
    return h


def destroy_tensor_desc(desc: int) -> int:
    """aclDestroyTensorDesc: forget tensor description ``desc`` (from ``create_tensor_desc``).
    Returns ACL_SUCCESS, or ACL_ERROR_INVALID_PARAM (logged) when it is not live."""
    if S.tensor_descs.pop(desc, None) is None:
        return fail(ACL_ERROR_INVALID_PARAM, "acl.destroy_tensor_desc", f"{desc!r} is not a "
                    "live tensor description")
    return ACL_SUCCESS


def _tensor_desc(desc: int, api: str):
    d = S.tensor_descs.get(desc)
    if d is None:
        fail(ACL_ERROR_INVALID_PARAM, api, f"{desc!r} is not a live tensor description")
    return d


def get_tensor_desc_type(desc: int) -> int:
    """aclGetTensorDescType: the ACL data type of ``desc`` (ACL_DT_UNDEFINED if not live)."""
    d = _tensor_desc(desc, "acl.get_tensor_desc_type")
    return ACL_DT_UNDEFINED if d is None else d[0]


def get_tensor_desc_num_dims(desc: int) -> int:
    """aclGetTensorDescNumDims: the number of dims of ``desc`` (0 if not live)."""
    d = _tensor_desc(desc, "acl.get_tensor_desc_num_dims")
    return 0 if d is None else len(d[1])


def get_tensor_desc_dim_v2(desc: int, index: int):
    """aclGetTensorDescDimV2: (dim ``index`` of ``desc``, ret)."""
    d = _tensor_desc(desc, "acl.get_tensor_desc_dim_v2")
    if d is None or not isinstance(index, int) or not 0 <= index < len(d[1]):
        if d is not None:
            fail(ACL_ERROR_INVALID_PARAM, "acl.get_tensor_desc_dim_v2", f"index {index!r} out of "
                 f"range 0..{len(d[1]) - 1}")
        return -1, ACL_ERROR_INVALID_PARAM
    return int(d[1][index]), ACL_SUCCESS


from . import rt, mdl, op, util  # noqa: E402,F401
from .guard import guard_module as _guard_module  # noqa: E402

for _m, _p in ((rt, "acl.rt"), (mdl, "acl.mdl"), (op, "acl.op"), (util, "acl.util")):
    _guard_module(_m, _p)
_guard_module(__import__(__name__, fromlist=["_"]), "acl")
