"""The virtual NPU (vnpu): an Ascend-style DaVinci device modelled on the host.

Parts: `presets` (chip numbers with sources), `formats` (NC1HWC0 / FRACTAL_Z /
FRACTAL_NZ layouts), `kernels` (execution in those layouts), `vector_kernels` (norms and
softmax in ND, fp32 in UB), `attention_kernels` (SDPA, tiled FlashAttention, decode
attention, the KV-cache write), `cost_model` (time and memory-traffic estimates per kernel).
"""

from .presets import NpuSpec, PRESETS, ascend310, ascend910, ascend910b, get_preset, load_spec
from .formats import (c0_for, format_shape, from_fractal_nz, fz_groups, from_fractal_z, from_nc1hwc0, to_fractal_nz,
                      to_fractal_z, to_nc1hwc0, trans_data, valid_mask)
from .kernels import conv2d_nc1hwc0, elementwise, matmul_nz
from .vector_kernels import layer_norm, rms_norm, softmax
from .attention_kernels import (BufferOverflowError, attention, flash_attention_tiled, incre_flash_attention,
                                scatter_update_, tile_occupancy)
from .calibration import calibration_table
from .cost_model import (KernelCost, conv2d_cost, eager_time_us, elementwise_cost, flash_attention_calibration_table,
                         flash_attention_cost, fused_vector_cost, layernorm_cost, matmul_cost, reduction_cost, softmax_cost,
                         trans_data_cost)

__all__ = [
    "calibration_table",
    "NpuSpec", "PRESETS", "ascend310", "ascend910", "ascend910b", "get_preset", "load_spec",
    "c0_for", "format_shape", "from_fractal_nz", "fz_groups", "from_fractal_z", "from_nc1hwc0", "to_fractal_nz",
    "to_fractal_z", "to_nc1hwc0", "trans_data", "valid_mask",
    "conv2d_nc1hwc0", "elementwise", "matmul_nz", "layer_norm", "rms_norm", "softmax", "BufferOverflowError",
    "attention", "flash_attention_tiled", "incre_flash_attention", "scatter_update_", "tile_occupancy", "KernelCost", "conv2d_cost", "eager_time_us",
    "elementwise_cost", "flash_attention_calibration_table", "flash_attention_cost", "fused_vector_cost", "layernorm_cost",
    "matmul_cost", "reduction_cost", "softmax_cost", "trans_data_cost",
]
