"""``acl.mdl``'s dynamic-shape calls: the gears of a model compiled with ATC-style
``dynamic_batch_size`` / ``dynamic_image_size`` / ``dynamic_dims`` (listed, and chosen per
input dataset by writing the dynamic-index input), and per-dataset tensor descriptions for
a model with dynamic ranges. Names, arguments and returns as pyACL's (CANN AscendCL API
reference: aclmdlGetDynamicBatch, aclmdlGetDynamicHW, aclmdlGetInputDynamicGearCount,
aclmdlGetInputDynamicDims, aclmdlSetDynamicBatchSize, aclmdlSetDynamicHWSize,
aclmdlSetInputDynamicDims, aclmdlSetDatasetTensorDesc, aclmdlGetDatasetTensorDesc).
Every call returns an error code (logged) for misuse; none raises."""
from __future__ import annotations

from typing import Sequence

import torch

from . import _state as S
from .errors import (ACL_ERROR_GE_EXEC_MODEL_DATA_SIZE_INVALID, ACL_ERROR_INVALID_MODEL_ID,
                     ACL_ERROR_INVALID_PARAM, ACL_ERROR_RT_PARAM_INVALID, ACL_SUCCESS, fail)
from .model_shapes import ACL_DYNAMIC_TENSOR_NAME, described


def get_dynamic_batch(model_desc: int):
    """aclmdlGetDynamicBatch: ({"batchCount", "batch"}, ret) — the batch gears of a model
    compiled with ``dynamic_batch_size`` (count 0 for any other model)."""
    v = described(model_desc, "acl.mdl.get_dynamic_batch")
    if v is None:
        return {}, ACL_ERROR_INVALID_PARAM
    batch = [g[0] for g in v.gears] if v.option == "dynamic_batch_size" else []
    return {"batchCount": len(batch), "batch": batch}, ACL_SUCCESS


def get_dynamic_hw(model_desc: int, index: int = -1):
    """aclmdlGetDynamicHW: ({"hwCount", "hw": [[h, w], ...]}, ret) — the image-size gears of
    a model compiled with ``dynamic_image_size`` (count 0 for any other). ``index``: -1."""
    v = described(model_desc, "acl.mdl.get_dynamic_hw")
    if v is None:
        return {}, ACL_ERROR_INVALID_PARAM
    hw = [list(g) for g in v.gears] if v.option == "dynamic_image_size" else []
    return {"hwCount": len(hw), "hw": hw}, ACL_SUCCESS


def get_input_dynamic_gear_count(model_desc: int, index: int = -1):
    """aclmdlGetInputDynamicGearCount: (gear count, ret) of a model compiled with
    ``dynamic_dims`` (0 for any other). ``index``: reserved, -1."""
    v = described(model_desc, "acl.mdl.get_input_dynamic_gear_count")
    if v is None:
        return 0, ACL_ERROR_INVALID_PARAM
    return (len(v.gears) if v.option == "dynamic_dims" else 0), ACL_SUCCESS


def get_input_dynamic_dims(model_desc: int, index: int, gear_count: int):
    """aclmdlGetInputDynamicDims: ([{"name": "", "dimCount", "dims"}] per gear, ret): each
    gear as every input's dims concatenated (static dims included), for a model compiled
    with ``dynamic_dims``. ``index``: reserved, -1; ``gear_count``: from
    `get_input_dynamic_gear_count` (ACL_ERROR_INVALID_PARAM when it differs)."""
    api = "acl.mdl.get_input_dynamic_dims"
    v = described(model_desc, api)
    if v is None:
        return [], ACL_ERROR_INVALID_PARAM
    gears = v.gears if v.option == "dynamic_dims" else []
    if gear_count != len(gears):
        return [], fail(ACL_ERROR_INVALID_PARAM, api, f"gear_count {gear_count!r}: the model has "
                        f"{len(gears)} dynamic_dims gears (acl.mdl.get_input_dynamic_gear_count)")
    out = []
    for g in gears:
        dims = v.all_dims(dict(zip(v.gear_symbols, g)))
        out.append({"name": "", "dimCount": len(dims), "dims": dims})
    return out, ACL_SUCCESS


def _set_gear(api: str, option: str, model_id, dataset, index, given: Sequence[int]) -> int:
    """Choose the gear ``given`` for executions on input ``dataset``: written as int64
    values into the dataset's buffer at ``index`` (the dynamic-index input)."""
    if model_id not in S.models:
        return fail(ACL_ERROR_INVALID_MODEL_ID, api, f"model id {model_id!r} is not loaded")
    v = S.model_shapes[model_id]
    try:
        values = v.gear_values(option, given, api)
    except ValueError as e:
        return fail(ACL_ERROR_INVALID_PARAM, api, str(e))
    if dataset not in S.datasets:
        return fail(ACL_ERROR_INVALID_PARAM, api, f"{dataset!r} is not a live dataset")
    if index != v.index_input:
        return fail(ACL_ERROR_INVALID_PARAM, api, f"index {index!r} is not the dynamic-index input "
                    f"({v.index_input}: acl.mdl.get_input_index_by_name(desc, "
                    f"{ACL_DYNAMIC_TENSOR_NAME!r}))")
    bufs = S.datasets[dataset]
    if index >= len(bufs) or bufs[index] not in S.data_buffers:
        return fail(ACL_ERROR_INVALID_PARAM, api, f"the dataset has no buffer at index {index}: add "
                    f"one of acl.mdl.get_input_size_by_index(desc, {index}) bytes for "
                    f"{ACL_DYNAMIC_TENSOR_NAME}")
    ptr, size = S.data_buffers[bufs[index]]
    need = v.nbytes(index, False)
    hit = S.find(ptr, need) if size >= need else None
    if hit is None:
        return fail(ACL_ERROR_GE_EXEC_MODEL_DATA_SIZE_INVALID if size < need
                    else ACL_ERROR_RT_PARAM_INVALID, api, f"the {ACL_DYNAMIC_TENSOR_NAME} buffer "
                    f"needs {need} bytes inside one allocation, it has {size}")
    gear = [values[s] for s in v.gear_symbols]
    hit[1].copy_(torch.tensor(gear, dtype=torch.int64).view(torch.uint8))
    S.dataset_values[dataset] = values
    return ACL_SUCCESS


def set_dynamic_batch_size(model_id: int, dataset: int, index: int, batch_size: int) -> int:
    """aclmdlSetDynamicBatchSize: execute the input ``dataset`` at batch gear ``batch_size``
    (one of `get_dynamic_batch`'s); ``index``: the dynamic-index input's."""
    return _set_gear("acl.mdl.set_dynamic_batch_size", "dynamic_batch_size", model_id, dataset,
                     index, [batch_size])


def set_dynamic_hw_size(model_id: int, dataset: int, index: int, height: int, width: int) -> int:
    """aclmdlSetDynamicHWSize: execute the input ``dataset`` at image-size gear
    (``height``, ``width``) (one of `get_dynamic_hw`'s)."""
    return _set_gear("acl.mdl.set_dynamic_hw_size", "dynamic_image_size", model_id, dataset,
                     index, [height, width])


def set_input_dynamic_dims(model_id: int, dataset: int, index: int, dims) -> int:
    """aclmdlSetInputDynamicDims: execute the input ``dataset`` at the ``dynamic_dims`` gear
    ``dims`` ({"name", "dimCount", "dims"}: every input's dims concatenated, as
    `get_input_dynamic_dims` lists a gear)."""
    api = "acl.mdl.set_input_dynamic_dims"
    if model_id not in S.models:
        return fail(ACL_ERROR_INVALID_MODEL_ID, api, f"model id {model_id!r} is not loaded")
    if not isinstance(dims, dict) or not isinstance(dims.get("dims"), (list, tuple)):
        return fail(ACL_ERROR_INVALID_PARAM, api, "dims must be a dict {'name', 'dimCount', 'dims'} "
                    "as acl.mdl.get_input_dynamic_dims returns")
    v = S.model_shapes[model_id]
    if v.option != "dynamic_dims":
        gear = dims["dims"]      # let _set_gear name the model's own gear call
    else:
        try:
            gear = v.dims_gear(dims["dims"])
        except (ValueError, TypeError) as e:
            return fail(ACL_ERROR_INVALID_PARAM, api, str(e))
    return _set_gear(api, "dynamic_dims", model_id, dataset, index, gear)


def set_dataset_tensor_desc(dataset: int, tensor_desc: int, index: int) -> int:
    """aclmdlSetDatasetTensorDesc: the shape of input ``index`` of ``dataset`` for a model
    with dynamic ranges (a tensor description from ``acl.create_tensor_desc``)."""
    api = "acl.mdl.set_dataset_tensor_desc"
    if dataset not in S.datasets or tensor_desc not in S.tensor_descs:
        return fail(ACL_ERROR_INVALID_PARAM, api, f"dataset {dataset!r} or tensor description "
                    f"{tensor_desc!r} is not live")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        return fail(ACL_ERROR_INVALID_PARAM, api, f"index {index!r} must be an int >= 0")
    S.dataset_descs.setdefault(dataset, {})[index] = tensor_desc
    return ACL_SUCCESS


def get_dataset_tensor_desc(dataset: int, index: int) -> int:
    """aclmdlGetDatasetTensorDesc: the tensor description at ``index`` of ``dataset``: for an
    output dataset of a dynamic model, the shape its last execution wrote; 0 if none."""
    d = S.dataset_descs.get(dataset, {}).get(index, 0)
    return d if d in S.tensor_descs else 0
