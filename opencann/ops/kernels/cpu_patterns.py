"""CPU kernels of the ops the pattern fusions make (``opencann.passes.fusion``): bind-time
factories ``f(node, in_descs, consts) -> callable(*inputs)``, inputs in ``node.inputs``
order. Each repeats the eager computation it replaces with ATen's fused kernels, so
outputs match eager (bit-for-bit where noted).

- `make_rms_norm_kernel` (RmsNorm): ATen ``rms_norm`` (bit-for-bit the spelled-out fp32
  form: x·rsqrt(mean(x²) + eps)·w); with ``upcast`` as transformers' LlamaRMSNorm:
  normalize in float32, cast back, then multiply by the weight in the input's dtype.
- `make_gated_mlp_kernel` (GatedMLP): silu(x·W1) * (x·W3) as two ``mm`` calls (eager's
  GEMMs, same bits), ATen's SiLU and the product in place: one output tensor.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ...ir import Node, TensorDesc


def make_rms_norm_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """RmsNorm(input [..., D], weight [D] or none; attrs eps, upcast) -> [..., D], the
    input's dtype."""
    shape, eps = list(node.attrs["normalized_shape"]), node.attrs["eps"]
    if not node.attrs.get("upcast"):
        def run(x, w=None):
            return torch.rms_norm(x, shape, w, eps)
        return run

    def run_upcast(x, w=None):
        y = torch.rms_norm(x.to(torch.float32), shape, None, eps).to(x.dtype)
        return y if w is None else w * y
    return run_upcast


def make_gated_mlp_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """GatedMLP(x [M, K], w1 [K, N], w3 [K, N]) -> silu(x @ w1) * (x @ w3), viewed as the
    node's output shape (e.g. [B, S, N] with B·S = M); float dtypes."""
    shape = tuple(int(s) for s in node.outputs[0].desc.shape)
    silu_ = torch.nn.functional.silu

    def run(x, w1, w3):
        a = torch.mm(x, w1)
        silu_(a, inplace=True)
        return a.mul_(torch.mm(x, w3)).view(shape)
    return run


__all__ = ["make_gated_mlp_kernel", "make_rms_norm_kernel"]
