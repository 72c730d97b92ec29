"""Every pyACL call returns an error code for a bad argument, never an exception: the
facade's public functions are wrapped once (`guard_module`) so that an argument of the
wrong type (a list as a handle, None as a size) is logged and answered with
ACL_ERROR_INVALID_PARAM in the call's own return shape, as AscendCL's C API does.

An exception raised while every argument has the plain type its annotation names
(``int``, ``str``) is the facade's own fault, not the caller's: it is logged as an
internal error (naming the exception, and that the arguments were valid) and answered
with ACL_ERROR_INTERNAL_ERROR in the same return shape."""
from __future__ import annotations

import functools
import inspect
from types import ModuleType
from typing import Any, Callable, Dict

from .errors import ACL_ERROR_INTERNAL_ERROR, ACL_ERROR_INVALID_PARAM, fail

_CODE = ACL_ERROR_INVALID_PARAM
#: the failure value of calls that return something other than an error code
FAILURE: Dict[str, Any] = {
    # (value, ret) pairs
    **{n: (0, _CODE) for n in ("get_device_count", "get_device", "get_run_mode", "create_context",
                              "create_stream", "malloc", "malloc_host", "load_from_file",
                              "add_dataset_buffer", "get_input_dynamic_gear_count")},
    **{n: ({}, _CODE) for n in ("get_input_dims", "get_output_dims", "get_cur_output_dims",
                               "get_dynamic_batch", "get_dynamic_hw")},
    **{n: (-1, _CODE) for n in ("get_input_index_by_name", "get_output_index_by_name",
                               "get_tensor_desc_dim_v2")},
    "get_mem_info": (0, 0, _CODE), "get_input_dynamic_dims": ([], _CODE),
    # plain values: counts, handles, sizes, names, data types, memory
    **{n: 0 for n in ("get_num_inputs", "get_num_outputs", "get_input_size_by_index",
                     "get_output_size_by_index", "get_dataset_num_buffers", "get_dataset_buffer",
                     "get_data_buffer_addr", "get_data_buffer_size_v2", "get_data_buffer_size",
                     "create_data_buffer", "create_tensor_desc", "get_tensor_desc_num_dims",
                     "get_dataset_tensor_desc", "create_desc", "create_dataset", "create_attr",
                     "numpy_to_ptr", "bytes_to_ptr", "model_bytes")},
    **{n: "" for n in ("get_input_name_by_index", "get_output_name_by_index")},
    **{n: -1 for n in ("get_input_data_type", "get_output_data_type", "get_tensor_desc_type")},
    "ptr_to_bytes": b"", "ptr_to_numpy": None,
}
_BAD_ARGUMENT = (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError)


#: annotation -> whether a value has that plain type (bool is not an int here)
_PLAIN = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "str": lambda v: isinstance(v, str)}


def _args_fit(sig: inspect.Signature, args: tuple, kwargs: dict) -> bool:
    """Whether the call binds to ``sig`` and every argument passed has the plain type its
    annotation names (`_PLAIN`); an unannotated or other parameter never fits."""
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return False
    return all(_PLAIN.get(sig.parameters[n].annotation, lambda v: False)(v)
               for n, v in bound.arguments.items())


def _with_code(failure: Any, code: int) -> Any:
    """``failure`` (a call's failure value) carrying ``code`` where it carries the
    ACL_ERROR_INVALID_PARAM code (a plain code, or a tuple's last item)."""
    if failure == _CODE and isinstance(failure, int):
        return code
    if isinstance(failure, tuple) and failure and failure[-1] == _CODE:
        return failure[:-1] + (code,)
    return failure


def _guarded(fn: Callable, api: str, failure: Any) -> Callable:
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a pyACL call answers with a code
            what = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else repr(e)}"
            if _args_fit(sig, args, kwargs):
                fail(ACL_ERROR_INTERNAL_ERROR, api, f"internal error ({what}); the arguments are "
                     "valid, so this is a fault of opencann: please report it")
                return _with_code(failure, ACL_ERROR_INTERNAL_ERROR)
            if not isinstance(e, _BAD_ARGUMENT):
                raise
            fail(_CODE, api, f"bad argument ({what})")
            return failure
    call.__acl_guarded__ = True
    return call


def guard_module(module: ModuleType, prefix: str) -> None:
    """Wrap every public function defined for ``module``'s API (its own and those it
    re-exports from the facade) so that a bad argument returns its failure value
    (`FAILURE`, else ACL_ERROR_INVALID_PARAM) instead of raising."""
    for name, fn in list(vars(module).items()):
        if (name.startswith("_") or not inspect.isfunction(fn) or getattr(fn, "__acl_guarded__", False)
                or not fn.__module__.startswith("opencann.acl")
                or fn.__module__.endswith((".guard", ".errors", "._state", ".types"))):
            continue
        setattr(module, name, _guarded(fn, f"{prefix}.{name}", FAILURE.get(name, _CODE)))
