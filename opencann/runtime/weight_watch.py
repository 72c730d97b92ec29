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
- writes through ``.data`` (``p.data.copy_(t)``: ``.data`` has its own version counter),
  through a NumPy view (``p.detach().numpy()[:] = ...``), or by c10d collectives
  (``dist.broadcast``/``all_reduce``, as DDP's parameter and buffer broadcasts);
- a parameter, buffer or submodule replaced (``m.w = nn.Parameter(t)``,
  ``load_state_dict(assign=True)``) while the old tensor is still referenced elsewhere.

`WeightWatch` covers them with three means:

1. a global optimizer step post-hook (``torch.optim.optimizer.
   register_optimizer_step_post_hook``): after any ``Optimizer.step`` the watches holding
   one of the optimizer's parameters that had a gradient are marked changed — exact for
   every optimizer, fused or not, at no per-call cost;
2. value probes compared per call with a snapshot, bitwise (NaN and -0.0 compare as
   themselves): a tensor of at most `SMALL_BYTES` is compared whole (BatchNorm's statistics,
   biases, norms' weights: exact), a larger one by its first and last `SAMPLE` elements in
   memory (a write through ``.data`` of a whole large tensor — copy_, mul_, normal_ — is
   seen; one that leaves all those elements alone is not: write under ``torch.no_grad()``
   without ``.data``, which torch records). The probes' bytes are gathered by one
   ``bytes.join`` over memoryviews (a memcpy each, no torch dispatch) and compared with one
   ``memcmp`` (``bytes ==``);
3. given the owning module, global parameter/buffer/submodule registration hooks mark a
   watched name re-assigned, and the module's attributes confirm it at the next call (a
   swap that is undone, as ``torch.func.functional_call`` or torch.export do, is no change).

Cost per call on ResNet-50's state (318 tensors, 23.6 M elements; probes 444 KiB): about
65 µs on this 2-core machine under load (bench/weight_watch.py). The probes are views of
the module's storages (not copies): a storage replaced with ``p.data = t`` stays alive
until the watch is released (`release`, or the tensor's death).
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Sequence

import torch

SMALL_BYTES = 16 * 1024
"""Tensors up to this many bytes are compared whole per call."""
SAMPLE = 32
"""Elements compared at each end of a larger tensor (in memory order)."""

_WATCHES: "weakref.WeakSet[WeightWatch]" = weakref.WeakSet()
_HOOK = None
_REGISTRATION_HOOKS: list = []
REPLACED = ("was replaced (a new Parameter, buffer or submodule assigned, or "
            "load_state_dict(assign=True))")


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
            w.how = f"was modified in place by an optimizer step ({type(optimizer).__name__})"


def _install_hook() -> None:
    global _HOOK
    if _HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook
        _HOOK = register_optimizer_step_post_hook(_after_step)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel`` consecutive storage elements (a permutation
    of a contiguous tensor: transposed, channels-last)."""
    expect = 1
    for st, n in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if st != expect:
            return False
        expect *= n
    return True


def _registered(module, name, value) -> None:
    """Global parameter/buffer/submodule registration hook (``m.w = nn.Parameter(t)``,
    ``load_state_dict(assign=True)``, ``m.lin = nn.Linear(...)``): mark the watches that
    hold a tensor under that attribute of that module. Under dynamo tracing it does nothing:
    a registration traced there (``self.layers[:n]`` builds a new ModuleList) is not a
    write to a compiled model's module, and dynamo cannot trace the WeakSet iteration."""
    if torch.compiler.is_compiling():
        return
    for w in list(_WATCHES):
        hit = w.slots.get((id(module), name))
        if hit is not None and hit[0]() is module and not w.replaced:
            w.replaced = hit[1]


def _install_registration_hooks() -> None:
    if not _REGISTRATION_HOOKS:
        from torch.nn.modules import module as nn_module
        _REGISTRATION_HOOKS.extend(
            reg(_registered) for reg in (nn_module.register_module_parameter_registration_hook,
                                         nn_module.register_module_buffer_registration_hook,
                                         nn_module.register_module_module_registration_hook))


def _slots(module: torch.nn.Module, names: Sequence[str]) -> Dict[tuple, tuple]:
    """(id(owner module), attribute) -> (weakref to the owner, tensor name) for every step
    of every dotted ``names`` path under ``module``."""
    out: Dict[tuple, tuple] = {}
    for name in names:
        parts, owner = name.split("."), module
        for i, part in enumerate(parts):
            out.setdefault((id(owner), part), (weakref.ref(owner), name))
            if i + 1 < len(parts):
                owner = owner._modules.get(part) if isinstance(owner, torch.nn.Module) else None
                if owner is None:
                    break
    return out


def _probes(t: torch.Tensor) -> List[torch.Tensor]:
    """1-D views of ``t``'s storage to compare (no autograd history, no reference to ``t``)."""
    n = t.numel()
    if n == 0 or type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu" \
            or t.layout != torch.strided or t.is_inference():
        return []
    st, off = t.untyped_storage(), t.storage_offset()

    def view(start: int, size: int, step: int) -> torch.Tensor:
        return torch.empty(0, dtype=t.dtype).set_(st, start, (size,), (step,))
    if t.is_contiguous() or _dense(t):
        if n * t.element_size() <= SMALL_BYTES or n <= 2 * SAMPLE:
            return [view(off, n, 1)]
        return [view(off, SAMPLE, 1), view(off + n - SAMPLE, SAMPLE, 1)]
    # gapped or overlapping: along its innermost dimension from its first element
    d = min(range(t.dim()), key=lambda i: (t.stride(i) if t.size(i) > 1 else 1 << 62))
    return [view(off, min(t.size(d), 2 * SAMPLE), t.stride(d))]


def _bytes_of(p: torch.Tensor) -> bytes:
    return p.contiguous().view(torch.uint8).numpy().tobytes()


class WeightWatch:
    """Per-call detection of unrecorded writes to ``tensors`` (named ``names``) since now.

    ``changed()`` (per call, cheap): whether an optimizer step wrote one of them or a probe's
    bytes differ from its snapshot. ``changes()`` (after ``changed()``): index -> how it
    changed. Thread-safe (no shared buffers)."""

    def __init__(self, tensors: Sequence[torch.Tensor], names: Sequence[str],
                 module: Optional[torch.nn.Module] = None):
        self.names = list(names)
        # with ``module`` (the owner of the dotted ``names``): replacing one of them is seen
        self.slots = _slots(module, names) if module is not None else {}
        self._module = weakref.ref(module) if module is not None else None
        self.replaced = ""   # set by the registration hook; confirmed by `_replaced`
        self.ids = frozenset(map(id, tensors))
        self._index = {id(t): i for i, t in enumerate(tensors)}
        self.stepped: set = set()
        self.how = ""
        owners, views, strided = [], [], []
        for i, t in enumerate(tensors):
            for p in _probes(t):
                owners.append(i)
                if p.stride(0) == 1 or p.numel() == 1:
                    views.append(memoryview(p.view(torch.uint8).numpy()))
                else:
                    views.append(None)
                    strided.append(p)
        # contiguous probes: one bytes.join (a memcpy each) and one memcmp per call
        self._views = [v for v in views if v is not None]
        self._strided = strided
        self._owners, self._all = owners, views
        self._want = self._gather()
        self._snap = [bytes(v) if v is not None else None for v in views]
        k = 0
        for j, v in enumerate(views):
            if v is None:
                self._snap[j] = _bytes_of(strided[k])
                k += 1

        def died(_ref, me=weakref.ref(self)):
            w = me()
            if w is not None:
                w._died(_ref)
        self._refs = [weakref.ref(t, died) for t in tensors]
        _install_hook()
        if self.slots:
            _install_registration_hooks()
        _WATCHES.add(self)

    def _gather(self) -> bytes:
        return b"".join(self._views) + b"".join(map(_bytes_of, self._strided))

    def release(self) -> None:
        """Stop watching (frees the probes' hold on the storages)."""
        self._views, self._strided, self._all, self._owners = [], [], [], []
        self._want = b""
        self.stepped, self.slots, self.replaced = set(), {}, ""
        if _WATCHES is not None:   # None once the interpreter tears this module down
            _WATCHES.discard(self)

    def _died(self, ref) -> None:
        """A watched tensor was freed. While its owning module lives, that is a replacement
        whose old tensor had no other reference (``m.w = nn.Parameter(t)`` frees the old
        one inside the assignment, after the registration hook ran): it is kept as
        replaced, for the next call to report. Without a module, or with the module gone
        too (the user dropped the model), the watch is released."""
        module = self._module() if self._module is not None else None
        if module is None:
            self.release()
            return
        i = next((k for k, r in enumerate(self._refs) if r is ref), None)
        if i is not None and not self.replaced:
            self.replaced = self.names[i]

    def changed(self) -> bool:
        """Whether a watched tensor was written since the snapshot (per call)."""
        return (bool(self.stepped) or bool(self.replaced and self._replaced())
                or self._gather() != self._want)

    def _replaced(self) -> bool:
        """After a registration under a watched name: whether a watched tensor is no longer
        the module's (a swap that was undone, as ``torch.func.functional_call`` and
        torch.export do, is not a change)."""
        module = self._module() if self._module is not None else None
        for i, (name, ref) in enumerate(zip(self.names, self._refs)):
            owner, *path, leaf = [module] + name.split(".")
            for part in path:
                owner = owner._modules.get(part) if owner is not None else None
            now = None if owner is None else owner._parameters.get(leaf, owner._buffers.get(leaf))
            if module is not None and now is not ref():
                self.replaced = name
                return True
        self.replaced = ""
        return False

    def changes(self) -> Dict[int, str]:
        """Tensor index -> how it changed without a version bump (slow; for messages)."""
        out = {self._index[i]: self.how for i in self.stepped if i in self._index}
        if self.replaced in self.names:
            out.setdefault(self.names.index(self.replaced), REPLACED)
        k = 0
        for i, v, old in zip(self._owners, self._all, self._snap):
            if v is None:
                now = _bytes_of(self._strided[k])
                k += 1
            else:
                now = bytes(v)
            if i not in out and now != old:
                out[i] = ("was modified in place without a version bump (BatchNorm running "
                          "statistics in a train-mode forward, or a write through .data)")
        return out
