"""PyTorch frontend: capture (torch.export + core-ATen decomposition) and FX → IR."""
from .capture import (CaptureError, capture, check_layout, decomposition_table,
                      native_dispatch_of_kept)
from .convert import ConversionError, from_exported_program, from_fx_graph, source_of
from .module_attrs import AttributeChanged, AttributeGuard
from .view_writes import rewrite_written_unfolds, written_expand

__all__ = ["AttributeChanged", "AttributeGuard", "CaptureError", "capture", "check_layout",
           "decomposition_table", "native_dispatch_of_kept",
           "ConversionError", "from_exported_program", "from_fx_graph", "rewrite_written_unfolds",
           "source_of", "written_expand"]
