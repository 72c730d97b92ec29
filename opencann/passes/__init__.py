"""The optimization pipeline (five stages: prepare, fusion, layout, memory, schedule)."""
from .attention import FuseFlashAttention
from .base import Pass, PassContext, PassManager
from .drop_unused_outputs import DropUnusedOutputs
from .fusion import FoldBatchNorm, FuseConvAct, FuseConvAddAct, FuseLinearAct
from .layout import LayoutSelection
from .memory import plan_memory
from .precision import MixedPrecision
from .prepare import (CommonSubexpressionElimination, ConstantFolding, DeadCodeElimination,
                      IdentityElimination)
from .schedule import SingleStreamSchedule
from .vnpu_layout import NpuLayoutSelection


def default_pipeline() -> PassManager:
    """Prepare → fusion → layout → schedule. (Memory planning runs after scheduling,
    on the final order, in the compiler.)"""
    return PassManager([
        ConstantFolding(), DeadCodeElimination(), CommonSubexpressionElimination(),
        IdentityElimination(), DropUnusedOutputs(), MixedPrecision(),
        FoldBatchNorm(), FuseConvAct(), FuseConvAddAct(), FuseLinearAct(), FuseFlashAttention(),
        DeadCodeElimination(), LayoutSelection(), NpuLayoutSelection(), SingleStreamSchedule(),
    ])


__all__ = ["Pass", "PassContext", "PassManager", "default_pipeline", "plan_memory"]
