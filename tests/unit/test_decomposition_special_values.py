"""Ops that core-ATen decompositions rewrite as chains of other ops land where eager's
kernel does at NaN, ±inf, ±0, denormals and overflow edges (values, NaN positions,
signs of zeros, strides), on two calls."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opencann
from helpers import assert_close


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


# == covered, already matching eager: decompositions at special values ====================
# Core-ATen decompositions rewrite these ops as chains of other ops; at NaN, ±inf, ±0,
# denormals and overflow edges the chain must land where eager's own kernel does.

_SPECIALS = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40, -1e-40,
                          -100.0, 100.0, 88.8, -88.8, 3.4e38, -3.4e38, 1.0, -1.0, 0.5, -3.0,
                          3.0, 20.0, -20.0, 1e-8, -1e-8, 0.999, -0.999, 2.5, -2.5]).view(2, 13)

_UNARY = {
    "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid, "mish": F.mish,
    "softplus_beta": lambda x: F.softplus(x, beta=2, threshold=5), "selu": F.selu,
    "celu": lambda x: F.celu(x, 0.5), "logsigmoid": F.logsigmoid, "log1p": torch.log1p,
    "expm1": torch.expm1, "logit_eps": lambda x: torch.logit(x, eps=1e-6), "sinc": torch.sinc,
    "hardshrink": F.hardshrink, "threshold": lambda x: F.threshold(x, 0.5, -7.0),
    "frac": torch.frac, "round_decimals": lambda x: torch.round(x, decimals=2),
    "xlogy_self": lambda x: torch.xlogy(x, x), "special_entr": torch.special.entr,
    "log_ndtr": torch.special.log_ndtr, "logcumsumexp": lambda x: x.logcumsumexp(-1),
    "cummax": lambda x: x.cummax(-1), "nanmean": lambda x: x.nanmean(-1),
    "var_mean": lambda x: torch.var_mean(x, -1, correction=0),
    "norm_inf": lambda x: x.norm(p=float("inf"), dim=-1), "normalize": lambda x: F.normalize(x, dim=-1),
    "aminmax": lambda x: torch.aminmax(x, dim=-1), "kthvalue": lambda x: x.kthvalue(3, -1),
    "pow_neg2": lambda x: x.pow(-2), "rpow_neg_base": lambda x: (-2.0) ** x, "rpow_zero": lambda x: 0.0 ** x,
}
_BINARY = {
    "atan2": torch.atan2, "hypot": torch.hypot, "heaviside": torch.heaviside,
    "nextafter": torch.nextafter, "remainder": torch.remainder, "fmod": torch.fmod,
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"), "xlogy": torch.xlogy,
    "logaddexp": torch.logaddexp, "lerp_tensor": lambda a, b: torch.lerp(a, b, b.sigmoid()),
    "addcdiv": lambda a, b: torch.addcdiv(a, a, b, value=0.5), "pow": torch.pow,
    "fmin": torch.fmin, "smooth_l1": lambda a, b: F.smooth_l1_loss(a, b, reduction="none"),
    "huber": lambda a, b: F.huber_loss(a, b, reduction="none", delta=2.0),
    "bce_logits": lambda a, b: F.binary_cross_entropy_with_logits(a, b.sigmoid(), reduction="none"),
    "kl_div_log": lambda a, b: F.kl_div(a, b, reduction="none", log_target=True),
    "cosine_similarity": lambda a, b: F.cosine_similarity(a, b, dim=-1),
}


@pytest.mark.parametrize("name", sorted(_UNARY) + sorted(_BINARY))
def test_decomposed_ops_keep_eagers_special_values(name):
    if name in _UNARY:
        fn, ins = _UNARY[name], (_SPECIALS,)
    else:
        fn, ins = _BINARY[name], (_SPECIALS, _SPECIALS.flip(1))
    m = _Fn(fn)
    cm = opencann.compile(m, tuple(t.clone() for t in ins))
    with torch.no_grad():
        ref = m(*ins)
        assert_close(cm(*ins), ref, strides=True, signed_zeros=True)
        assert_close(cm(*ins), ref, strides=True, signed_zeros=True)
