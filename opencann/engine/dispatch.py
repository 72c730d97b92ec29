"""``opencann.compile`` of a torch module by shape policy (`compile_torch`): gears, dynamic
dims or one static shape; above `entry`, `dynamic` and `gears`, which it chooses between."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from .compiled_model import CompiledModel
from .dynamic import compile_dynamic
from .entry import compile_module
from .gears import compile_with_gears
from .options import GEAR_OPTIONS


def compile_torch(model: torch.nn.Module, example_inputs, device: str = "cpu",
                  options: Optional[Dict[str, Any]] = None, example_kwargs=None,
                  dynamic_shapes: Any = None, dim_ranges: Any = None) -> CompiledModel:
    """``opencann.compile`` of a torch module, by shape policy: a gear option
    (``dynamic_batch_size``, ``dynamic_image_size``, ``dynamic_dims``) builds gears
    (`opencann.engine.gears`), ``dynamic_shapes`` dynamic dims (`opencann.engine.dynamic`),
    else one static shape (`compile_module`). Raises ValueError (one line) for
    ``dim_ranges`` without ``dynamic_shapes`` and what those raise."""
    if any(k in (options or {}) for k in GEAR_OPTIONS):
        return compile_with_gears(model, example_inputs, dict(options), dynamic_shapes,
                                  device=device, example_kwargs=example_kwargs)
    if dynamic_shapes is not None:
        return compile_dynamic(model, example_inputs, dynamic_shapes, device=device,
                               options=options, example_kwargs=example_kwargs,
                               dim_ranges=dim_ranges)
    if dim_ranges is not None:
        raise ValueError("dim_ranges gives the ranges of dims named in dynamic_shapes: pass "
                         "dynamic_shapes={'input_ids': {1: 'seq'}} too")
    return compile_module(model, example_inputs, device=device, options=options,
                          example_kwargs=example_kwargs)


__all__ = ["compile_torch"]
