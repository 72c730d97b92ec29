"""Stage 2, fusion: one rewrite per module (batchnorm, conv_act, conv_add_act,
linear_act, attention); each says why a match was not rewritten."""
from .attention import FuseFlashAttention
from .batchnorm import FoldBatchNorm
from .common import CpuFusion
from .conv_act import FuseConvAct
from .conv_add_act import FuseConvAddAct
from .linear_act import FuseLinearAct

__all__ = ["FoldBatchNorm", "FuseConvAct", "FuseConvAddAct", "FuseLinearAct",
           "FuseFlashAttention", "CpuFusion"]
