"""ONNX frontend: ``load_model`` (read + validate) and ``from_onnx`` (ONNX → IR)."""
from .convert import CONVERTERS, ConversionError, from_onnx
from .load import OnnxLoadError, load_model

__all__ = ["CONVERTERS", "ConversionError", "OnnxLoadError", "from_onnx", "load_model"]
