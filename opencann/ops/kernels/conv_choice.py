"""Which kernel a CPU convolution (ConvBiasAct, ConvAddAct) runs, by its size: oneDNN's
prepacked convolution on channels-last (NHWC) activations, or eager's own ATen
convolution on NCHW ones (``node.meta["kernel"]``: one of `CONV_KERNELS`, saved in model
files).

The rule (`choose_for_shape`), for ungrouped convolutions (N·Cout·Hout·Wout·Cin·KH·KW
multiply-adds, MACs): ``"aten"`` for a pointwise (1×1) convolution under
`MAX_ATEN_MACS_POINTWISE` MACs, and for a batch-1 convolution with a larger kernel under
`MAX_ATEN_MACS_BATCH1`; ``"onednn"`` otherwise (grouped and depthwise convolutions too:
not measured). Measured with ``bench/cpu_layout.py sizes`` (80 shapes: batch 1 and 8,
channels 3→8 … 64→64, 1×1 and 3×3, 8×8 … 56×56; 1 thread, minimum of 15 interleaved
rounds) on the 2-core Intel Xeon with AVX-512/AVX512-BF16/AMX this project runs on:

- oneDNN's channels-last kernel costs a near-constant 25-35 µs per call however small the
  convolution; eager runs a 1×1 convolution at batch < 16 as one GEMM and a batch-1 3×3
  one without oneDNN, 3-6× faster on the smallest shapes. Pointwise: eager faster up to
  6-13 M MACs (1.1-1.6× at 2-8 M, even at 8.4 M); batch-1 3×3: eager faster up to 0.7 M
  (1.2-2.7×: the two-conv CNN's 3→8 and 8→8 convolutions at 32×32, 0.22 and 0.59 M,
  12.7 vs 34 µs and 26 vs 48 µs), oneDNN faster from 1.8 M (0.78-0.98×).
- at batch 2, 4 and 8 eager's 3×3 convolutions go through oneDNN on NCHW and oneDNN's NHWC
  kernel is faster at every measured size (0.6-0.8×, from 0.1 M MACs).
- ResNet-50 (batch 1, 224×224: 12.8-231 M MACs per convolution) keeps oneDNN and NHWC
  everywhere; in a channels-last region a convolution also saves the reorders around it.

The rule is fp32's: a bf16 convolution (mixed precision) always binds oneDNN's
prepacked kernel (`choose`), which beat eager's bf16 NCHW one at every measured size.

Applied by the layout stage (`opencann.passes.layout.cpu_layout`) to a convolution whose
input is NCHW only: inside a channels-last region (input already NHWC) a convolution
stays on oneDNN, as a TransData back to NCHW and oneDNN's slower NCHW read after it would
cost what eager's kernel saves (not measured per shape). With ``layout_selection``
disabled every convolution keeps oneDNN's kernel, as before the rule.

Measured at 1 thread: at more intra-op threads eager uses oneDNN for 1×1 convolutions too,
and the thresholds may differ; re-check them on another CPU with the bench. A fixed,
measured rule and not a race at compile time: compile reports and the layout decisions
stay identical from run to run on a loaded machine.

The ``aten`` kernel is eager's kernel (``torch.nn.functional.conv2d``, bias included),
so its values are eager's bit for bit (NaN/Inf included); the activation runs after it
in place with eager's kernel, as for the oneDNN one.
"""
from __future__ import annotations

from typing import Tuple

import torch

from ...devices.cpu import onednn_bf16_available
from ...ir import DataType, Node

# the kernels a ConvBiasAct / ConvAddAct may bind (node.meta["kernel"], saved in model files)
CONV_KERNELS = ("onednn", "aten")
# the dtypes of oneDNN's fused convolution (ConvBiasAct / ConvAddAct; bf16 where oneDNN has
# bf16 kernels on this CPU: AVX-512 BW/VL, AVX-NE-CONVERT or AMX, `onednn_bf16_available`);
# a convolution in another dtype stays a Conv2D (ATen's kernel)
ONEDNN_CONV_DTYPES = (torch.float32, torch.bfloat16) if onednn_bf16_available() else (torch.float32,)
# multiply-adds below which eager's NCHW convolution runs faster (module docstring)
MAX_ATEN_MACS_POINTWISE = 8_000_000   # 1x1 kernels, any batch
MAX_ATEN_MACS_BATCH1 = 1_000_000      # larger kernels, batch 1


def conv_macs(n: int, cin: int, cout: int, kh: int, kw: int, ho: int, wo: int, groups: int) -> int:
    """Multiply-adds of a 2-D convolution: N·Cout·Hout·Wout·(Cin/groups)·KH·KW (ints)."""
    return n * cout * ho * wo * (cin // max(groups, 1)) * kh * kw


def choose_for_shape(n: int, cin: int, cout: int, kh: int, kw: int, ho: int, wo: int,
                     groups: int) -> Tuple[str, str]:
    """(kernel, reason) for a convolution of these sizes (ints: batch, input and output
    channels, kernel height and width, output height and width, groups): ``"aten"`` with
    the reason oneDNN's NHWC kernel was not chosen where the module docstring's rule says
    eager's NCHW kernel is faster, else ``"onednn"`` with an empty reason."""
    macs = conv_macs(n, cin, cout, kh, kw, ho, wo, groups)
    if groups != 1:
        return "onednn", ""
    if kh == kw == 1:
        limit, what = MAX_ATEN_MACS_POINTWISE, "a 1x1 convolution"
    elif n == 1:
        limit, what = MAX_ATEN_MACS_BATCH1, f"a batch-1 {kh}x{kw} convolution"
    else:
        return "onednn", ""
    if macs >= limit:
        return "onednn", ""
    return "aten", (f"{what} of {macs / 1e6:.2f} M multiply-adds (< {limit / 1e6:g} M) runs "
                    "faster on eager's NCHW kernel than on oneDNN's channels-last one on this "
                    "CPU (measured: bench/cpu_layout.py sizes)")


def choose(node: Node) -> Tuple[str, str]:
    """(kernel, reason) for the CPU convolution ``node`` (inputs x [N, Cin, H, W] and a
    weight [Cout, Cin/groups, KH, KW]; output [N, Cout, Ho, Wo]): `choose_for_shape` on
    its static sizes; ``("onednn", "")`` when they are not static or the convolution is
    not fp32 (the rule is fp32's: in bf16 eager's NCHW convolution reorders its plain
    weight on every call and oneDNN's prepacked channels-last one measured 1.9-2.3x
    faster at every size tried, from 3→8 3×3 at 32×32 to 64→64 at 56×56, batch 1 and 2,
    1 thread, least of 40 calls). The layout stage applies it and records
    ``node.meta["kernel"] = "aten"`` (what `make_conv_kernel` binds)."""
    x, w, y = node.inputs[0].desc, node.inputs[1].desc, node.outputs[0].desc
    if not (x.is_static and w.is_static and y.is_static and x.rank == 4 and w.rank == 4):
        return "onednn", ""
    if y.dtype != DataType.FLOAT:
        return "onednn", ""
    return choose_for_shape(int(x.shape[0]), int(x.shape[1]), int(w.shape[0]), int(w.shape[2]),
                            int(w.shape[3]), int(y.shape[2]), int(y.shape[3]),
                            int(node.attrs.get("groups", 1)))


__all__ = ["CONV_KERNELS", "ONEDNN_CONV_DTYPES", "MAX_ATEN_MACS_BATCH1", "MAX_ATEN_MACS_POINTWISE", "choose", "choose_for_shape", "conv_macs"]
