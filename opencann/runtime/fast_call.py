"""The cheapest Python entry to an ATen overload: torch's public function or Tensor
method of the same name, when it provably dispatches to that very overload.

Calling an ``OpOverload`` from Python (``torch.ops.aten.add.out(x, 0.5, out=b)``) goes
through its generic boxed binding; ``torch.add(x, 0.5, out=b)`` goes through the C++
argument parser generated for it, and reaches the same kernel. Measured on 8-float
tensors (1 thread, this project's 2-core machine): add.out 13.8 µs ⇒ 7.8 µs,
tanh.out 5.3 µs ⇒ 2.5 µs per call. For a graph of tiny ops that is most of the
executor's cost per op (bench/overhead.py, docs/performance.md).

Proof, per node at bind time: the candidate is called once on meta tensors with the
node's exact arguments under a dispatch mode that records the ATen calls; it is used
only when the record is exactly ``[overload]``. A composite function that decomposes,
a parser that picks another overload, or another argument name gives another record
or an error, and the overload itself is kept. `fast_callable_keyed` proves once per
call description, with int arguments by type alone where `value_free` shows the answer
cannot depend on their values, so a graph specialised to a new shape reuses the proofs.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_CANDIDATE_HOMES = (torch._C._VariableFunctions, torch._C.TensorBase)
_CACHE: Dict[tuple, bool] = {}
_KEYED: Dict[tuple, Callable] = {}
_VALUE_FREE: Dict[Any, bool] = {}
#: False binds every overload as is (bench/overhead.py measures both)
ENABLED = True


class _Record(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: List[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)) and any(isinstance(y, torch.Tensor) for y in x):
        return type(x)(_meta(y) for y in x)
    return x


def fast_callable(overload: torch._ops.OpOverload, args: Sequence[Any],
                  kwargs: Dict[str, Any]) -> Callable:
    """``overload`` or an equivalent public torch callable for calls shaped like
    ``overload(*args, **kwargs)`` (tensors may be real or meta; only their dtypes,
    shapes, strides and the literal arguments matter). Never raises."""
    if not ENABLED:
        return overload
    name = overload.overloadpacket.__name__
    margs, mkwargs = [_meta(a) for a in args], {k: _meta(v) for k, v in kwargs.items()}
    if not any(isinstance(a, torch.Tensor) for a in margs):
        return overload      # creation ops: their device argument would not be meta
    for home in _CANDIDATE_HOMES:
        fn = getattr(home, name, None)
        if fn is None:
            continue
        key = (str(overload), id(home), _signature(margs, mkwargs))
        ok = _CACHE.get(key)
        if ok is None:
            rec = _Record()
            try:
                with rec:
                    fn(*margs, **mkwargs)
                ok = rec.seen == [overload]
            except Exception:  # noqa: BLE001 - not this candidate
                ok = False
            _CACHE[key] = ok
        if ok:
            return fn
    return overload


def value_free(overload: torch._ops.OpOverload) -> bool:
    """True when no overload of ``overload``'s packet is CompositeImplicitAutograd. Then
    which overload a public binding reaches cannot depend on the values of its int
    arguments: torch's argument parser picks an overload by the arguments' types (an int
    is an int whatever its value) and that overload reaches the dispatcher (and the
    recording mode) undecomposed; only a composite decomposes by value (``reshape``: a
    view or a copy). A proof made at one set of sizes then holds at every other."""
    free = _VALUE_FREE.get(overload)
    if free is None:
        try:
            packet = overload.overloadpacket
            free = not any(_composite(getattr(packet, o)) for o in packet.overloads())
        except Exception:  # noqa: BLE001 - cannot tell: keep the values in the key
            free = False
        _VALUE_FREE[overload] = free
    return free


def _composite(overload: torch._ops.OpOverload) -> bool:
    """Whether ``overload`` decomposes (CompositeImplicitAutograd); False for a name the
    dispatcher does not have (TorchScript's list ops such as ``slice.t``: no binding
    reaches them)."""
    try:
        return overload.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)
    except RuntimeError:
        return False


def fast_callable_keyed(overload: torch._ops.OpOverload, key: Hashable,
                        make_args: Callable[[], Tuple[Sequence[Any], Dict[str, Any]]]
                        ) -> Callable:
    """`fast_callable` for a call described by ``key`` (hashable: the overload, the
    tensors' dtypes, ranks and contiguity, the other arguments; ints by type alone where
    `value_free` says the proof does not depend on them); ``make_args()`` gives the
    call's (args, kwargs) when ``key`` was not proven before. A graph specialised to a
    new shape then binds its kernels without a dispatch per node. Never raises."""
    key = (ENABLED, key)
    fn = _KEYED.get(key)
    if fn is None:
        args, kwargs = make_args()
        fn = _KEYED[key] = fast_callable(overload, args, kwargs)
    return fn


def _signature(args, kwargs) -> tuple:
    def one(a):
        if isinstance(a, torch.Tensor):
            return ("T", a.dtype, a.dim(), tuple(a.stride()) == tuple(
                torch.empty(a.shape, device="meta").stride()))
        if isinstance(a, (list, tuple)):
            return tuple(one(y) for y in a)
        return (type(a).__name__, repr(a))
    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))
