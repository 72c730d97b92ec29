"""FlashAttention operator family: eager autograd API, numba (CPU) and Triton (CUDA)
kernels, a float64 reference, and the tile planner.

Source: FlashAttention (Dao et al. 2022, arXiv:2205.14135) and FlashAttention-2
(Dao 2023, arXiv:2307.08691).
"""
from .api import flash_attention, flash_attention_forward
from .planner import BUFFER_PRESETS, TilePlan, cpu_l2, cuda_smem, plan_tiles
from .reference import additive_mask, attention_reference, causal_offset

__all__ = ["flash_attention", "flash_attention_forward", "plan_tiles", "TilePlan",
           "BUFFER_PRESETS", "cpu_l2", "cuda_smem", "attention_reference",
           "additive_mask", "causal_offset"]
