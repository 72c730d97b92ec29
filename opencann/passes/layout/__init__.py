"""Stage 3, layout: storage formats per device (cpu: `LayoutSelection`, vnpu:
`NpuLayoutSelection`, after the vnpu's int8 rewrite `VnpuQuantizeInt8`), then the vnpu's
UB fusion on the formatted graph (`VnpuUbEpilogue`). One pass per module."""
from .cpu_layout import LayoutSelection
from .npu_layout import NpuLayoutSelection, npu_desc, select
from .vnpu_quantize_int8 import VnpuQuantizeInt8
from .vnpu_ub_epilogue import VnpuUbEpilogue

__all__ = ["LayoutSelection", "NpuLayoutSelection", "VnpuQuantizeInt8", "VnpuUbEpilogue", "npu_desc", "select"]
