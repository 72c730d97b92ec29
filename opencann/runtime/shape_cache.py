"""Per-shape plans of a graph with dynamic dims: a bounded LRU cache of executor pools.

A model compiled with symbolic dims is optimised once; each concrete shape it is called
with needs its own memory plan and bound kernels (an `ExecutorPool`). `ShapePlanCache`
keys the calls by their dims' values (``key_of(inputs)``, which also checks ranges and
raises the caller's error), builds a pool on the first call with a new key
(``build(key)``) and keeps at most ``capacity`` pools, dropping the least recently used
one. It offers `ExecutorPool`'s calls (`run`, `profile`, ``size``), so the compiled
model calls it as it calls a pool.

Thread safety: the map is guarded by a lock held only to look up, insert and evict; a
build runs under a second lock (one plan is built at a time, so two calls with the
same new shape build it once) while calls at cached shapes go on. A pool evicted while
a call runs on it finishes that call (the call holds the pool).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence

import torch

from .pool import ExecutorPool

DEFAULT_PLAN_CACHE_SIZE = 8
"""Default bound on the per-shape plans a dynamic model keeps (each holds its arenas)."""


class ShapePlanCache:
    """At most ``capacity`` per-shape `ExecutorPool` s of one graph, least recently used
    dropped first. ``key_of(inputs)`` gives a call's key (raising ValueError for inputs
    out of range); ``build(key)`` makes the pool for a new key; ``size`` is each pool's
    bound on concurrent calls. ``capacity`` must be a positive int (ValueError).
    ``on_evict(key)`` (optional) is called after a key is dropped, outside the map's
    lock. Counters: ``hits``, ``misses`` (plans built), ``evictions``."""

    def __init__(self, key_of: Callable[[Sequence[torch.Tensor]], Hashable],
                 build: Callable[[Hashable], ExecutorPool], capacity: int = DEFAULT_PLAN_CACHE_SIZE,
                 size: int = 1, on_evict: Optional[Callable[[Hashable], None]] = None):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"plan_cache_size must be a positive int, got {capacity!r}")
        self.capacity, self.size = capacity, size
        self._key_of, self._build, self._on_evict = key_of, build, on_evict
        self._pools: "OrderedDict[Hashable, ExecutorPool]" = OrderedDict()
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    def keys(self) -> List[Hashable]:
        """The cached keys, least recently used first."""
        with self._lock:
            return list(self._pools)

    def put(self, key: Hashable, pool: ExecutorPool) -> None:
        """Cache ``pool`` under ``key`` (most recently used), evicting beyond ``capacity``."""
        dropped = []
        with self._lock:
            self._pools[key] = pool
            self._pools.move_to_end(key)
            while len(self._pools) > self.capacity:
                dropped.append(self._pools.popitem(last=False)[0])
                self.evictions += 1
        for k in dropped if self._on_evict is not None else ():
            self._on_evict(k)

    def _cached(self, key: Hashable) -> Optional[ExecutorPool]:
        with self._lock:
            pool = self._pools.get(key)
            if pool is not None:
                self._pools.move_to_end(key)
                self.hits += 1
            return pool

    def pool_for(self, inputs: Sequence[torch.Tensor]) -> ExecutorPool:
        """The pool for these inputs' shapes, built (and cached) on first use. Raises
        what ``key_of`` and ``build`` raise."""
        return self.pool_for_key(self._key_of(inputs))

    def pool_for_key(self, key: Hashable) -> ExecutorPool:
        """The pool for ``key``, built (and cached) on first use. Raises what ``build``
        raises."""
        pool = self._cached(key)
        if pool is not None:
            return pool
        # its arenas outlive the call: ordinary tensors under torch.inference_mode() too
        with self._build_lock, torch.inference_mode(False):
            pool = self._cached(key)   # built by another thread meanwhile
            if pool is None:
                pool = self._build(key)
                with self._lock:
                    self.misses += 1
                self.put(key, pool)
        return pool

    @property
    def first(self):
        """The most recently used pool's first executor (None when nothing is cached)."""
        with self._lock:
            pool = next(reversed(self._pools.values()), None)
        return pool.first if pool is not None else None

    @property
    def count(self) -> int:
        """Executors (arenas) held over all cached shapes."""
        with self._lock:
            return sum(p.count for p in self._pools.values())

    def run(self, inputs: Sequence[torch.Tensor]) -> tuple:
        """Run on the pool of these inputs' shapes (see `ExecutorPool.run`)."""
        return self.pool_for(inputs).run(inputs)

    def run_observed(self, inputs: Sequence[torch.Tensor], observe: Callable[[Any, tuple], None]) -> tuple:
        """`ExecutorPool.run_observed` on the pool of these inputs' shapes."""
        return self.pool_for(inputs).run_observed(inputs, observe)

    def profile(self, inputs: Sequence[torch.Tensor], path: Optional[str] = None
                ) -> List[Dict[str, Any]]:
        """`ExecutorPool.profile` on the pool of these inputs' shapes."""
        return self.pool_for(inputs).profile(inputs, path)

    def stats(self) -> Dict[str, Any]:
        """``capacity``, ``cached`` (keys, least recent first), ``hits``, ``misses``,
        ``evictions``."""
        return {"capacity": self.capacity, "cached": self.keys(), "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions}
