"""Stage 2, fusion: one rewrite per module (batchnorm, conv_act, conv_add_act,
linear_act, qkv_linear, add_layer_norm_cast, add_layer_norm, add_rms_norm, rotary_mul, decode_kv_update, apply_rotary_pos_emb, decode_rope, attention; the patterns silu, gelu_tanh, gelu_erf, rms_norm,
layer_norm, gated_mlp; qdq_to_int8: ONNX QDQ layers on int8 kernels; qdq_eltwise_int8: QDQ Add / MaxPool on uint8; quantize_int8: int8 kernels from calibration; fuse_requant: int8 layers writing uint8 for int8 readers; elementwise: generated kernels for elementwise groups; user_rule: rules registered by users; consecutive_reshapes, nop_reshape: view cleanups after them; additive_attention_mask: a bool attention mask made additive once); each says why a match was not rewritten."""
from .add_layer_norm import FuseAddLayerNorm
from .additive_attention_mask import AdditiveAttentionMask
from .add_layer_norm_cast import FuseAddLayerNormCast
from .add_rms_norm import FuseAddRmsNorm
from .apply_rotary_pos_emb import FuseApplyRotaryPosEmb
from .attention_kernel import ChooseAttentionKernel
from .attention import FuseFlashAttention
from .batchnorm import FoldBatchNorm
from .consecutive_reshapes import FuseConsecutiveReshapes
from .common import CpuFusion
from .conv_act import FuseConvAct
from .conv_add_act import FuseConvAddAct
from .decode_kv_update import FuseDecodeKvUpdate
from .decode_rope import FuseDecodeRope
from .elementwise import FuseElementwise
from .gated_mlp import FuseGatedMLP
from .gelu_erf import FuseGeluErf
from .gelu_tanh import FuseGeluTanh
from .layer_norm import FuseLayerNorm
from .linear_act import FuseLinearAct
from .nop_reshape import EliminateNopReshape
from .qkv_linear import FuseQKVLinear
from .quantize_int8 import QuantizeInt8
from .fuse_requant import FuseRequant
from .add_layer_norm_quant import FuseAddLayerNormQuant
from .qdq_to_int8 import QdqToInt8
from .qdq_eltwise_int8 import QdqEltwiseToInt8
from .rms_norm import FuseRMSNorm
from .rotary_mul import FuseRotaryMul
from .silu import FuseSiLU
from .user_rule import FusionRule, UserFusion, register_rule, unregister_rule, user_passes

__all__ = ["AdditiveAttentionMask", "EliminateNopReshape", "FuseConsecutiveReshapes", "FoldBatchNorm", "FuseConvAct", "FuseConvAddAct", "FuseLinearAct",
           "FuseFlashAttention", "ChooseAttentionKernel", "FuseQKVLinear", "FuseAddLayerNorm", "FuseAddLayerNormCast", "FuseAddRmsNorm", "FuseRotaryMul", "FuseDecodeKvUpdate", "FuseApplyRotaryPosEmb", "FuseDecodeRope", "CpuFusion", "FuseSiLU", "FuseGeluTanh", "FuseGeluErf",
           "FuseRMSNorm", "FuseLayerNorm", "FuseGatedMLP", "FuseElementwise", "FusionRule", "UserFusion",
           "register_rule", "unregister_rule", "user_passes", "QuantizeInt8", "FuseRequant", "FuseAddLayerNormQuant", "QdqToInt8", "QdqEltwiseToInt8"]
