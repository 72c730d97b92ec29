"""AscendCL return codes (CANN's ``acl_base.h``, ``rt_error_codes.h``, ``ge_error_codes.h``)
and `fail`, which logs why a call failed and returns its code, as pyACL does, and
`check_init`, the initialisation check every API call starts with.

Every `opencann.acl` function returns an ``int`` code (``ACL_SUCCESS == 0``) or a
``(value, code)`` tuple where pyACL does; none raises for misuse."""
from __future__ import annotations

from ..log import logger
from . import _state as S

ACL_SUCCESS = 0
# acl_base.h: parameter / initialization / file / model / op errors (1000xx)
ACL_ERROR_INVALID_PARAM = 100000
ACL_ERROR_UNINITIALIZE = 100001
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_ERROR_INVALID_FILE = 100003
ACL_ERROR_WRITE_FILE = 100004
ACL_ERROR_INVALID_FILE_SIZE = 100005
ACL_ERROR_PARSE_FILE = 100006
ACL_ERROR_INVALID_MODEL_ID = 100011
ACL_ERROR_DESERIALIZE_MODEL = 100012
ACL_ERROR_PARSE_MODEL = 100013
ACL_ERROR_READ_MODEL_FAILURE = 100014
ACL_ERROR_MODEL_INPUT_NOT_MATCH = 100017
ACL_ERROR_MODEL_OUTPUT_NOT_MATCH = 100018
ACL_ERROR_OP_TYPE_NOT_MATCH = 100020
ACL_ERROR_OP_INPUT_NOT_MATCH = 100021
ACL_ERROR_OP_OUTPUT_NOT_MATCH = 100022
ACL_ERROR_OP_ATTR_NOT_MATCH = 100023
ACL_ERROR_OP_NOT_FOUND = 100024
ACL_ERROR_UNSUPPORTED_DATA_TYPE = 100026
ACL_ERROR_REPEAT_FINALIZE = 100037
# resource errors (2000xx)
ACL_ERROR_BAD_ALLOC = 200000
ACL_ERROR_API_NOT_SUPPORT = 200001
ACL_ERROR_INVALID_DEVICE = 200002
ACL_ERROR_INVALID_RESOURCE_HANDLE = 200005
# internal (5000xx)
ACL_ERROR_INTERNAL_ERROR = 500000
ACL_ERROR_FAILURE = 500001
# runtime (rt_error_codes.h)
ACL_ERROR_RT_PARAM_INVALID = 107000
ACL_ERROR_RT_INVALID_DEVICEID = 107001
ACL_ERROR_RT_CONTEXT_NULL = 107002
ACL_ERROR_RT_MEMORY_ALLOCATION = 207001
ACL_ERROR_RT_MEMORY_FREE = 207002
# graph engine (ge_error_codes.h)
ACL_ERROR_GE_EXEC_MODEL_DATA_SIZE_INVALID = 145006

NAMES = {v: k for k, v in dict(globals()).items() if k.startswith("ACL_") and isinstance(v, int)}


def fail(code: int, api: str, why: str) -> int:
    """Log ``why`` ``api`` failed (with the code's name) at ERROR and return ``code``."""
    logger.error("%s failed: %s [%s=%d]", api, why, NAMES.get(code, "ACL_ERROR"), code)
    return code


def check_init(api: str) -> int:
    """ACL_SUCCESS when ``acl.init`` has been called (and not finalized), else
    ACL_ERROR_UNINITIALIZE, logged as a failure of ``api`` (the caller's API name)."""
    return ACL_SUCCESS if S.initialized else fail(
        ACL_ERROR_UNINITIALIZE, api, "acl.init was not called (or acl.finalize was)")


__all__ = sorted(NAMES.values())
