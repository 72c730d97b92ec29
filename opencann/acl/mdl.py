"""``acl.mdl``: load an ``.ocm`` model file, describe it, run it on datasets of data
buffers (pyACL's names and returns).

`execute` views each input buffer as the model input's tensor (shape and dtype from
the graph), calls the loaded `CompiledModel` and writes each output into its output
buffer. Input buffers must have exactly the input's byte size, output buffers at
least the output's."""
from __future__ import annotations

import os

import torch
import torch.utils._pytree as pytree

from . import _state as S
from .errors import (ACL_ERROR_DESERIALIZE_MODEL, ACL_ERROR_FAILURE,
                     ACL_ERROR_GE_EXEC_MODEL_DATA_SIZE_INVALID, ACL_ERROR_INVALID_FILE,
                     ACL_ERROR_INVALID_MODEL_ID, ACL_ERROR_INVALID_PARAM,
                     ACL_ERROR_MODEL_INPUT_NOT_MATCH, ACL_ERROR_MODEL_OUTPUT_NOT_MATCH,
                     ACL_ERROR_RT_CONTEXT_NULL, ACL_ERROR_RT_MEMORY_ALLOCATION,
                     ACL_ERROR_RT_PARAM_INVALID, ACL_SUCCESS, fail)
from .types import dtype_to_acl


def _init(api):
    from . import check_init
    return check_init(api)


def load_from_file(model_path: str):
    """(model id, ret): load a file written by `opencann.save` on the current device; its
    weights and activation arena count against the device's memory until `unload`.
    ACL_ERROR_INVALID_FILE (missing), ACL_ERROR_DESERIALIZE_MODEL (not a valid model file),
    ACL_ERROR_RT_MEMORY_ALLOCATION (does not fit)."""
    api = "acl.mdl.load_from_file"
    if _init(api):
        return 0, _init(api)
    if S.current_device is None:
        return 0, fail(ACL_ERROR_RT_CONTEXT_NULL, api, "no current device: call acl.rt.set_device")
    if not isinstance(model_path, (str, os.PathLike)) or not os.path.isfile(model_path):
        return 0, fail(ACL_ERROR_INVALID_FILE, api, f"model file {model_path!r} not found")
    import opencann
    try:
        cm = opencann.load(os.fspath(model_path))
    except ValueError as e:
        return 0, fail(ACL_ERROR_DESERIALIZE_MODEL, api, f"{model_path}: {e}")
    need = model_bytes(cm)
    dev = S.current_device
    with S.lock:
        used, cap = S.device_used.get(dev, 0), S.device_capacity(dev)
        if used + need > cap:
            return 0, fail(ACL_ERROR_RT_MEMORY_ALLOCATION, api, f"the model needs {need} bytes "
                           f"(weights + activation arena), {cap - used} of {cap} are free on device "
                           f"{dev} ({S.device_names[dev]})")
        S.device_used[dev] = used + need
        mid = S.new_handle()
        S.models[mid] = cm
        S.model_mem[mid] = (dev, need)
    return mid, ACL_SUCCESS


def model_bytes(cm) -> int:
    """Device bytes a loaded model holds: its weights plus its activation arena."""
    w = sum(c.const.numel() * c.const.element_size() for c in cm.graph.constants
            if isinstance(c.const, torch.Tensor))
    return int(w) + int(cm.plan.arena_bytes)


def unload(model_id: int) -> int:
    """aclmdlUnload: unload model ``model_id`` and give its device memory back. Returns
    ACL_SUCCESS, or ACL_ERROR_INVALID_MODEL_ID (logged) when it is not loaded."""
    with S.lock:
        if S.models.pop(model_id, None) is None:
            return fail(ACL_ERROR_INVALID_MODEL_ID, "acl.mdl.unload", f"model id {model_id!r} is not "
                        "loaded (unloaded twice?)")
        dev, need = S.model_mem.pop(model_id)
        if dev in S.device_used:
            S.device_used[dev] -= need
    return ACL_SUCCESS


def create_desc() -> int:
    """An empty model description; fill it with `get_desc`."""
    h = S.new_handle()
    S.model_descs[h] = None
    return h


def get_desc(model_desc: int, model_id: int) -> int:
    """aclmdlGetDesc: fill description ``model_desc`` (from ``create_desc``) with loaded model
    ``model_id``'s inputs and outputs. Returns ACL_SUCCESS, ACL_ERROR_INVALID_PARAM for a bad
    description or ACL_ERROR_INVALID_MODEL_ID for a model not loaded (logged)."""
    if model_desc not in S.model_descs:
        return fail(ACL_ERROR_INVALID_PARAM, "acl.mdl.get_desc", f"{model_desc!r} is not a model "
                    "description from acl.mdl.create_desc")
    if model_id not in S.models:
        return fail(ACL_ERROR_INVALID_MODEL_ID, "acl.mdl.get_desc", f"model id {model_id!r} is not loaded")
    S.model_descs[model_desc] = model_id
    return ACL_SUCCESS


def destroy_desc(model_desc: int) -> int:
    """aclmdlDestroyDesc: forget model description ``model_desc``. Returns ACL_SUCCESS, or
    ACL_ERROR_INVALID_PARAM (logged) when it is not live."""
    if model_desc not in S.model_descs:
        return fail(ACL_ERROR_INVALID_PARAM, "acl.mdl.destroy_desc", f"{model_desc!r} is not a "
                    "live model description")
    del S.model_descs[model_desc]
    return ACL_SUCCESS


def _io(cm, outputs: bool):
    g = cm.graph
    if not outputs:
        return list(g.inputs)
    k = len(g.signature.input_mutations)
    return list(g.outputs)[k:]


def _values(model_desc, outputs: bool, api: str):
    mid = S.model_descs.get(model_desc)
    if mid is None or mid not in S.models:
        fail(ACL_ERROR_INVALID_PARAM, api, f"{model_desc!r} is not a model description filled "
             "by acl.mdl.get_desc (of a loaded model)")
        return None
    return _io(S.models[mid], outputs)


def _nbytes(desc) -> int:
    n = 1
    for s in desc.shape:
        n *= int(s)
    return n * torch.empty((), dtype=desc.dtype.torch).element_size()


def get_num_inputs(model_desc: int) -> int:
    """aclmdlGetNumInputs: the model's number of inputs (0 on a bad description, logged)."""
    v = _values(model_desc, False, "acl.mdl.get_num_inputs")
    return 0 if v is None else len(v)


def get_num_outputs(model_desc: int) -> int:
    """aclmdlGetNumOutputs: the model's number of outputs (0 on a bad description, logged)."""
    v = _values(model_desc, True, "acl.mdl.get_num_outputs")
    return 0 if v is None else len(v)


def _size(model_desc, index, outputs, api) -> int:
    v = _values(model_desc, outputs, api)
    if v is None or not isinstance(index, int) or not 0 <= index < len(v):
        if v is not None:
            fail(ACL_ERROR_INVALID_PARAM, api, f"index {index!r} out of range 0..{len(v) - 1}")
        return 0
    return _nbytes(v[index].desc)


def get_input_size_by_index(model_desc: int, index: int) -> int:
    """Byte size of input ``index`` (0 on a bad description or index)."""
    return _size(model_desc, index, False, "acl.mdl.get_input_size_by_index")


def get_output_size_by_index(model_desc: int, index: int) -> int:
    """aclmdlGetOutputSizeByIndex: byte size of output ``index`` (0 on a bad description or index)."""
    return _size(model_desc, index, True, "acl.mdl.get_output_size_by_index")


def _dims(model_desc, index, outputs, api):
    v = _values(model_desc, outputs, api)
    if v is None or not isinstance(index, int) or not 0 <= index < len(v):
        return {}, ACL_ERROR_INVALID_PARAM if v is None else fail(
            ACL_ERROR_INVALID_PARAM, api, f"index {index!r} out of range 0..{len(v) - 1}")
    shape = [int(s) for s in v[index].desc.shape]
    return {"name": v[index].name, "dimCount": len(shape), "dims": shape}, ACL_SUCCESS


def get_input_dims(model_desc: int, index: int):
    """({"name", "dimCount", "dims"}, ret) of input ``index``."""
    return _dims(model_desc, index, False, "acl.mdl.get_input_dims")


def get_output_dims(model_desc: int, index: int):
    """aclmdlGetOutputDims: ({"name", "dimCount", "dims"}, ret) of output ``index``."""
    return _dims(model_desc, index, True, "acl.mdl.get_output_dims")


def get_input_data_type(model_desc: int, index: int) -> int:
    """ACL data type (ACL_FLOAT...) of input ``index``; ACL_DT_UNDEFINED on a bad index."""
    v = _values(model_desc, False, "acl.mdl.get_input_data_type")
    return dtype_to_acl(v[index].desc.dtype.torch) if v and 0 <= index < len(v) else -1


def get_output_data_type(model_desc: int, index: int) -> int:
    """aclmdlGetOutputDataType: ACL data type (ACL_FLOAT...) of output ``index``; ACL_DT_UNDEFINED
    (-1) on a bad description or index."""
    v = _values(model_desc, True, "acl.mdl.get_output_data_type")
    return dtype_to_acl(v[index].desc.dtype.torch) if v and 0 <= index < len(v) else -1


def get_input_name_by_index(model_desc: int, index: int) -> str:
    """aclmdlGetInputNameByIndex: the name of input ``index`` ('' on a bad description or index)."""
    v = _values(model_desc, False, "acl.mdl.get_input_name_by_index")
    return v[index].name if v and 0 <= index < len(v) else ""


def get_output_name_by_index(model_desc: int, index: int) -> str:
    """aclmdlGetOutputNameByIndex: the name of output ``index`` ('' on a bad description or index)."""
    v = _values(model_desc, True, "acl.mdl.get_output_name_by_index")
    return v[index].name if v and 0 <= index < len(v) else ""


# -- datasets -----------------------------------------------------------------------------
def create_dataset() -> int:
    """aclmdlCreateDataset: a new empty dataset (a list of data buffers); returns its handle."""
    h = S.new_handle()
    S.datasets[h] = []
    return h


def add_dataset_buffer(dataset: int, data_buffer: int):
    """(dataset, ret): append a data buffer."""
    if dataset not in S.datasets or data_buffer not in S.data_buffers:
        return dataset, fail(ACL_ERROR_INVALID_PARAM, "acl.mdl.add_dataset_buffer",
                             f"dataset {dataset!r} or data buffer {data_buffer!r} is not live")
    S.datasets[dataset].append(data_buffer)
    return dataset, ACL_SUCCESS


def get_dataset_num_buffers(dataset: int) -> int:
    """aclmdlGetDatasetNumBuffers: the number of data buffers in ``dataset`` (0 for an unknown
    handle)."""
    return len(S.datasets.get(dataset, ()))


def get_dataset_buffer(dataset: int, index: int) -> int:
    """The data buffer at ``index``, 0 if out of range."""
    bufs = S.datasets.get(dataset, [])
    return bufs[index] if isinstance(index, int) and 0 <= index < len(bufs) else 0


def destroy_dataset(dataset: int) -> int:
    """Destroy a dataset (not its data buffers)."""
    if S.datasets.pop(dataset, None) is None:
        return fail(ACL_ERROR_INVALID_PARAM, "acl.mdl.destroy_dataset", f"{dataset!r} is not a "
                    "live dataset (destroyed twice?)")
    return ACL_SUCCESS


def _buffers(dataset, values, exact: bool, api: str, mismatch: int):
    """uint8 views per value, or an error code."""
    if dataset not in S.datasets:
        return fail(ACL_ERROR_INVALID_PARAM, api, f"{dataset!r} is not a live dataset")
    bufs = S.datasets[dataset]
    what = "output" if mismatch == ACL_ERROR_MODEL_OUTPUT_NOT_MATCH else "input"
    if len(bufs) != len(values):
        return fail(mismatch, api, f"the {what} dataset has {len(bufs)} buffers, the model "
                    f"{len(values)} {what}s")
    views = []
    for i, (b, v) in enumerate(zip(bufs, values)):
        if b not in S.data_buffers:
            return fail(ACL_ERROR_INVALID_PARAM, api, f"{what} {i}: data buffer {b!r} was destroyed")
        ptr, size = S.data_buffers[b]
        need = _nbytes(v.desc)
        if size != need if exact else size < need:
            return fail(ACL_ERROR_GE_EXEC_MODEL_DATA_SIZE_INVALID, api,
                        f"{what} {i} ({v.name}, {v.desc}) needs {need} bytes, its data buffer "
                        f"has {size}")
        hit = S.find(ptr, need)
        if hit is None:
            return fail(ACL_ERROR_RT_PARAM_INVALID, api, f"{what} {i}: {need} bytes at {ptr!r} "
                        "are not inside one allocation (freed?)")
        views.append(hit[1])
    return views


def execute(model_id: int, input: int, output: int) -> int:
    """Run model ``model_id`` on the input dataset, writing the output dataset's buffers."""
    api = "acl.mdl.execute"
    if _init(api):
        return _init(api)
    cm = S.models.get(model_id)
    if cm is None:
        return fail(ACL_ERROR_INVALID_MODEL_ID, api, f"model id {model_id!r} is not loaded "
                    "(call acl.mdl.load_from_file first)")
    ins, outs = _io(cm, False), _io(cm, True)
    src = _buffers(input, ins, True, api, ACL_ERROR_MODEL_INPUT_NOT_MATCH)
    if isinstance(src, int):
        return src
    dst = _buffers(output, outs, False, api, ACL_ERROR_MODEL_OUTPUT_NOT_MATCH)
    if isinstance(dst, int):
        return dst
    xs = []
    for raw, v in zip(src, ins):
        raw = raw if raw.data_ptr() % 64 == 0 else raw.clone()
        xs.append(raw.view(v.desc.dtype.torch).reshape(tuple(int(s) for s in v.desc.shape)))
    try:
        with torch.no_grad():
            result = cm(*xs)
    except Exception as e:  # the model's own one-line error
        return fail(ACL_ERROR_FAILURE, api, f"model {model_id}: {e}")
    ys = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
    if len(ys) != len(dst):
        return fail(ACL_ERROR_FAILURE, api, f"model {model_id} returned {len(ys)} tensors, its "
                    f"description {len(dst)} outputs")
    for raw, y in zip(dst, ys):
        raw.copy_(y.contiguous().reshape(-1).view(torch.uint8))
    return ACL_SUCCESS


def execute_async(model_id: int, input: int, output: int, stream: int) -> int:
    """`execute` on ``stream``; done when it returns (acl.rt.synchronize_stream is a no-op)."""
    if stream not in S.streams and stream != 0:
        return fail(ACL_ERROR_INVALID_PARAM, "acl.mdl.execute_async", f"{stream!r} is not a live stream")
    return execute(model_id, input, output)
