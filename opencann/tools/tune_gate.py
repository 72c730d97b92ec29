"""The accuracy gate of `opencann.tools.tune`: msprobe's rules for one compared tensor.

Rules, in order (sources: Ascend PyTorch accuracy comparison, "Accuracy Reached or Not":
cosine below 0.99 fails, a max absolute error under 0.001 passes; msprobe's pre-check
error-ratio ("dual hundredth" for bf16/fp16, "dual thousandth" for fp32) standard):

1. NaN / ±inf positions of the actual and expected tensors differ: fail (``nan_inf``).
2. cosine similarity <= 0.99: fail (``cosine``).
3. max absolute error < 0.001: pass (``max_abs``).
4. more than ``ERROR_RATIO[dtype][1]`` of the elements have a relative error above
   ``ERROR_RATIO[dtype][0]``: fail (``error_ratio``); else pass.

As in msprobe's pre-check, rule 4 compares the op's low-precision result with the same
op computed in fp32 *on the same inputs* (``same_input``), so it judges the kernel's
arithmetic, not the rounding of its inputs: a bf16 GEMM judged against fp32 eager has
~15% of its elements above 1% relative error (outputs near zero), which would refuse
every bf16 matmul. The rounding of the inputs is what rules 1-3 judge against eager.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .compare import EPS, metrics

COSINE_FAIL = 0.99       # a layer fails at cosine <= this
MAX_ABS_PASS = 1e-3      # a layer whose max abs error is below this passes
#: dtype name -> (relative error bound, largest share of elements above it)
ERROR_RATIO: Dict[str, Tuple[float, float]] = {
    "bfloat16": (1e-2, 1e-2), "float16": (1e-2, 1e-2), "float32": (1e-3, 1e-3),
}


@dataclass(frozen=True)
class Verdict:
    """One gate decision: ``passed``; ``rule``: the rule that decided (``nan_inf``,
    ``cosine``, ``max_abs``, ``error_ratio``, ``metric``); ``detail``: one line with the
    figures; ``cosine`` and ``max_abs`` against the expected tensor."""

    passed: bool
    rule: str
    detail: str
    cosine: float = 1.0
    max_abs: float = 0.0


def error_ratio(actual: torch.Tensor, expected: torch.Tensor, bound: float) -> float:
    """The share (0..1) of finite elements whose relative error ``|a - e| / (|e| + EPS)``
    (msprobe's, `opencann.tools.compare.EPS`) is above ``bound``; 0 for no finite element."""
    a, e = actual.detach().double().flatten(), expected.detach().double().flatten()
    fin = torch.isfinite(a) & torch.isfinite(e)
    if not bool(fin.any()):
        return 0.0
    rel = (a[fin] - e[fin]).abs() / (e[fin].abs() + EPS)
    return float((rel > bound).double().mean())


def msprobe_gate(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                 same_input: Optional[torch.Tensor] = None) -> Verdict:
    """Judge ``actual`` (any float dtype, the shape of ``expected``) against ``expected``
    (fp32 eager) by the rules above; rule 4 uses ``dtype``'s bounds (`ERROR_RATIO`;
    another dtype: fp32's) against ``same_input`` (the op in fp32 on the inputs the
    low-precision op saw), or against ``expected`` when None. Raises ValueError when the
    shapes differ."""
    m = metrics(actual, expected)
    cos, mab = m["cosine"], m["max_abs"]
    if m["note"]:
        return Verdict(False, "nan_inf", m["note"], cos, mab)
    if cos <= COSINE_FAIL:
        return Verdict(False, "cosine", f"cosine {cos:.6f} <= {COSINE_FAIL}", cos, mab)
    if mab < MAX_ABS_PASS:
        return Verdict(True, "max_abs", f"max abs error {mab:.3g} < {MAX_ABS_PASS}", cos, mab)
    name = str(dtype).replace("torch.", "")
    bound, share = ERROR_RATIO.get(name, ERROR_RATIO["float32"])
    r = error_ratio(actual, expected if same_input is None else same_input, bound)
    against = "eager" if same_input is None else "fp32 on the same inputs"
    detail = (f"{r:.2%} of elements above {bound:g} relative error against {against} "
              f"({'<=' if r <= share else '>'} {share:.1%} allowed for {name}); cosine {cos:.6f}")
    return Verdict(r <= share, "error_ratio", detail, cos, mab)


__all__ = ["COSINE_FAIL", "ERROR_RATIO", "MAX_ABS_PASS", "Verdict", "error_ratio", "msprobe_gate"]
