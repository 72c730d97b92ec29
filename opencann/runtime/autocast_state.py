"""The host's ``torch.autocast`` state, recorded when a graph is captured and checked per call.

`opencann.compile` captures a model once (torch.export): under ``torch.autocast`` the
captured graph holds autocast's casts as explicit ops, outside it none. A call under
another autocast state than the capture's would then differ from eager (float32 outputs
where eager's are bfloat16, or the reverse), so `check` refuses it with one line naming
both states and the fix. Only the host's (``cpu``) state is compared: compiled models run
their kernels on the host, and ``autocast("cuda")`` does not change eager results on
host tensors. ``torch.compile(backend="opencann")`` follows autocast per call instead
(dynamo guards on it and recompiles).

The executor runs kernels with host autocast off (`kernels_without_autocast`): a graph's
dtypes are explicit, and a torch kernel run under autocast would recast its inputs
(``addmm`` to bfloat16) against the planned buffers.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

HOST = "cpu"


def current() -> Optional[str]:
    """The host autocast dtype now (``"bfloat16"``, ``"float16"``) or None when it is off."""
    if not torch.is_autocast_enabled(HOST):
        return None
    return str(torch.get_autocast_dtype(HOST)).replace("torch.", "")


def _shown(state: Optional[str]) -> str:
    return "outside torch.autocast" if state is None else f"inside autocast({HOST}, {state})"


def check(recorded: Optional[str]) -> None:
    """Raise ValueError (one line) if the host autocast state now differs from ``recorded``
    (`current` at capture; None: captured outside autocast)."""
    now = current()
    if now != recorded:
        raise ValueError(
            f"compiled {_shown(recorded)}; called {_shown(now)}: the compiled graph keeps the "
            "autocast state of its capture. Call it in the autocast context it was compiled "
            "in, or compile it in this one, or use torch.compile(model, backend='opencann'), "
            "which follows autocast per call")


def kernels_without_autocast():
    """A context for running a graph's kernels: host autocast off if it is on, else nothing."""
    if torch.is_autocast_enabled(HOST):
        return torch.autocast(HOST, enabled=False)
    return contextlib.nullcontext()
