"""The optimization pipeline (stages: prepare, fusion, layout, schedule, memory), one
pass per module under ``prepare/``, ``fusion/`` and ``layout/``; the public names are
re-exported here."""
from .base import Pass, PassContext, PassManager, RewritePass, Skip
from .fusion import FoldBatchNorm, FuseConvAct, FuseConvAddAct, FuseFlashAttention, FuseLinearAct
from .fusion import AdditiveAttentionMask, EliminateNopReshape, FuseConsecutiveReshapes
from .fusion import ChooseAttentionKernel, FuseAddLayerNorm, FuseAddLayerNormCast, FuseAddRmsNorm, FuseApplyRotaryPosEmb, FuseDecodeKvUpdate, FuseDecodeRope, FuseRotaryMul, FuseQKVLinear, FuseRequant, FuseAddLayerNormQuant, QdqEltwiseToInt8, QdqToInt8, QuantizeInt8
from .fusion import (FuseElementwise, FuseGatedMLP, FuseGeluErf, FuseGeluTanh, FuseLayerNorm, FuseRMSNorm, FuseSiLU,
                     user_passes)
from .layout import LayoutSelection, NpuLayoutSelection, VnpuQuantizeInt8, VnpuUbEpilogue
from .memory import MemoryPlanning, plan_memory
from .prepare import (CommonSubexpressionElimination, ConstantFolding, DeadCodeElimination,
                      IdentityElimination, MixedPrecision)
from .prepare.drop_unused_outputs import DropUnusedOutputs
from .prepare.input_inplace import InputInplace
from .schedule import SingleStreamSchedule, apply_schedule


def default_pipeline() -> PassManager:
    """Prepare → fusion → layout → schedule → memory (planning on the final order; the
    plan is ``ctx.artifacts["memory_plan"]``). ``fold_batchnorm``, the user rules and
    the fusions that recognise one op spelled out (SiLU, GELU, RMSNorm, LayerNorm) run
    before ``precision``, on the model's own dtypes: the folded fp32 weight is cast once,
    and ``precision`` then lowers (or keeps in fp32) the one op each leaves, as it does
    the op written directly (run after, the Casts ``precision`` puts around a kept-fp32
    BatchNorm or ``pow`` split the pattern and block both the fold and the fusion).
    ``quantize_int8`` (``options['quant_config']``) runs after the CPU layout stage, on the
    fused ops in the layouts it chose (``qdq_to_int8`` just before it, for ONNX QDQ models), and
    ``fuse_requant``, ``fuse_add_layer_norm_quant`` and ``qdq_eltwise_int8`` right after it; on the vnpu its counterpart
    ``vnpu_quantize_int8`` (the same ``quant_config``) runs just before ``npu_layout``, on the
    unfused Conv2D / MatMulV2, so the layout pass stores its int8 values at C0 = 32. The compiler adds kernel binding as the
    last stage when it builds a callable model."""
    return PassManager([
        ConstantFolding(), DeadCodeElimination(), CommonSubexpressionElimination(),
        IdentityElimination(), DropUnusedOutputs(), InputInplace(), FoldBatchNorm(), *user_passes(), FuseSiLU(),
        FuseGeluTanh(), FuseGeluErf(), FuseRMSNorm(), FuseLayerNorm(), MixedPrecision(), FuseGatedMLP(), FuseConvAct(), FuseConvAddAct(), FuseLinearAct(), FuseQKVLinear(),
        FuseAddLayerNormCast(), FuseAddLayerNorm(), FuseAddRmsNorm(), FuseRotaryMul(), FuseDecodeKvUpdate(), FuseApplyRotaryPosEmb(), FuseDecodeRope(), FuseFlashAttention(), AdditiveAttentionMask(), ChooseAttentionKernel(),
        FuseConsecutiveReshapes(), EliminateNopReshape(), FuseElementwise(), DeadCodeElimination(), LayoutSelection(), QdqToInt8(), QuantizeInt8(), FuseRequant(), FuseAddLayerNormQuant(), QdqEltwiseToInt8(),
        VnpuQuantizeInt8(), NpuLayoutSelection(), VnpuUbEpilogue(), SingleStreamSchedule(),
        MemoryPlanning(),
    ])


__all__ = ["AdditiveAttentionMask", "EliminateNopReshape", "FuseConsecutiveReshapes", "Pass", "PassContext", "PassManager", "RewritePass", "Skip", "default_pipeline",
           "plan_memory", "MemoryPlanning", "ConstantFolding", "DeadCodeElimination",
           "CommonSubexpressionElimination", "IdentityElimination", "MixedPrecision",
           "FoldBatchNorm", "FuseConvAct", "FuseConvAddAct", "FuseLinearAct",
           "FuseQKVLinear", "FuseAddLayerNorm", "FuseAddLayerNormCast", "FuseAddRmsNorm", "FuseRotaryMul", "FuseDecodeKvUpdate", "FuseApplyRotaryPosEmb", "FuseDecodeRope", "FuseFlashAttention", "ChooseAttentionKernel", "FuseSiLU", "FuseGeluTanh",
           "FuseGeluErf", "FuseRMSNorm",
           "FuseLayerNorm", "FuseGatedMLP", "FuseElementwise", "LayoutSelection", "NpuLayoutSelection", "VnpuQuantizeInt8", "VnpuUbEpilogue",
           "SingleStreamSchedule", "apply_schedule", "DropUnusedOutputs", "QuantizeInt8", "InputInplace",
           "FuseRequant", "FuseAddLayerNormQuant", "QdqToInt8", "QdqEltwiseToInt8"]
