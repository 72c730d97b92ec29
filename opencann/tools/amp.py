"""Dynamic loss scaling for mixed-precision training (fp16 gradients underflow without it).

The scaler is torch's own ``torch.amp.GradScaler`` (works on CPU in torch 2.x; a
well-kept implementation beats our own), configured with the standard dynamic policy:
initial scale 2^16, ×2 after 2000 consecutive finite steps, ×0.5 and the optimizer step
skipped when any gradient is inf/NaN. Source: Micikevicius et al. 2018, "Mixed
Precision Training" (ICLR), and the CANN / torch_npu loss-scaling documentation.

`scaled_step` is one training step with the right order of operations: scale the loss,
backward, *unscale before clipping* (clipping thresholds are in true-gradient units),
then step (skipped on overflow) and update the scale.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional

import torch

INIT_SCALE = 2.0 ** 16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


def make_scaler(device: str = "cpu", init_scale: float = INIT_SCALE,
                growth_factor: float = GROWTH_FACTOR, backoff_factor: float = BACKOFF_FACTOR,
                growth_interval: int = GROWTH_INTERVAL, enabled: bool = True) -> torch.amp.GradScaler:
    """A ``torch.amp.GradScaler`` with the dynamic policy above. ``device``: "cpu" or
    "cuda" (an NPU's "npu" is mapped to the host device here). Raises ValueError for a
    non-positive scale, a growth factor <= 1, a backoff outside (0, 1) or an interval < 1."""
    if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
        raise ValueError("loss scaler needs init_scale > 0, growth_factor > 1, 0 < backoff_factor "
                         f"< 1 and growth_interval >= 1; got {init_scale}, {growth_factor}, "
                         f"{backoff_factor}, {growth_interval}")
    dev = "cpu" if device in ("npu", "vnpu") else device.split(":")[0]
    return torch.amp.GradScaler(dev, init_scale=init_scale, growth_factor=growth_factor,
                                backoff_factor=backoff_factor, growth_interval=growth_interval,
                                enabled=enabled)


def grads_finite(params: Iterable[torch.nn.Parameter]) -> bool:
    """True when every existing gradient is finite (no inf/NaN)."""
    return all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)


def scaled_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                max_norm: Optional[float] = None) -> Dict[str, float]:
    """Backward of ``loss`` (a scalar) scaled by ``scaler``, optional gradient clipping
    to ``max_norm`` (L2, applied to the unscaled gradients), then the optimizer step
    (skipped on overflow) and the scale update. Zeroes nothing: call
    ``optimizer.zero_grad()`` before the forward. Returns ``{"skipped": 0/1,
    "scale": scale used, "new_scale": scale after update, "grad_norm": L2 norm (or nan)}``.
    Raises ValueError for a non-scalar loss."""
    if loss.dim() != 0:
        raise ValueError(f"scaled_step needs a scalar loss, got shape {list(loss.shape)}; "
                         "reduce it (e.g. .mean()) first")
    scale = scaler.get_scale()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)  # true-unit gradients before clipping
    params = [p for g in optimizer.param_groups for p in g["params"]]
    finite = grads_finite(params)
    norm = float("nan")
    if max_norm is not None and finite:
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    scaler.step(optimizer)  # skipped by the scaler itself when an inf/NaN was found
    scaler.update()
    return {"skipped": float(not finite), "scale": scale, "new_scale": scaler.get_scale(),
            "grad_norm": norm}
