"""The one list of special values the eager-parity probes place in their inputs.

Each value is there for a fault it catches (`GROUPS`); a probe takes the groups that can
matter for the kernels it compares (`special_values`), always in the list's order, so
the position of every value in a probe tensor is fixed by this file alone:

- "nan", "inf": NaN and ±inf must stay where eager's ops put them (oneDNN's AVX-512
  exact GELU maps +inf to NaN: pytorch/pytorch#185770).
- "near_max": ±1.7e38, whose GELU overflows to inf in oneDNN's AVX-512 kernel and not in
  ATen's vectorised loop (the layout probes).
- "max": ±3e38, near float32's max 3.4e38: a sum or a square of it overflows.
- "cube_overflow": ±1e13, whose cube (GELU's tanh form, 0.044715·x³) overflows float32.
- "square_overflow": ±1e20, whose square overflows float32 (LayerNorm's sum of squares).
- "zero": −0.0 and 0.0, whose sign an elementwise kernel at another layout may flip.
"""
from __future__ import annotations

from typing import Tuple

NAN, INF = float("nan"), float("inf")

GROUPS: Tuple[Tuple[str, Tuple[float, ...]], ...] = (
    ("nan", (NAN,)),
    ("inf", (INF, -INF)),
    ("near_max", (1.7e38, -1.7e38)),
    ("max", (3e38, -3e38)),
    ("cube_overflow", (1e13, -1e13)),
    ("square_overflow", (1e20, -1e20)),
    ("zero", (-0.0, 0.0)),
)
SPECIAL_VALUES: Tuple[float, ...] = tuple(v for _, vs in GROUPS for v in vs)


def special_values(*groups: str) -> Tuple[float, ...]:
    """The values of the named `GROUPS`, in `SPECIAL_VALUES`' order. Raises KeyError
    naming an unknown group."""
    known = dict(GROUPS)
    for g in groups:
        if g not in known:
            raise KeyError(f"unknown special-value group {g!r}: one of {', '.join(known)}")
    return tuple(v for name, vs in GROUPS if name in groups for v in vs)


# the activation probes (GELU erf/tanh, SiLU): NaN, ±inf, ±3e38, ±1e13
ACTIVATION_SPECIALS = special_values("nan", "inf", "max", "cube_overflow")
# the norm probes (RMSNorm, LayerNorm) and bench/special_values_audit.py: those and ±1e20
NORM_SPECIALS = special_values("nan", "inf", "max", "cube_overflow", "square_overflow")
# the layout and convolution post-op probes: ±1.7e38 and ±0.0 too, no ±1e20
LAYOUT_SPECIALS = special_values("nan", "inf", "near_max", "max", "cube_overflow", "zero")

__all__ = ["ACTIVATION_SPECIALS", "GROUPS", "LAYOUT_SPECIALS", "NORM_SPECIALS", "SPECIAL_VALUES",
           "special_values"]
