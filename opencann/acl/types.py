"""AscendCL enum constants (``acl_base.h``, ``acl_rt.h``) and the data type mapping."""
from __future__ import annotations

from typing import Optional

import torch

# aclrtMemMallocPolicy
ACL_MEM_MALLOC_HUGE_FIRST = 0
ACL_MEM_MALLOC_HUGE_ONLY = 1
ACL_MEM_MALLOC_NORMAL_ONLY = 2
# aclrtMemcpyKind
ACL_MEMCPY_HOST_TO_HOST = 0
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_MEMCPY_DEVICE_TO_DEVICE = 3
# aclrtRunMode
ACL_DEVICE = 0
ACL_HOST = 1
# aclDataType
ACL_DT_UNDEFINED = -1
ACL_FLOAT = 0
ACL_FLOAT16 = 1
ACL_INT8 = 2
ACL_INT32 = 3
ACL_UINT8 = 4
ACL_INT16 = 6
ACL_UINT16 = 7
ACL_UINT32 = 8
ACL_INT64 = 9
ACL_UINT64 = 10
ACL_DOUBLE = 11
ACL_BOOL = 12
ACL_COMPLEX64 = 16
ACL_COMPLEX128 = 17
ACL_BF16 = 27
# aclFormat
ACL_FORMAT_UNDEFINED = -1
ACL_FORMAT_NCHW = 0
ACL_FORMAT_NHWC = 1
ACL_FORMAT_ND = 2
ACL_FORMAT_NC1HWC0 = 3
ACL_FORMAT_FRACTAL_Z = 4
ACL_FORMAT_FRACTAL_NZ = 29

_DT = {ACL_FLOAT: torch.float32, ACL_FLOAT16: torch.float16, ACL_INT8: torch.int8,
       ACL_INT32: torch.int32, ACL_UINT8: torch.uint8, ACL_INT16: torch.int16,
       ACL_UINT16: torch.uint16, ACL_UINT32: torch.uint32, ACL_INT64: torch.int64,
       ACL_UINT64: torch.uint64, ACL_DOUBLE: torch.float64, ACL_BOOL: torch.bool,
       ACL_COMPLEX64: torch.complex64, ACL_COMPLEX128: torch.complex128, ACL_BF16: torch.bfloat16}
_TD = {v: k for k, v in _DT.items()}


def acl_to_dtype(code) -> Optional[torch.dtype]:
    """The torch dtype of aclDataType ``code`` (ACL_FLOAT → torch.float32, ...), or None for an
    unknown code."""
    return _DT.get(code)


def dtype_to_acl(dtype: torch.dtype) -> int:
    """The aclDataType code of torch ``dtype``, or ACL_DT_UNDEFINED (-1) for a dtype ACL does not
    have."""
    return _TD.get(dtype, ACL_DT_UNDEFINED)
