"""Eager parity: does a fused, re-laid-out or folded kernel give eager's NaN, ±inf,
signed zeros and overflows on this CPU? One package for every such check.

- `specials`: the one list of special values the probes place in their inputs.
- `compare`: the one comparison (`first_difference`: NaN positions, inf signs, zeros'
  signs, finite values within a tolerance).
- `probe`: `Probe`, a declared check (the op or fusion it guards, the kernel it compares
  with eager, its inputs), cached per argument tuple in memory and, through `cache`, on
  disk per (CPU flags, torch version, probe version) in the user cache directory
  (``OPENCANN_CACHE_DIR`` overrides it), so a second process pays nothing.
- The probes: `special_values` (formula fusions: GELU, SiLU in `activations`, RMSNorm and
  LayerNorm in `norms`), `layout_probe` (an ATen op at another layout), `conv_probes`
  (oneDNN convolution post-ops; a convolution lowered to bf16 / fp16), `activation_low`
  (an activation lowered to bf16 / fp16); `layout_node` asks them for a graph node.
- Not probes but the same question answered by proof: `norm_range` (where ATen's
  LayerNorm is the formula's, the fused kernels' guard), `batchnorm_fold` (where folding
  BatchNorm into a convolution keeps eager's values), and `formulas` (eager's spelled-out
  ops, the probes' reference and the fused LayerNorm's fallback).

This package sits in the ops layer: it imports `opencann.ir` and `opencann.devices` (CPU
facts only), never passes or the engine.
"""
from __future__ import annotations

from .activation_low import activation_low_precision_differs
from .batchnorm_fold import fold_values, input_bound
from .compare import first_difference
from .conv_probes import conv_low_precision_differs, conv_post_op_differs, conv_sum_differs
from .layout_node import eager_layout, kernel_layout_differs, layout_dependent, strides_layout
from .layout_probe import layout_differs
from .probe import PROBES, RUNS, Probe, clear_memory
from .special_values import FORMULAS, special_values_differ
from .specials import SPECIAL_VALUES

__all__ = ["FORMULAS", "PROBES", "Probe", "RUNS", "SPECIAL_VALUES", "activation_low_precision_differs",
           "clear_memory",
           "conv_low_precision_differs", "conv_post_op_differs", "conv_sum_differs", "eager_layout", "first_difference",
           "fold_values", "input_bound", "kernel_layout_differs", "layout_dependent",
           "layout_differs", "special_values_differ", "strides_layout"]
