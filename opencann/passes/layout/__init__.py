"""Stage 3, layout: storage formats per device (cpu: `LayoutSelection`, vnpu:
`NpuLayoutSelection`). One pass per module."""
from .cpu_layout import LayoutSelection
from .npu_layout import NpuLayoutSelection, npu_desc, select

__all__ = ["LayoutSelection", "NpuLayoutSelection", "npu_desc", "select"]
