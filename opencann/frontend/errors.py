"""`ConversionError` and its kinds, shared by the torch and ONNX frontends.

A model that cannot be converted to IR raises a `ConversionError` whose ``kind`` (set
where it is raised, one of `KINDS`) says what kind of obstacle it is, so that tools
(``opencann analyze``) report it by kind with the matching fix instead of guessing from
the message. `KINDS` maps each kind to (title, fix): the title names the obstacle in a
report line, the fix is the one-line remedy (the error's own message gives the details:
node, source line, parameter name).
"""
from __future__ import annotations

from typing import Dict, Tuple

_EAGER = "or use torch.compile(model, backend='opencann'), which runs such parts eagerly"

#: kind -> (title, fix)
KINDS: Dict[str, Tuple[str, str]] = {
    "data_dependent": ("data-dependent shape or value",
                       "keep shapes independent of the data (no x[x > 0], nonzero(), .item()), "
                       + _EAGER),
    "parameter_written": ("parameter written in forward",
                          "move the update out of forward (e.g. nn.Embedding(max_norm=...) "
                          "renorms its weight), or use torch.compile(model, backend='opencann'), "
                          "which keeps mutations"),
    "buffer_written": ("buffer written in forward",
                       "call model.eval() (BatchNorm in training mode updates its statistics), "
                       "or move the update out of forward, or use torch.compile(model, "
                       "backend='opencann'), which keeps mutations"),
    "control_flow": ("control flow on run-time values",
                     "compute both branches and pick with torch.where(pred, a, b), " + _EAGER),
    "size_arithmetic": ("non-integer arithmetic on a size",
                        "use integer arithmetic on sizes (x.shape[0] // 2), or compute it "
                        "outside the model"),
    "object_input": ("non-tensor object in forward",
                     "draw from torch's global RNG instead of a generator=, keep other objects "
                     "out of forward, " + _EAGER),
    "unsupported_op": ("op opencann cannot convert",
                       "replace the op, convert the model to a newer opset, or run it outside "
                       "the compiled part"),
    "random_op": ("random op", "draw the random values outside the model and pass them in"),
    "unsupported_dtype": ("unsupported element type", "cast it in the model"),
    "dynamic_shape": ("symbolic input shape",
                      "pass static sizes (input_shapes= for ONNX, or dynamic_shapes=)"),
    "bad_argument": ("bad argument to the compile call", "fix the argument the message names"),
    "malformed_model": ("malformed model",
                        "re-export the model (its graph is not sorted or is truncated)"),
    "internal": ("opencann converter disagrees with the exporter",
                 "report it as a bug of opencann with the message"),
}


class ConversionError(ValueError):
    """A model could not be converted to IR: the message names the node and source,
    ``kind`` (one of `KINDS`, required: every raise site says which) the obstacle.
    Raises ValueError for an unknown ``kind``."""

    def __init__(self, message: str, kind: str):
        if kind not in KINDS:
            raise ValueError(f"unknown ConversionError kind {kind!r}; one of {sorted(KINDS)}")
        super().__init__(message)
        self.kind = kind

    @property
    def title(self) -> str:
        """The kind's title (``"parameter written in forward"``)."""
        return KINDS[self.kind][0]

    @property
    def fix(self) -> str:
        """The kind's one-line fix."""
        return KINDS[self.kind][1]

    def __reduce__(self):
        return type(self), (str(self), self.kind)


__all__ = ["ConversionError", "KINDS"]
