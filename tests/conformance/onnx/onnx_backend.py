"""opencann as an ``onnx.backend`` (``onnx.backend.base.Backend``), for the ONNX
package's own backend test suite (``onnx.backend.test.runner.Runner``).

``prepare`` compiles the model with ``opencann.compiler.compile_onnx``; models below
opset 13 (the ``pytorch-converted``/``pytorch-operator`` cases are opset 6-9) are first
upgraded with ``onnx.version_converter``, as the frontend's error message advises users.
"""
from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx.backend.base import Backend, BackendRep

from opencann.engine import compile_onnx
from opencann.frontend.onnx.load import MIN_OPSET


def upgrade(model: onnx.ModelProto) -> onnx.ModelProto:
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset >= MIN_OPSET:
        return model
    from onnx import version_converter
    model = version_converter.convert_version(model, MIN_OPSET)
    # the converter adds initializers without graph inputs, which IR version 3 forbids
    model.ir_version = max(model.ir_version, 7)
    return model


class OpencannRep(BackendRep):
    def __init__(self, cm):
        self.cm = cm

    def run(self, inputs, **kwargs):
        if isinstance(inputs, np.ndarray):
            inputs = [inputs]
        ts = [torch.from_numpy(np.array(x)) for x in inputs]
        return tuple(o.numpy() for o in self.cm(*ts))


class OpencannBackend(Backend):
    @classmethod
    def prepare(cls, model, device="CPU", **kwargs):
        return OpencannRep(compile_onnx(upgrade(model)))

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device == "CPU"
