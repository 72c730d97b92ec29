"""Sees the writes to frozen weights that torch does not record in a version counter.

Compiled models hold a snapshot of a module's parameters and buffers (`opencann.compile`;
`opencann.dynamo.freezing` for ``torch.compile(backend="opencann")``) and guard it per call
with each tensor's ``_version`` (and ``data_ptr``). Some writes leave the version counter
alone (torch 2.x):

- fused optimizer kernels (``Adam/AdamW/SGD(..., fused=True)``: ``_fused_adam_``,
  ``_fused_sgd_``, whose schemas write through ``Tensor(a!)[]`` without a version bump on
  CPU); ``foreach`` and single-tensor steps do bump it;
- BatchNorm's running statistics in a train-mode forward (``native_batch_norm``'s schema
  does not mark ``running_mean``/``running_var`` as written), in eager or under no_grad;
- writes through ``.data`` (``p.data.copy_(t)``: ``.data`` has its own version counter) or
  through a NumPy view (``p.detach().numpy()[:] = ...``).

`WeightWatch` covers them with two means:

1. a global optimizer step post-hook (``torch.optim.optimizer.
   register_optimizer_step_post_hook``): after any ``Optimizer.step`` the watches holding
   one of the optimizer's parameters that had a gradient are marked changed — exact for
   every optimizer, fused or not, at no per-call cost;
2. value probes compared per call with a snapshot, bitwise (NaN and -0.0 compare as
   themselves): a tensor of at most `SMALL_BYTES` is compared whole (BatchNorm's statistics,
   biases, norms' weights: exact), a larger one by its first and last `SAMPLE` elements in
   memory (a write through ``.data`` of a whole large tensor — copy_, mul_, normal_ — is
   seen; one that leaves all those elements alone is not: write under ``torch.no_grad()``
   without ``.data``, which torch records). Probes of one dtype are gathered by one
   ``torch.cat`` and compared with one ``memcmp`` (``bytes ==``).

Cost per call on ResNet-50's state (265 tensors, 25.6 M elements; probes 113 K elements):
about 0.1 ms on this 2-core machine (see tests/test_weight_watch.py's docstring for the
command). The probes are views of the module's storages (not copies): a storage replaced
with ``p.data = t`` stays alive until the watch is released (`release`, or the tensor's
death).
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Sequence

import torch

SMALL_BYTES = 16 * 1024
"""Tensors up to this many bytes are compared whole per call."""
SAMPLE = 32
"""Elements compared at each end of a larger tensor (in memory order)."""

_WATCHES: "weakref.WeakSet[WeightWatch]" = weakref.WeakSet()
_HOOK = None


def _after_step(optimizer, args, kwargs) -> None:
    """Global optimizer step post-hook: mark the watches of the stepped parameters."""
    if not _WATCHES:
        return
    stepped = {id(p) for g in optimizer.param_groups for p in g["params"]
               if getattr(p, "grad", None) is not None}
    for w in list(_WATCHES):
        hit = stepped & w.ids
        if hit:
            w.stepped |= hit
            w.how = f"was written by an optimizer step ({type(optimizer).__name__})"


def _install_hook() -> None:
    global _HOOK
    if _HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook
        _HOOK = register_optimizer_step_post_hook(_after_step)


def _probes(t: torch.Tensor) -> List[torch.Tensor]:
    """1-D views of ``t``'s storage to compare (no autograd history, no reference to ``t``)."""
    n = t.numel()
    if n == 0 or type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu" \
            or t.layout != torch.strided or t.is_inference():
        return []
    st, off = t.untyped_storage(), t.storage_offset()

    def view(start: int, size: int, step: int) -> torch.Tensor:
        return torch.empty(0, dtype=t.dtype).set_(st, start, (size,), (step,))
    if t.is_contiguous() or t.is_non_overlapping_and_dense():
        if n * t.element_size() <= SMALL_BYTES or n <= 2 * SAMPLE:
            return [view(off, n, 1)]
        return [view(off, SAMPLE, 1), view(off + n - SAMPLE, SAMPLE, 1)]
    # gapped or overlapping: along its innermost dimension from its first element
    d = min(range(t.dim()), key=lambda i: (t.stride(i) if t.size(i) > 1 else 1 << 62))
    return [view(off, min(t.size(d), 2 * SAMPLE), t.stride(d))]


class WeightWatch:
    """Per-call detection of unrecorded writes to ``tensors`` (named ``names``) since now.

    ``changed()`` (per call, cheap): whether an optimizer step wrote one of them or a probe
    differs from its snapshot. ``changes()`` (after ``changed()``): index -> how it changed.
    Thread-safe (no shared buffers)."""

    def __init__(self, tensors: Sequence[torch.Tensor], names: Sequence[str]):
        self.names = list(names)
        self.ids = frozenset(map(id, tensors))
        self._index = {id(t): i for i, t in enumerate(tensors)}
        self.stepped: set = set()
        self.how = ""
        groups: Dict[torch.dtype, list] = {}
        for i, t in enumerate(tensors):
            for p in _probes(t):
                groups.setdefault(p.dtype, []).append((i, p))
        self._groups = []
        for dtype, items in groups.items():
            probes = [p for _, p in items]
            snap = torch.cat(probes)
            self._groups.append((probes, [i for i, _ in items], snap,
                                 snap.view(torch.uint8).numpy().tobytes()))
        def died(_ref, me=weakref.ref(self)):
            w = me()
            if w is not None:
                w.release()
        self._refs = [weakref.ref(t, died) for t in tensors]
        _install_hook()
        _WATCHES.add(self)

    def release(self) -> None:
        """Stop watching (frees the probes' hold on the storages)."""
        self._groups = []
        self.stepped = set()
        _WATCHES.discard(self)

    def changed(self) -> bool:
        """Whether a watched tensor was written since the snapshot (per call)."""
        if self.stepped:
            return True
        for probes, _, _, want in self._groups:
            if torch.cat(probes).view(torch.uint8).numpy().tobytes() != want:
                return True
        return False

    def changes(self) -> Dict[int, str]:
        """Tensor index -> how it changed without a version bump (slow; for messages)."""
        out = {self._index[i]: self.how for i in self.stepped if i in self._index}
        for probes, owners, snap, _ in self._groups:
            at = 0
            for i, p in zip(owners, probes):
                n = p.numel()
                old = snap[at:at + n]
                at += n
                if i not in out and not torch.equal(p.view(-1).view(torch.uint8) if p.is_contiguous()
                                                    else p.contiguous().view(torch.uint8),
                                                    old.view(torch.uint8)):
                    out[i] = ("was changed without a version bump (BatchNorm running "
                              "statistics in a train-mode forward, or a write through .data)")
        return out
