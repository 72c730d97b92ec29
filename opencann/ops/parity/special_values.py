"""`special_values_differ`: may a formula fusion run this CPU's kernel instead of the
spelled-out formula without moving NaN, ±inf or an overflow?

One probe per fused formula (`FORMULA_PROBES`), each declaring the fusion it guards:
the activations (`activations.activation_differs`) and the norms
(`norms.norm_differs`). The fusions ask before they rewrite and keep the spelled-out form
(a Skip with the probe's reason) where the kernels differ; a model file records the
fusions it holds (graph meta ``formula_kernels``) and is refused with that reason on a
CPU where they would differ (``runtime/model_file.py``). Answers are cached per
(formula, dtype) in memory and on disk (`probe.Probe`), so only the first process on a
machine pays (a few ms for an activation, seconds for LayerNorm).
"""
from __future__ import annotations

import functools
from typing import Dict, Optional

import torch

from .activations import ACTS, activation_differs
from .norms import NORMS, norm_differs
from .probe import Probe, register

FORMULAS = ACTS + NORMS

_GUARDS = {"gelu": "FuseGeluErf (passes/fusion/gelu_erf.py)",
           "gelu_tanh": "FuseGeluTanh (passes/fusion/gelu_tanh.py)",
           "silu": "FuseSiLU (passes/fusion/silu.py)",
           "rms_norm": "FuseRmsNorm (passes/fusion/rms_norm.py)",
           "layer_norm": "FuseLayerNorm (passes/fusion/layer_norm.py)"}
_KERNELS = {"gelu": "ATen's gelu (functional, .out, in place; contiguous, strided, channels-last) "
                    "and oneDNN's convolution with the gelu post-op",
            "gelu_tanh": "ATen's gelu(approximate='tanh') (functional, .out, in place; "
                         "contiguous, strided, channels-last)",
            "silu": "ATen's silu (functional, .out, in place; contiguous, strided, "
                    "channels-last) and oneDNN's convolution with the swish post-op",
            "rms_norm": "ATen's rms_norm with and without a weight, contiguous and strided",
            "layer_norm": "ATen's native_layer_norm behind the fused kernel's range guard, "
                          "each variance and root form, with and without γ, β"}
_INPUTS = {"activation": "linspace(-4, 4) × 1000 with NaN, ±inf, ±3e38, ±1e13 at the head, "
                         "body and tail",
           "norm": "rows of 1000 randn with NaN, ±inf, ±3e38, ±1e13, ±1e20 at the head, body "
                   "and tail; rows of huge values; clean rows"}


def _run(act: str, dtype: torch.dtype) -> Optional[str]:
    return norm_differs(act, dtype) if act in NORMS else activation_differs(act, dtype)


FORMULA_PROBES: Dict[str, Probe] = {
    act: register(Probe(act, guards=_GUARDS[act], kernel=_KERNELS[act],
                        inputs=_INPUTS["norm" if act in NORMS else "activation"],
                        run=functools.partial(_run, act)))
    for act in FORMULAS}


def special_values_differ(act: str, dtype: torch.dtype) -> Optional[str]:
    """None when every CPU kernel a fused ``act`` node can run as gives NaN and ±inf (and,
    for the norms, overflows and values to rounding) exactly where the spelled-out
    formula does for ``dtype`` inputs; else one line naming the kernel, the input and
    both results (the fusion's Skip reason, and the reason a model file fused that way is
    refused on this CPU).

    ``act``: one of `FORMULAS` ("gelu" (erf), "gelu_tanh", "silu", "rms_norm",
    "layer_norm"); ``dtype``: a floating torch dtype. Cached per (act, dtype) in memory
    and on disk. Raises KeyError for another ``act``. Source of the fault it guards
    against: pytorch/pytorch#185770 (oneDNN's AVX-512 exact GELU returns NaN for +inf)."""
    return FORMULA_PROBES[act](dtype)


__all__ = ["FORMULAS", "FORMULA_PROBES", "special_values_differ"]
