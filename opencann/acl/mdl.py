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
                     ACL_ERROR_RT_PARAM_INVALID, ACL_SUCCESS, check_init, fail)
from .model_shapes import ACL_DYNAMIC_TENSOR_NAME, GEAR_SETTERS, ModelShapes, described
from .types import ACL_FORMAT_ND, dtype_to_acl


def _init(api):
    return check_init(api)


def load_from_file(model_path: str):
    """(model id, ret): load a file written by `opencann.save` on the current device; its
    weights and activation arena count against the device's memory until `unload`.
    ACL_ERROR_INVALID_FILE (missing), ACL_ERROR_DESERIALIZE_MODEL (not a valid model file),
    ACL_ERROR_RT_MEMORY_ALLOCATION (does not fit)."""
    api = "acl.mdl.load_from_file"
    rc = _init(api)
    if rc:
        return 0, rc
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
        S.model_shapes[mid] = ModelShapes(cm)
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
        S.model_shapes.pop(model_id, None)
        S.model_values.pop(model_id, None)
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


def _count(shapes: ModelShapes, outputs: bool) -> int:
    return len(shapes.outputs) if outputs else shapes.num_inputs()


def _index_ok(shapes, index, outputs: bool, api: str) -> bool:
    """Whether ``index`` names an input/output (else logged)."""
    if shapes is None:
        return False
    n = _count(shapes, outputs)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
        fail(ACL_ERROR_INVALID_PARAM, api, f"index {index!r} out of range 0..{n - 1}")
        return False
    return True


def get_num_inputs(model_desc: int) -> int:
    """aclmdlGetNumInputs: the model's number of inputs, the dynamic-index input of a model
    with gears included (0 on a bad description, logged)."""
    v = described(model_desc, "acl.mdl.get_num_inputs")
    return 0 if v is None else v.num_inputs()


def get_num_outputs(model_desc: int) -> int:
    """aclmdlGetNumOutputs: the model's number of outputs (0 on a bad description, logged)."""
    v = described(model_desc, "acl.mdl.get_num_outputs")
    return 0 if v is None else len(v.outputs)


def _size(model_desc, index, outputs, api) -> int:
    v = described(model_desc, api)
    return v.nbytes(index, outputs) if _index_ok(v, index, outputs, api) else 0


def get_input_size_by_index(model_desc: int, index: int) -> int:
    """aclmdlGetInputSizeByIndex: byte size of input ``index`` — with dynamic dims at the
    largest gear (or the top of the dims' ranges; 0 when a range is unbounded); 0 on a bad
    description or index."""
    return _size(model_desc, index, False, "acl.mdl.get_input_size_by_index")


def get_output_size_by_index(model_desc: int, index: int) -> int:
    """aclmdlGetOutputSizeByIndex: byte size of output ``index`` (at the largest gear with
    dynamic dims; 0 on a bad description or index)."""
    return _size(model_desc, index, True, "acl.mdl.get_output_size_by_index")


def _dims(model_desc, index, outputs, api):
    v = described(model_desc, api)
    if not _index_ok(v, index, outputs, api):
        return {}, ACL_ERROR_INVALID_PARAM
    shape = v.described_dims(index, outputs)
    return {"name": v.name(index, outputs), "dimCount": len(shape), "dims": shape}, ACL_SUCCESS


def get_input_dims(model_desc: int, index: int):
    """aclmdlGetInputDims: ({"name", "dimCount", "dims"}, ret) of input ``index``; a
    dynamic dim is -1."""
    return _dims(model_desc, index, False, "acl.mdl.get_input_dims")


def get_output_dims(model_desc: int, index: int):
    """aclmdlGetOutputDims: ({"name", "dimCount", "dims"}, ret) of output ``index``; a
    dynamic dim is -1 (`get_cur_output_dims` gives the last execution's)."""
    return _dims(model_desc, index, True, "acl.mdl.get_output_dims")


def get_cur_output_dims(model_desc: int, index: int):
    """aclmdlGetCurOutputDims: ({"name", "dimCount", "dims"}, ret) of output ``index`` at
    the dims of the model's last execution (the largest gear before any)."""
    api = "acl.mdl.get_cur_output_dims"
    v = described(model_desc, api)
    if not _index_ok(v, index, True, api):
        return {}, ACL_ERROR_INVALID_PARAM
    values = S.model_values.get(S.model_descs[model_desc]) or v.max_values()
    if values is None:
        return {}, fail(ACL_ERROR_INVALID_PARAM, api, "the model has unbounded dynamic dims and "
                        "has not run yet")
    shape = list(v.shape(index, True, values))
    return {"name": v.name(index, True), "dimCount": len(shape), "dims": shape}, ACL_SUCCESS


def _dtype(model_desc, index, outputs, api) -> int:
    v = described(model_desc, api)
    return dtype_to_acl(v.dtype(index, outputs)) if _index_ok(v, index, outputs, api) else -1


def get_input_data_type(model_desc: int, index: int) -> int:
    """aclmdlGetInputDataType: ACL data type (ACL_FLOAT...) of input ``index`` (ACL_INT64
    for the dynamic-index input); ACL_DT_UNDEFINED (-1) on a bad description or index."""
    return _dtype(model_desc, index, False, "acl.mdl.get_input_data_type")


def get_output_data_type(model_desc: int, index: int) -> int:
    """aclmdlGetOutputDataType: ACL data type (ACL_FLOAT...) of output ``index``; ACL_DT_UNDEFINED
    (-1) on a bad description or index."""
    return _dtype(model_desc, index, True, "acl.mdl.get_output_data_type")


def get_input_name_by_index(model_desc: int, index: int) -> str:
    """aclmdlGetInputNameByIndex: the name of input ``index`` ('' on a bad description or index)."""
    v = described(model_desc, "acl.mdl.get_input_name_by_index")
    return v.name(index, False) if _index_ok(v, index, False, "acl.mdl.get_input_name_by_index") else ""


def get_output_name_by_index(model_desc: int, index: int) -> str:
    """aclmdlGetOutputNameByIndex: the name of output ``index`` ('' on a bad description or index)."""
    v = described(model_desc, "acl.mdl.get_output_name_by_index")
    return v.name(index, True) if _index_ok(v, index, True, "acl.mdl.get_output_name_by_index") else ""


def _index_by_name(model_desc, name, outputs: bool, api: str):
    v = described(model_desc, api)
    if v is None:
        return -1, ACL_ERROR_INVALID_PARAM
    what = "output" if outputs else "input"
    if not isinstance(name, str):
        return -1, fail(ACL_ERROR_INVALID_PARAM, api, f"name must be a str (an {what} name, as "
                        f"acl.mdl.get_{what}_name_by_index gives), got {type(name).__name__}")
    names = [v.name(i, outputs) for i in range(_count(v, outputs))]
    if name not in names:
        return -1, fail(ACL_ERROR_INVALID_PARAM, api, f"the model has no {what} named {name!r} "
                        f"(it has {names})")
    return names.index(name), ACL_SUCCESS


def get_input_index_by_name(model_desc: int, name: str):
    """aclmdlGetInputIndexByName: (index, ret) of the input named ``name`` — the dynamic-index
    input of a model with gears is `ACL_DYNAMIC_TENSOR_NAME` ("ascend_mbatch_shape_data")."""
    return _index_by_name(model_desc, name, False, "acl.mdl.get_input_index_by_name")


def get_output_index_by_name(model_desc: int, name: str):
    """aclmdlGetOutputIndexByName: (index, ret) of the output named ``name``."""
    return _index_by_name(model_desc, name, True, "acl.mdl.get_output_index_by_name")


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
    S.dataset_values.pop(dataset, None)
    S.dataset_descs.pop(dataset, None)
    if S.datasets.pop(dataset, None) is None:
        return fail(ACL_ERROR_INVALID_PARAM, "acl.mdl.destroy_dataset", f"{dataset!r} is not a "
                    "live dataset (destroyed twice?)")
    return ACL_SUCCESS


def _buffers(dataset, needs, exact: bool, api: str, mismatch: int):
    """uint8 views of ``needs`` ((label, bytes) per buffer) at the dataset's buffers, or an
    error code. ``exact``: a buffer must have exactly its bytes (else at least)."""
    if dataset not in S.datasets:
        return fail(ACL_ERROR_INVALID_PARAM, api, f"{dataset!r} is not a live dataset")
    bufs = S.datasets[dataset]
    what = "output" if mismatch == ACL_ERROR_MODEL_OUTPUT_NOT_MATCH else "input"
    if len(bufs) != len(needs):
        return fail(mismatch, api, f"the {what} dataset has {len(bufs)} buffers, the model "
                    f"{len(needs)} {what}s")
    views = []
    for i, (b, (label, need)) in enumerate(zip(bufs, needs)):
        if b not in S.data_buffers:
            return fail(ACL_ERROR_INVALID_PARAM, api, f"{what} {i}: data buffer {b!r} was destroyed")
        ptr, size = S.data_buffers[b]
        if size != need if exact else size < need:
            return fail(ACL_ERROR_GE_EXEC_MODEL_DATA_SIZE_INVALID, api,
                        f"{what} {i} ({label}) needs {need} bytes, its data buffer has {size}")
        hit = S.find(ptr, need) if need else (None, torch.empty(0, dtype=torch.uint8))
        if hit is None:   # a zero-size tensor needs no memory: any pointer (0 too) serves
            return fail(ACL_ERROR_RT_PARAM_INVALID, api, f"{what} {i}: {need} bytes at {ptr!r} "
                        "are not inside one allocation (freed?)")
        views.append(hit[1])
    return views


def _dim_values(shapes: ModelShapes, dataset: int, api: str):
    """The dynamic dims' values (symbol -> int) for an execution on input ``dataset``: the
    gear set by ``acl.mdl.set_dynamic_*``, or (no gears) the symbols the model's own
    `ShapeBinder` binds from the shapes ``set_dataset_tensor_desc`` gave (derived dims such
    as ``2 * s`` solved for ``s``, ranges and shared dims checked); an error code (logged)
    when they are missing or inconsistent."""
    if not shapes.dynamic:
        return {}
    if shapes.gears:
        values = S.dataset_values.get(dataset)
        if values is None:
            return fail(ACL_ERROR_INVALID_PARAM, api, f"the model has {shapes.option} gears "
                        f"{shapes.gear_list()}: call {GEAR_SETTERS[shapes.option]} on the input "
                        "dataset before executing")
        return values
    given = []
    for i in range(len(shapes.inputs)):
        dims = _described_shape(shapes, dataset, i, api)
        if isinstance(dims, int):
            return dims
        given.append(dims)
    try:
        return shapes.binder.shape_values(given)
    except ValueError as e:   # out of range, shared dims that differ, a size 2*s cannot take
        return fail(ACL_ERROR_MODEL_INPUT_NOT_MATCH, api, f"the tensor descriptions' shapes: {e}")


def _described_shape(shapes: ModelShapes, dataset: int, i: int, api: str):
    """Input ``i``'s shape for this execution: its static shape, or with dynamic dims the
    dims of the tensor description ``set_dataset_tensor_desc`` gave it (checked for rank,
    data type and static dims); an error code (logged) when missing or different."""
    v = shapes.inputs[i]
    if not any(isinstance(d, str) for d in v.desc.shape):
        return [int(d) for d in v.desc.shape]
    descs = S.dataset_descs.get(dataset, {})
    if i not in descs or descs[i] not in S.tensor_descs:
        return fail(ACL_ERROR_INVALID_PARAM, api, f"input {i} ({shapes.name(i, False)}) has dynamic dims "
                    f"{list(shapes.described_dims(i, False))}: give its shape with "
                    "acl.mdl.set_dataset_tensor_desc before executing")
    acl_dtype, dims, _ = S.tensor_descs[descs[i]]
    if len(dims) != len(v.desc.shape):
        return fail(ACL_ERROR_MODEL_INPUT_NOT_MATCH, api, f"input {i} ({shapes.name(i, False)}): the tensor "
                    f"description has {len(dims)} dims, the input {len(v.desc.shape)}")
    if acl_dtype != dtype_to_acl(v.desc.dtype.torch):
        return fail(ACL_ERROR_MODEL_INPUT_NOT_MATCH, api, f"input {i} ({shapes.name(i, False)}): the tensor "
                    f"description's data type is {acl_dtype}, the input's "
                    f"{dtype_to_acl(v.desc.dtype.torch)} ({v.desc.dtype.value})")
    wrong = [j for j, d in enumerate(v.desc.shape) if not isinstance(d, str) and dims[j] != d]
    if wrong:
        return fail(ACL_ERROR_MODEL_INPUT_NOT_MATCH, api, f"input {i} ({shapes.name(i, False)}): the tensor "
                    f"description's dims {list(dims)} differ from the input's static dims "
                    f"{shapes.described_dims(i, False)} at {wrong}")
    return [int(n) for n in dims]


def _call(cm, xs):
    """Call ``cm`` with its graph inputs ``xs`` bound as at compile time: positional and
    keyword arguments rebuilt from its calling convention (baked non-tensor values too)."""
    cc = cm.calling_convention()
    spec = cc.get("in_spec")
    if spec is None:
        return cm(*xs)
    flat = [None] * spec.num_leaves
    for i, value in (cc.get("baked") or {}).items():
        flat[int(i)] = value
    for x, pos in zip(xs, cc.get("input_positions") or range(len(xs))):
        flat[pos] = x
    args, kwargs = pytree.tree_unflatten(flat, spec)
    return cm(*args, **kwargs)


def execute(model_id: int, input: int, output: int) -> int:
    """aclmdlExecute: run model ``model_id`` on the input dataset, writing the output
    dataset's buffers. A model with gears runs the gear set by ``acl.mdl.set_dynamic_*``
    (its inputs read from the leading bytes of the buffers, outputs written likewise); one
    with dynamic ranges takes its input shapes from ``set_dataset_tensor_desc``.
    Returns ACL_SUCCESS or an ACL error code (logged); never raises."""
    api = "acl.mdl.execute"
    rc = _init(api)
    if rc:
        return rc
    cm = S.models.get(model_id)
    if cm is None:
        return fail(ACL_ERROR_INVALID_MODEL_ID, api, f"model id {model_id!r} is not loaded "
                    "(call acl.mdl.load_from_file first)")
    shapes = S.model_shapes[model_id]
    for ds, what in ((input, "input"), (output, "output")):
        if ds not in S.datasets:
            return fail(ACL_ERROR_INVALID_PARAM, api, f"the {what} dataset {ds!r} is not live "
                        "(destroyed, or not from acl.mdl.create_dataset)")
    values = _dim_values(shapes, input, api)
    if isinstance(values, int):
        return values
    label = lambda v, i, o: (f"{shapes.name(i, o)}, {v.desc.dtype.value}"  # noqa: E731
                             f"{list(shapes.shape(i, o, values))}")
    needs = [(label(v, i, False), shapes.nbytes(i, False, values)) for i, v in enumerate(shapes.inputs)]
    if shapes.gears:
        needs.append((ACL_DYNAMIC_TENSOR_NAME, shapes.nbytes(shapes.index_input, False)))
    src = _buffers(input, needs, not shapes.dynamic, api, ACL_ERROR_MODEL_INPUT_NOT_MATCH)
    if isinstance(src, int):
        return src
    dst = _buffers(output, [(label(v, i, True), shapes.nbytes(i, True, values))
                            for i, v in enumerate(shapes.outputs)], False, api,
                   ACL_ERROR_MODEL_OUTPUT_NOT_MATCH)
    if isinstance(dst, int):
        return dst
    xs = []
    for i, (raw, v) in enumerate(zip(src, shapes.inputs)):
        raw = raw if raw.data_ptr() % 64 == 0 else raw.clone()
        xs.append(raw.view(v.desc.dtype.torch).reshape(shapes.shape(i, False, values)))
    try:
        with torch.no_grad():
            result = _call(cm, xs)
    except Exception as e:  # noqa: BLE001 - the model's own one-line error, as a code
        return fail(ACL_ERROR_FAILURE, api, f"model {model_id}: {e}")
    ys = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
    if len(ys) != len(dst):
        return fail(ACL_ERROR_FAILURE, api, f"model {model_id} returned {len(ys)} tensors, its "
                    f"description {len(dst)} outputs")
    for raw, y in zip(dst, ys):
        raw[:y.numel() * y.element_size()].copy_(y.contiguous().reshape(-1).view(torch.uint8))
    with S.lock:
        S.model_values[model_id] = dict(values)
        if shapes.dynamic:   # the output dataset's tensor descriptions: this run's shapes
            descs = S.dataset_descs.setdefault(output, {})
            for i, y in enumerate(ys):
                h = descs.get(i)
                descs[i] = h = h if h in S.tensor_descs else S.new_handle()
                S.tensor_descs[h] = (dtype_to_acl(y.dtype), tuple(y.shape), ACL_FORMAT_ND)
    return ACL_SUCCESS


def execute_async(model_id: int, input: int, output: int, stream: int) -> int:
    """`execute` on ``stream``; done when it returns (acl.rt.synchronize_stream is a no-op)."""
    if stream not in S.streams and stream != 0:
        return fail(ACL_ERROR_INVALID_PARAM, "acl.mdl.execute_async", f"{stream!r} is not a live stream")
    return execute(model_id, input, output)


from .mdl_dynamic import (get_dataset_tensor_desc, get_dynamic_batch, get_dynamic_hw,  # noqa: E402,F401
                          get_input_dynamic_dims, get_input_dynamic_gear_count,
                          set_dataset_tensor_desc, set_dynamic_batch_size, set_dynamic_hw_size,
                          set_input_dynamic_dims)
