"""The ONNX converter registry: ONNX op type (default domain) → converter function.

Converter modules (``nn.py``, ``tensor.py``, ``quant.py``) register with `converts` when
imported; ``convert.py`` imports them to populate `CONVERTERS` before converting.
"""
from __future__ import annotations

from typing import Callable, Dict, List

from ...ir import Value
from .converter import Converter, NotConverted, OnnxNode

__all__ = ["CONVERTERS", "Convert", "NotConverted", "converts"]

Convert = Callable[[Converter, OnnxNode], List[Value]]
CONVERTERS: Dict[str, Convert] = {}


def converts(*op_types: str):
    """Decorator registering a converter for ONNX ``op_types`` (default domain)."""
    def deco(fn: Convert) -> Convert:
        for t in op_types:
            CONVERTERS[t] = fn
        return fn
    return deco
