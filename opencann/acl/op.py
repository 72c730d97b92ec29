"""``acl.op``: single-op mode. ``acl.op.execute_v2(op_type, input_desc, inputs,
output_desc, outputs, attr, stream)`` runs one op of opencann's op library (its
`OpDef` by name: "Add", "Relu", "MatMul"...) on data buffers described by tensor
descriptions (`acl.create_tensor_desc`), with attributes from `create_attr` /
``set_attr_*`` passed as keyword arguments of the op's ATen schema (e.g. ``alpha``)."""
from __future__ import annotations

import torch

from . import _state as S
from .errors import (ACL_ERROR_INVALID_PARAM, ACL_ERROR_OP_ATTR_NOT_MATCH,
                     ACL_ERROR_OP_INPUT_NOT_MATCH, ACL_ERROR_OP_NOT_FOUND,
                     ACL_ERROR_OP_OUTPUT_NOT_MATCH, ACL_ERROR_RT_PARAM_INVALID, ACL_SUCCESS, check_init,
                     fail)
from .types import acl_to_dtype


def create_attr() -> int:
    """aclopCreateAttr: a new empty operator attribute set; returns its handle."""
    h = S.new_handle()
    S.attrs[h] = {}
    return h


def destroy_attr(attr: int) -> int:
    """aclopDestroyAttr: forget attribute set ``attr``. Returns ACL_SUCCESS, or
    ACL_ERROR_INVALID_PARAM (logged) when it is not live."""
    if S.attrs.pop(attr, None) is None:
        return fail(ACL_ERROR_INVALID_PARAM, "acl.op.destroy_attr", f"{attr!r} is not a live attr")
    return ACL_SUCCESS


def _setter(api):
    def set_attr(attr: int, attr_name: str, attr_value) -> int:
        if attr not in S.attrs or not isinstance(attr_name, str):
            return fail(ACL_ERROR_INVALID_PARAM, api, f"{attr!r} is not a live attr (or the name "
                        "is not a str)")
        S.attrs[attr][attr_name] = attr_value
        return ACL_SUCCESS
    set_attr.__name__ = api.rsplit(".", 1)[1]
    return set_attr


set_attr_bool = _setter("acl.op.set_attr_bool")
set_attr_int = _setter("acl.op.set_attr_int")
set_attr_float = _setter("acl.op.set_attr_float")
set_attr_string = _setter("acl.op.set_attr_string")
set_attr_list_int = _setter("acl.op.set_attr_list_int")
set_attr_list_float = _setter("acl.op.set_attr_list_float")
set_attr_list_bool = _setter("acl.op.set_attr_list_bool")


def _tensors(descs, bufs, api, code, what):
    if len(descs) != len(bufs):
        return fail(code, api, f"{len(descs)} {what} descriptions but {len(bufs)} {what} buffers")
    out = []
    for i, (d, b) in enumerate(zip(descs, bufs)):
        if d not in S.tensor_descs or b not in S.data_buffers:
            return fail(ACL_ERROR_INVALID_PARAM, api, f"{what} {i}: tensor description {d!r} or "
                        f"data buffer {b!r} is not live")
        dt, dims, _ = S.tensor_descs[d]
        dtype = acl_to_dtype(dt)
        n = 1
        for s in dims:
            n *= s
        need = n * torch.empty((), dtype=dtype).element_size()
        ptr, size = S.data_buffers[b]
        if size < need:
            return fail(code, api, f"{what} {i}: {dtype}{list(dims)} needs {need} bytes, its "
                        f"data buffer has {size}")
        hit = S.find(ptr, need) if need else (None, torch.empty(0, dtype=torch.uint8))
        if hit is None:   # a zero-size tensor needs no memory: any pointer (0 too) serves
            return fail(ACL_ERROR_RT_PARAM_INVALID, api, f"{what} {i}: {need} bytes at {ptr!r} "
                        "are not inside one allocation")
        out.append((hit[1], dtype, dims))
    return out


def execute_v2(op_type: str, input_desc, inputs, output_desc, outputs, attr: int = 0,
               stream: int = 0) -> int:
    """Run op ``op_type`` (an `opencann.ops` OpDef name) once. ACL_ERROR_OP_NOT_FOUND
    (unknown op), ACL_ERROR_OP_INPUT_NOT_MATCH / _OUTPUT_NOT_MATCH (counts, sizes, or the
    result's shape/dtype differ from the output description), ACL_ERROR_OP_ATTR_NOT_MATCH."""
    api = "acl.op.execute_v2"
    rc = check_init(api)
    if rc:
        return rc
    from ..ops import get_op
    try:
        opdef = get_op(op_type)
    except KeyError as e:
        return fail(ACL_ERROR_OP_NOT_FOUND, api, str(e).strip("'\""))
    fn = opdef.kernels.get("cpu") or opdef.aten
    if fn is None:
        return fail(ACL_ERROR_OP_NOT_FOUND, api, f"op {op_type} has no host kernel")
    ins = _tensors(list(input_desc), list(inputs), api, ACL_ERROR_OP_INPUT_NOT_MATCH, "input")
    if isinstance(ins, int):
        return ins
    outs = _tensors(list(output_desc), list(outputs), api, ACL_ERROR_OP_OUTPUT_NOT_MATCH, "output")
    if isinstance(outs, int):
        return outs
    if attr and attr not in S.attrs:
        return fail(ACL_ERROR_INVALID_PARAM, api, f"attr {attr!r} is not live")
    xs = []
    for raw, dtype, dims in ins:
        raw = raw if raw.data_ptr() % 64 == 0 else raw.clone()
        xs.append(raw.view(dtype).reshape(dims))
    try:
        with torch.no_grad():
            res = fn(*xs, **S.attrs.get(attr, {}))
    except Exception as e:  # noqa: BLE001 - a kernel's refusal of these inputs/attrs, as a code
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        return fail(ACL_ERROR_OP_ATTR_NOT_MATCH, api, f"{op_type}: {msg}")
    res = list(res) if isinstance(res, (tuple, list)) else [res]
    if len(res) != len(outs):
        return fail(ACL_ERROR_OP_OUTPUT_NOT_MATCH, api, f"{op_type} returns {len(res)} outputs, "
                    f"{len(outs)} were described")
    for i, (y, (raw, dtype, dims)) in enumerate(zip(res, outs)):
        if y.dtype != dtype or tuple(y.shape) != tuple(dims):
            return fail(ACL_ERROR_OP_OUTPUT_NOT_MATCH, api, f"output {i} of {op_type} is "
                        f"{y.dtype}{list(y.shape)}, described as {dtype}{list(dims)}")
    for y, (raw, _, _) in zip(res, outs):
        raw[:y.numel() * y.element_size()].copy_(y.contiguous().reshape(-1).view(torch.uint8))
    return ACL_SUCCESS


def execute(op_type, input_desc, inputs, output_desc, outputs, attr=0, stream=0) -> int:
    """pyACL's older name of `execute_v2` (same arguments)."""
    return execute_v2(op_type, input_desc, inputs, output_desc, outputs, attr, stream)
