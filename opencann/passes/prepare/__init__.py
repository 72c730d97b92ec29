"""Stage 1, prepare: constant folding, dead-code elimination, common-subexpression
elimination, identity elimination, mixed precision. (Shape/dtype inference runs at
conversion, checked against FX.) One pass per module."""
from .constant_folding import FOLD_LIMIT_BYTES, ConstantFolding
from .cse import CommonSubexpressionElimination
from .dce import DeadCodeElimination
from .identity import IdentityElimination
from .precision import MODES, MixedPrecision, default_keep_fp32, low_dtype, precision_summary

__all__ = ["ConstantFolding", "DeadCodeElimination", "CommonSubexpressionElimination",
           "IdentityElimination", "MixedPrecision", "FOLD_LIMIT_BYTES", "default_keep_fp32", "MODES",
           "low_dtype", "precision_summary"]
