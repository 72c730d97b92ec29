"""``njit`` whose ``cache=True`` writes to the user cache directory, not the package.

numba's default locators cache a function's machine code next to its source file (the
package's ``__pycache__``) when that is writable: an installed opencann then writes into
site-packages, and on a read-only install only a fallback saves the cache. Here each
opencann kernel compiled with ``cache=True`` gets its own locator list (per function,
so the user's other numba code is untouched; ``NUMBA_CACHE_DIR`` is global and is not
set): ``$NUMBA_CACHE_DIR`` when the user set it (numba's `UserProvidedCacheLocator`),
else `cache_dir` (``$OPENCANN_CACHE_DIR/numba``, else ``$XDG_CACHE_HOME/opencann/numba``,
else ``~/.cache/opencann/numba``), else numba's own user-wide directory. Source: numba
``numba/core/caching.py`` (``_CacheImpl._locator_classes``, ``Dispatcher.enable_caching``).

Also the launch policy every opencann ``parallel=True`` kernel follows (`launch`): how many
threads one launch gets (`launch_threads`: torch's intra-op count, or the calling thread
alone below ATen's grain or when other processes leave too few CPUs, `oversubscribed`)
and the lock numba's non-thread-safe ``workqueue`` layer needs (`launch_guard`).
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from typing import Optional

from numba import njit as _numba_njit
from numba.core.caching import (CompileResultCacheImpl, FunctionCache, UserProvidedCacheLocator,
                                UserWideCacheLocator)


def cache_dir() -> str:
    """The directory opencann's numba kernels are cached in (module docstring; created on
    first save): ``$OPENCANN_CACHE_DIR/numba``, else ``$XDG_CACHE_HOME/opencann/numba``,
    else ``~/.cache/opencann/numba``."""
    root = os.environ.get("OPENCANN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "opencann")
    return os.path.join(root, "numba")


class OpencannCacheLocator(UserProvidedCacheLocator):
    """numba's user-provided locator pointed at `cache_dir` instead of ``NUMBA_CACHE_DIR``
    (one subdirectory per source directory, as numba names them)."""

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = os.path.join(cache_dir(), self.get_suitable_cache_subpath(py_file))

    @classmethod
    def from_function(cls, py_func, py_file):
        """The locator, or None when the source file is gone or the directory is not
        writable (numba then tries the next locator)."""
        return super(UserProvidedCacheLocator, cls).from_function(py_func, py_file)


class _CacheImpl(CompileResultCacheImpl):
    _locator_classes = [UserProvidedCacheLocator, OpencannCacheLocator, UserWideCacheLocator]


class _FunctionCache(FunctionCache):
    _impl_class = _CacheImpl


def njit(*args, **options):
    """``numba.njit`` with the same arguments; ``cache=True`` caches in the user cache
    directory (module docstring). Usable bare (``@njit``) or called (``@njit(...)``)."""
    cache = options.pop("cache", False)

    def deco(fn):
        disp = _numba_njit(**options)(fn)
        if cache:
            disp._cache = _FunctionCache(disp.py_func)   # what Dispatcher.enable_caching sets
        return disp
    if len(args) == 1 and callable(args[0]) and not options:
        return deco(args[0])
    if args:
        raise TypeError("njit takes keyword options only (no signatures) here")
    return deco


def torch_threads() -> int:
    """torch's intra-op thread count for the calling thread, capped at numba's pool size:
    the count a kernel sizes its work split for (e.g. DecodeAttention's KV chunks), so
    its results do not depend on how many threads one launch gets (`launch_threads`)."""
    import numba
    import torch
    return max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))


def follow_torch_threads() -> int:
    """Set numba's thread count for the calling thread (numba keeps it per thread) to
    torch's intra-op count, capped at numba's pool size (`torch_threads`), so a numba
    kernel called from an opencann executor uses as many threads as the ATen kernels
    beside it; returns it."""
    import numba
    n = torch_threads()
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    return n


#: elements of work below which a kernel runs on the calling thread alone: ATen's
#: ``at::internal::GRAIN_SIZE`` (its ``parallel_for`` runs a range of fewer elements
#: inline), also `ew_numba.PARALLEL_MIN`
GRAIN = 1 << 15
#: seconds between two readings of the load average (`oversubscribed`)
LOAD_SAMPLE_S = 0.5
_LOAD_TAU_S = 60.0   # the time constant of the kernel's 1-minute load average


class _Load:
    """`oversubscribed`'s state: the last reading's time and verdict, the process CPU
    time then, and this process's own running threads averaged as the load average is."""
    t = 0.0
    verdict = False
    cpu = 0.0
    own: Optional[float] = None


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # not Linux
        return os.cpu_count() or 1


def _process_age_s() -> Optional[float]:
    """Seconds since this process started (/proc), None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - start
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def others_load(load1: float, now: float, cpu: float) -> float:
    """The 1-minute load average ``load1`` less this process's own share of it: its
    running threads (process CPU seconds per wall second, ``cpu`` = `time.process_time`
    at monotonic time ``now``) averaged with the load average's own 1-minute time
    constant (the kernel updates it every 5 s: load = load·e + n·(1 − e), e = exp(−5/60)).
    The first reading starts that average as if the process had run at its mean CPU rate
    since it began (rate·(1 − exp(−age/60 s)): a young process is still mostly absent
    from the load average). Updates the state kept in `_Load`."""
    if _Load.own is None:
        age = _process_age_s()
        _Load.own = (min(cpu / age, float(_cpus())) * (1.0 - math.exp(-age / _LOAD_TAU_S))
                     if age and age > 0 else 0.0)
    elif _Load.t and now > _Load.t:   # an interval since the last reading
        rate = max(0.0, (cpu - _Load.cpu) / (now - _Load.t))
        _Load.own += (rate - _Load.own) * (1.0 - math.exp(-(now - _Load.t) / _LOAD_TAU_S))
    _Load.cpu = cpu
    return load1 - _Load.own


def oversubscribed() -> bool:
    """Whether a team of `torch_threads` threads would not find as many free CPUs: the
    runnable threads of other processes (the 1-minute load average less this process's
    own, `others_load`) plus the team exceed the CPUs in this process's affinity mask.
    Read at most every `LOAD_SAMPLE_S` seconds (the verdict is kept in between; threads
    racing on the reading only repeat it). False where there is no load average. The
    same signal libgomp's dynamic teams take (``OMP_DYNAMIC``:
    ``gomp_dynamic_max_threads`` gives CPUs − load average threads, its own included)."""
    now = time.monotonic()
    if _Load.t and now - _Load.t < LOAD_SAMPLE_S:
        return _Load.verdict
    try:
        load1 = os.getloadavg()[0]
    except (AttributeError, OSError):
        _Load.t, _Load.verdict = now, False
        return False
    others = others_load(load1, now, time.process_time())
    _Load.t, _Load.verdict = now, others + torch_threads() > _cpus() + 0.5
    return _Load.verdict


def launch_threads(work: int) -> int:
    """Threads for one launch of a parallel kernel doing ``work`` elements: torch's
    intra-op count (`torch_threads`), or 1 — the calling thread alone, no OpenMP team —
    when ``work`` is below `GRAIN` (waking a worker and meeting it at the end barrier
    costs more than it saves) or when the host is `oversubscribed`.

    Why the second rule (measured, docs/performance.md "Threads under load"): numba's
    ``omp`` layer runs its kernels in torch's own OpenMP pool (the GOMP symbols bind to
    torch's libgomp, loaded globally), whose threads spin-wait ~300 000 times at every
    barrier and after every region (libgomp's default without ``OMP_WAIT_POLICY``). When
    the host has more runnable threads than CPUs, the thread that finished its share
    spins on the CPU time its partner needs, and a region waits out the spin: a compiled
    2-layer Llama decode step (hidden 768, vocab 32000) took 130-140 ms (median of 150)
    with every kernel on 2 threads at load average 2.8-3.5 on 2 CPUs, 11-17 ms with this
    rule, 10-12 ms with ``OMP_WAIT_POLICY=PASSIVE`` (which the OpenMP runtime reads only
    when torch loads it, so opencann cannot set it for the user). A kernel's results never
    depend on this count: every work item is computed whole by one thread, and work
    splits are sized by `torch_threads`."""
    n = torch_threads()
    if n == 1 or work < GRAIN or oversubscribed():
        return 1
    return n


def launch(work: int):
    """Enter around one launch of a ``parallel=True`` kernel doing ``work`` elements: sets
    numba's thread count for the calling thread to `launch_threads` (work) and returns
    `launch_guard`'s context (a lock under numba's ``workqueue`` layer)."""
    import numba
    n = launch_threads(work)
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    return launch_guard()


_WORKQUEUE_LOCK = threading.Lock()


def launch_guard():
    """A lock when numba's threading layer is ``workqueue`` (not thread-safe: concurrent
    parallel launches terminate the process), else a no-op context; starts the layer if
    needed. Wrap every ``parallel=True`` kernel call an executor may make from threads."""
    import numba
    numba.get_parallel_chunksize()  # launches numba's threads: the layer is known after
    return _WORKQUEUE_LOCK if numba.threading_layer() == "workqueue" else contextlib.nullcontext()


__all__ = ["GRAIN", "LOAD_SAMPLE_S", "OpencannCacheLocator", "cache_dir", "follow_torch_threads", "launch",
           "launch_guard", "launch_threads", "njit", "oversubscribed", "torch_threads"]
