"""AMCT for PyTorch's names over opencann's post-training quantization
(`opencann.engine.quantize`): ``create_quant_config`` → ``quantize_model`` (calibrate and
convert in one step: AMCT's ``quantize_model`` + calibration run + ``save_model``'s
conversion) → ``save_model`` (the ``.ocm`` model file). The engine module holds the
flow; this one adds the file step, as AMCT's toolkit does."""
from __future__ import annotations

from ..engine.quantize import calibrate, create_quant_config, quant_report, quantize, quantize_model


def save_model(quantized, path: str) -> None:
    """AMCT's ``save_model``: write a model from `quantize_model` to ``path`` (an ``.ocm``
    file: int8 weights, their scales and each layer's scale_d / offset_d in the graph and
    report). Raises what ``opencann.save`` raises (TypeError for anything but a compiled
    model)."""
    from ..runtime.model_file import save
    from ..engine import CompiledModel
    if not isinstance(quantized, CompiledModel):
        raise TypeError(f"save_model takes what quantize_model returns, got {type(quantized).__name__}")
    save(quantized, path)


__all__ = ["calibrate", "create_quant_config", "quant_report", "quantize", "quantize_model", "save_model"]
