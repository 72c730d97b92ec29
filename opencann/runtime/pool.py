"""A bounded pool of executors: one compiled graph called from several threads at once.

An `Executor` keeps its intermediates in one arena, so two overlapping calls on one
executor would overwrite each other's values. The pool gives each call an executor of
its own: a call borrows an idle one, or, when none is idle and fewer than ``size``
exist, a new one (the first is built in full, the others are `Executor.clone`s sharing
its kernels, constants and code, with their own arena); with ``size`` executors busy the
call waits for one to come back. Results never alias an arena (graph outputs are fresh
tensors per call, see ``opencann.passes.memory``), so they stay valid after the executor
is returned. A single-threaded caller only ever uses one executor (one arena).

The idle executors sit in a ``queue.SimpleQueue`` (the standard library's C-level
thread-safe queue): borrowing and returning cost well under a microsecond each.
"""
from __future__ import annotations

import contextlib
import os
import queue
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from .autocast_state import kernels_without_autocast
from .executor import Executor

DEFAULT_CONCURRENT_CALLS = min(8, os.cpu_count() or 1)
"""Default bound on executors (arenas) per compiled graph: this machine's CPU count,
at most 8 (more overlapping calls than cores gain nothing, and each costs an arena)."""


class ExecutorPool:
    """At most ``size`` executors of one graph, built on demand.

    ``make()`` builds the first executor (kernels bound, GEMMs measured); ``first`` is
    one already built. ``size`` must be a positive int (ValueError otherwise).
    `run` and `profile` may be called from any number of threads; calls beyond ``size``
    wait for an executor to become idle."""

    def __init__(self, make: Callable[[], Executor], size: int = DEFAULT_CONCURRENT_CALLS,
                 first: Optional[Executor] = None):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"the executor pool size must be a positive int, got {size!r}")
        self.size = size
        self._make = make
        self._lock = threading.Lock()
        self._idle: "queue.SimpleQueue[Executor]" = queue.SimpleQueue()
        self._first = first
        self._count = 0
        if first is not None:
            self._count = 1
            self._idle.put(first)

    @property
    def first(self) -> Optional[Executor]:
        """The first executor built (None before the first call when built lazily)."""
        return self._first

    @property
    def count(self) -> int:
        """How many executors (arenas) exist now, busy or idle (at most ``size``)."""
        return self._count

    def _borrow(self) -> Executor:
        try:
            return self._idle.get(block=False)
        except queue.Empty:
            pass
        with self._lock:
            grow = self._count < self.size
            if grow:
                self._count += 1
                if self._first is None:  # built once, under the lock: others clone it
                    try:   # arenas outlive the call: ordinary tensors in any mode
                        with torch.inference_mode(False):
                            self._first = self._make()
                    except BaseException:
                        self._count -= 1
                        raise
                    return self._first
        if not grow:
            return self._idle.get()  # all `size` executors busy: wait for one
        try:
            with torch.inference_mode(False):
                return self._first.clone()
        except BaseException:
            with self._lock:
                self._count -= 1
            raise

    @contextlib.contextmanager
    def _borrowed(self) -> Iterator[Executor]:
        """An executor borrowed for one call, given back after it; its kernels run
        without the host's autocast (the graph's dtypes are explicit)."""
        ex = self._borrow()
        try:
            with kernels_without_autocast():
                yield ex
        finally:
            self._idle.put(ex)

    def share_arena(self, arena: torch.Tensor) -> bool:
        """Make the pool's one executor run in ``arena`` (`Executor.clone` with that
        buffer), for graphs whose calls never overlap (opencann.llm's step graphs, called
        under their generator's lock) to share one buffer. Only while the pool holds
        that executor alone and idle; returns whether it did (a second executor, made
        for an overlapping call, keeps an arena of its own). Raises what `clone` raises."""
        with self._lock:
            if self._count != 1 or self._first is None:
                return False
            try:
                ex = self._idle.get(block=False)
            except queue.Empty:
                return False
            try:
                with torch.inference_mode(False):
                    self._first = ex.clone(arena)
            finally:
                self._idle.put(self._first)
            return True

    def run(self, inputs: Sequence[torch.Tensor]) -> tuple:
        """`Executor.run` on a borrowed executor; returns the flat outputs (fresh
        tensors, never views of an arena). Raises what `Executor.run` raises."""
        ex = self._borrow()   # not `_borrowed`: this is every call's path, no generator frame
        try:
            with kernels_without_autocast():   # the graph's dtypes are explicit
                return ex.run(inputs)
        finally:
            self._idle.put(ex)

    def run_observed(self, inputs: Sequence[torch.Tensor],
                     observe: Callable[[Any, tuple], None]) -> tuple:
        """`Executor.run_observed` on a borrowed executor (an arena of its own)."""
        with self._borrowed() as ex:
            return ex.run_observed(inputs, observe)

    def profile(self, inputs: Sequence[torch.Tensor], path: Optional[str] = None
                ) -> List[Dict[str, Any]]:
        """`Executor.profile` on a borrowed executor (it uses that executor's arena)."""
        with self._borrowed() as ex:
            return ex.profile(inputs, path)
