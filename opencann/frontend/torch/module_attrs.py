"""The plain Python attributes of a module tree that torch.export bakes into its graph.

torch.export runs ``forward`` once and turns what the module's Python attributes held
then (``self.scale = 0.5``, a flag choosing a branch, ``self.training``) into constants
of the graph. Eager reads them anew at every call, so a compiled model whose module's
attribute changed afterwards would silently compute with the old value. `AttributeGuard`
snapshots, at compile time, every public attribute of every submodule whose value is a
plain value (bool, int, float, complex, str, None, or a tuple/list of those, such as
``normalized_shape``) and, per call, compares them with the snapshot: a change is one
``ValueError`` naming the attribute, both values and the fix. (torch.compile guards the
attributes its trace read instead, and recompiles; Dynamo's ``EQUALS_MATCH`` guards.)

Cost per call: one ``operator.itemgetter`` call and one tuple comparison per module
(BERT-base: 230 modules, about 30-60 µs measured; see the README). Attributes whose
names start with ``_`` (torch's hook dictionaries and caches) are not watched, nor are
objects (configs, tensors: tensors are the frozen-weight checks' business), nor the names
the compiled module's class lists in ``_opencann_unwatched`` (attributes its forward
reads in no submodule: opencann.llm's ``DecoderLM`` calls no dropout, so ``training``).
"""
from __future__ import annotations

import operator
import weakref
from typing import Any, Callable, List, Tuple

import torch

_PLAIN = (bool, int, float, complex, str, type(None))
_MAX_SEQ = 64  # longer lists/tuples are data, not configuration: not watched


def _plain(v: Any, depth: int = 0) -> bool:
    if isinstance(v, _PLAIN):
        return True
    if isinstance(v, (tuple, list)) and len(v) <= _MAX_SEQ and depth < 2:
        return all(_plain(x, depth + 1) for x in v)
    return False


def _snapshot(v: Any) -> Any:
    """``v`` frozen as compared later: lists copied (a list grown later differs)."""
    if isinstance(v, list):
        return [_snapshot(x) for x in v]
    if type(v) is tuple:
        return tuple(_snapshot(x) for x in v)
    return v


class AttributeChanged(ValueError):
    """A watched module attribute changed since compile: ``name`` (its dotted path in the
    compiled module), ``was`` and ``now`` (its values; ``now`` is "deleted" when it is)."""

    def __init__(self, message: str, name: str, was: Any, now: Any):
        super().__init__(message)
        self.name, self.was, self.now = name, was, now


class AttributeGuard:
    """Snapshot of ``model``'s plain public attributes (every submodule's); `check` raises
    ValueError when one differs now. Holds the modules by weak reference (a compiled
    model never keeps its module alive; a collected module is not checked)."""

    def __init__(self, model: torch.nn.Module):
        self._entries: List[Tuple[str, Any, Tuple[str, ...], Callable, Any]] = []
        skip = getattr(type(model), "_opencann_unwatched", frozenset())
        for path, mod in model.named_modules():
            keys = tuple(k for k, v in vars(mod).items()
                         if not k.startswith("_") and k not in skip and _plain(v))
            if not keys:
                continue
            getter = operator.itemgetter(*keys) if len(keys) > 1 else (lambda d, k=keys[0]: (d[k],))
            snap = getter(vars(mod)) if len(keys) > 1 else (vars(mod)[keys[0]],)
            self._entries.append((path, weakref.ref(mod), keys, getter, _snapshot(snap)))

    def __len__(self) -> int:
        return sum(len(e[2]) for e in self._entries)

    def check(self) -> None:
        """Raise `AttributeChanged` (a ValueError) naming the first watched attribute
        that changed (or was deleted) since the snapshot; return None when none did."""
        for path, ref, keys, getter, snap in self._entries:
            mod = ref()
            if mod is None:
                continue
            d = vars(mod)
            try:
                now = getter(d)
            except KeyError:
                now = None
            if now != snap:
                self._raise(path, d, keys, snap)

    @staticmethod
    def _raise(path: str, d: dict, keys: Tuple[str, ...], snap) -> None:
        missing = object()
        for k, was in zip(keys, snap):
            now = d.get(k, missing)
            if now is missing or now != was:
                name = f"{path}.{k}" if path else k
                shown = "deleted" if now is missing else repr(now)
                raise AttributeChanged(
                    f"module attribute {name!r} was {was!r} when the model was compiled and is "
                    f"{shown} now: opencann.compile baked it into the graph. Recompile after "
                    "changing it (or use torch.compile(model, backend='opencann'), which "
                    "recompiles on such changes)", name, was, shown)


__all__ = ["AttributeChanged", "AttributeGuard"]
