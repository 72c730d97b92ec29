"""Operator library: `OpDef` registry (one row per op, every per-op fact a column), the
op table, fused ops, and the kernels per device (``ops/kernels/{cpu,vnpu}.py``)."""
from .opdef import (Cost, OpDef, OpKind, all_ops, call_args, frozen_graph, get_op, infer,
                    inplace_inputs, is_random, is_random_call, lookup_aten, lookup_custom_op,
                    out_buffers_fit, out_contiguous_inputs, output_aliases, reads_layout,
                    register, written_inputs)
from .aliasing import (aliases_of, graph_happens_before, last_reads, layout_read_inputs,
                       ordering_deps, storage_roots)
from . import library  # noqa: F401  (registers the table)
from . import fused  # noqa: F401  (registers opencann's fused ops)
from . import resize  # noqa: F401  (F.interpolate's upsampling overloads, ATen's kernels)
from . import fused_patterns  # noqa: F401  (RmsNorm, GatedMLP: the pattern fusions' ops)
from . import fused_elementwise  # noqa: F401  (FusedElementwise: fuse_elementwise's op)
from .flash_attention import opdef as _flash_attention_opdef  # noqa: F401  (FlashAttention op)
from . import decode_attention as _decode_attention  # noqa: F401  (DecodeAttention op)
from . import kv_cache_update as _kv_cache_update  # noqa: F401  (KvCacheUpdate op)
from . import decode_attention_kv_update as _decode_kv  # noqa: F401  (DecodeAttentionKvUpdate op)
from . import cube_epilogue as _cube_epilogue  # noqa: F401  (CubeEpilogue: vnpu_ub_epilogue's op)
from . import onnx_fallback  # noqa: F401  (OnnxHostFallback: ONNX nodes run by ONNX Runtime)
from . import quant  # noqa: F401  (AscendQuant and the int8 ops: the quantize_int8 pass's)

__all__ = ["Cost", "OpDef", "OpKind", "aliases_of", "graph_happens_before", "ordering_deps", "all_ops", "call_args", "get_op", "infer",
           "frozen_graph", "inplace_inputs", "is_random", "is_random_call", "last_reads",
           "layout_read_inputs", "lookup_aten", "lookup_custom_op", "out_buffers_fit",
           "out_contiguous_inputs", "output_aliases",
           "reads_layout", "register", "storage_roots", "written_inputs"]

# ``opencann.ops.flash_attention(q, k, v, ...)`` is the eager API (the spelling);
# the subpackage stays importable as ``opencann.ops.flash_attention.<module>``.
from .flash_attention import flash_attention, plan_tiles  # noqa: E402,F811

__all__ += ["flash_attention", "plan_tiles"]
