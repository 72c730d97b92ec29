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
import functools
import hashlib
import math
import os
import threading
import time
from typing import Callable, Optional

from numba import njit as _numba_njit
from numba._dispatcher import compute_fingerprint
from numba.core import types
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


@functools.lru_cache(maxsize=4)
def kernel_sources_stamp(root: Optional[str] = None) -> str:
    """A digest of the name and contents of every ``.py`` file under ``opencann/ops``
    (the numba kernels and what they inline or call: register tiles written as IR
    intrinsics, ``inline="always"`` helpers in other files), computed once per process.
    numba stamps a cached function with its own source file's contents only (numba
    ``caching._SourceFileBackedLocatorMixin.get_source_stamp``), so a changed intrinsic
    in ``gemv_tile.py`` left ``gemv_cpu.py``'s kernels loading the old machine code; the
    locators below add this digest to the stamp, and any change under ``opencann/ops``
    recompiles the cached kernels once. ``root``: another directory to digest (a test)."""
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for d, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                h.update(os.path.relpath(path, root).encode() + b"\0")
                try:
                    with open(path, "rb") as fh:
                        h.update(hashlib.sha256(fh.read()).digest())
                except OSError:       # unreadable: its name alone counts
                    pass
    return h.hexdigest()[:16]


class _DepsStamp:
    """A locator mixin: the source stamp is numba's (a digest of the file) and
    `kernel_sources_stamp`."""

    def get_source_stamp(self):
        return super().get_source_stamp(), kernel_sources_stamp()


class _UserProvidedLocator(_DepsStamp, UserProvidedCacheLocator):
    """numba's ``NUMBA_CACHE_DIR`` locator with `_DepsStamp`'s stamp."""


class _UserWideLocator(_DepsStamp, UserWideCacheLocator):
    """numba's user-wide locator with `_DepsStamp`'s stamp."""


class OpencannCacheLocator(_DepsStamp, UserProvidedCacheLocator):
    """numba's user-provided locator pointed at `cache_dir` instead of ``NUMBA_CACHE_DIR``
    (one subdirectory per source directory, as numba names them), stamped with
    `_DepsStamp`."""

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
    _locator_classes = [_UserProvidedLocator, OpencannCacheLocator, _UserWideLocator]


def entry_point(dispatcher, args: tuple) -> Optional[Callable]:
    """The compiled machine-code entry of numba ``dispatcher`` for the numba types of
    ``args``, or None while it has none (call the dispatcher: it compiles or loads it
    from the cache) or when ``dispatcher`` is no numba dispatcher: a callable that unboxes its arguments as those types without the
    dispatcher's type resolution. For a bound kernel whose calls always pass arguments of
    exactly those types (same dtypes, ranks, layouts): a wrong type is not checked and
    reads memory wrongly. Why: right after a decode step's GEMM has streamed megabytes
    of weights, the dispatcher's type resolution misses the caches all the way (measured,
    one 768-element AddRmsNorm row after a 64 MiB copy: 28.6 µs through the dispatcher,
    10.4 µs through the entry point; warm 1.0 against 0.5 µs)."""
    if not hasattr(dispatcher, "overloads"):     # a plain function (a test's wrapper)
        return None
    cres = dispatcher.overloads.get(tuple(dispatcher.typeof_pyval(a) for a in args))
    return None if cres is None else cres.entry_point


def general_entry(kernel, args: tuple, general: tuple) -> Callable:
    """The compiled entry of numba ``kernel`` for ``args`` with the arrays at the positions
    ``general`` typed as layout ``'A'`` (any strides) and the others as they are, compiled
    or loaded from the cache on first use; ``kernel`` itself when it is no numba dispatcher
    (a test's wrapper). Call it with arguments of those types only (see `entry_point`).
    Why: numba compiles one machine code per combination of argument layouts, and a
    parallel kernel takes 5-25 s to compile on the 2-core EPYC: an argument that some
    callers pass contiguous and others as a view (a graph's slice of a fused QKV output,
    a caller's contiguous tensor) made FlashAttention's forward compile six times and the
    decode attention-with-cache-write four. Only for arguments the kernel reads or writes
    a row at a time, where the unknown stride costs nothing measurable (a strided q, k or
    v made FlashAttention's forward ~8% slower at [1, 12, 512, 64], so those stay as they
    are). The entry is memoized on numba's own fingerprints of the argument types (what
    its dispatcher keys on; ~0.2 us an argument against ~3-10 us for a Python-level
    typeof, measured on the loaded 2-core EPYC: a 17-argument FlashAttention call's
    lookup 188 -> 1.9 us). Source: numba docs, "Types and signatures" (array layouts
    'C', 'F', 'A')."""
    if not hasattr(kernel, "overloads"):
        return kernel
    try:     # numba's own C fingerprint of each argument's type (~0.2 us; typeof ~3-10)
        key = (kernel, general) + tuple(map(compute_fingerprint, args))
    except (TypeError, ValueError):     # a type without a fingerprint: no memo
        key = None
    entry = _ENTRIES.get(key) if key is not None else None
    if entry is None:
        sig = tuple(_any_layout(kernel.typeof_pyval(a)) if i in general else kernel.typeof_pyval(a)
                    for i, a in enumerate(args))
        cres = kernel.overloads.get(sig)
        if cres is None:
            kernel.compile(sig)
            cres = kernel.overloads[sig]
        entry = cres.entry_point
        if key is not None:
            _ENTRIES[key] = entry
    return entry


#: `general_entry`'s memo: (kernel, positions, argument type fingerprints) -> entry point
_ENTRIES: dict = {}


def _any_layout(t):
    """Numba type ``t`` with layout 'A' when it is an array type."""
    return t.copy(layout="A") if isinstance(t, types.Array) and t.layout != "A" else t


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
#: seconds between two readings of the host's runnable threads (`oversubscribed`)
LOAD_SAMPLE_S = 0.5
#: seconds: the time constant over which other processes' runnable threads are averaged
LOAD_TAU_S = 5.0


class _Load:
    """`oversubscribed`'s state: the last reading's time and verdict, and the average of
    other processes' runnable threads (None before a first reading)."""
    t = 0.0
    verdict = False
    others: Optional[float] = None


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # not Linux
        return os.cpu_count() or 1


def runnable_threads() -> Optional[float]:
    """Threads runnable on the host now, the reading one included: the 4th field of
    /proc/loadavg ("running/total", the scheduler's nr_running), else the 1-minute load
    average (``os.getloadavg``, where there is no procfs); None where neither exists."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def own_running_threads() -> Optional[int]:
    """This process's threads running or runnable now (state ``R`` in
    /proc/self/task/*/stat), the reading one included; None where there is no procfs."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    n = 0
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/stat") as f:
                n += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            continue
    return max(1, n)


def others_load(runnable: float, now: float, own: float) -> float:
    """Other processes' runnable threads, averaged over `LOAD_TAU_S` seconds: each reading
    of the host's ``runnable`` threads less this process's ``own`` running ones read at
    the same instant (`own_running_threads`: an OpenMP worker spinning after a torch
    kernel is running, and is ours), folded into an exponential average that starts at 0
    (the first reading weighs as one `LOAD_SAMPLE_S` step: the two counts are read a few
    µs apart, and on a quiet 2-CPU host half of the fresh processes read 1 other thread at
    their first launch, a worker of ours changing state between the reads or a kernel
    thread, which taken as it was ran every kernel on one thread for the first ~3.5 s:
    FlashAttention at S = 512 6.9 against 3.3 ms; 7 other threads are still seen within
    ~1 s). Updates `_Load`."""
    if _Load.others is None or not _Load.t or now <= _Load.t:
        _Load.others, dt = 0.0, LOAD_SAMPLE_S
    else:
        dt = now - _Load.t
    _Load.others += (runnable - own - _Load.others) * (1.0 - math.exp(-dt / LOAD_TAU_S))
    return _Load.others


def oversubscribed() -> bool:
    """Whether a team of `torch_threads` threads would not find as many free CPUs: other
    processes' runnable threads (`others_load`, rounded) plus the team exceed the CPUs in
    this process's affinity mask. Read at most every `LOAD_SAMPLE_S` seconds (the verdict
    is kept in between; threads racing on a reading only repeat it). False where the
    host's runnable threads cannot be read. The idea of libgomp's dynamic teams
    (``OMP_DYNAMIC``: ``gomp_dynamic_max_threads`` gives CPUs − load average threads),
    with the load read now and this process's own threads left out."""
    now = time.monotonic()
    if _Load.t and now - _Load.t < LOAD_SAMPLE_S:
        return _Load.verdict
    runnable = runnable_threads()
    if runnable is None:
        _Load.t, _Load.verdict = now, False
        return False
    own = own_running_threads()
    others = others_load(runnable, now, float(own if own is not None else 1))
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


def prebound(kernel, args: tuple, work: Optional[int] = None, threads: Optional[int] = None,
             lock=None, result=None) -> Callable[[], object]:
    """``call()``: the numba ``kernel`` on ``args`` — NumPy views of tensors that are the
    same objects over the same memory at every call (a compiled graph's constants and
    arena buffers: `opencann.runtime.codegen` prebinds a node whose operands are all
    such) — launched as a bound call is (a ``parallel=True`` kernel on `launch_threads`
    of ``work`` elements unless ``threads``, under ``lock``; ``work`` None: a serial
    kernel, called as it is), through the kernel's compiled entry point (compiled here, at
    bind time, for ``args``' types); returns ``result`` (the output tensors the views
    write). Why: a bound call checks its tensors' identity and data pointers and converts
    them at every call, and right after a decode GEMV has streamed its weight every one of
    those Python and torch calls misses the caches (measured on the 2-core EPYC after a
    400 MiB read, median of 21: an AddRmsNorm call through its bound run 41.8 µs, a
    prebound call of the same kernel 18.9 µs)."""
    import numba
    fn = entry_point(kernel, args)
    if fn is None:
        kernel.compile(tuple(numba.typeof(a) for a in args))
        fn = entry_point(kernel, args) or kernel
    get_threads, set_threads = numba.get_num_threads, numba.set_num_threads

    def call():
        if work is not None:
            nt = threads if threads is not None else launch_threads(work)
            if get_threads() != nt:
                set_threads(nt)
        if lock is None:
            fn(*args)
        else:
            with lock:
                fn(*args)
        return result
    return call


def _start_threads() -> None:
    """Start numba's threading layer now (on the importing thread), keeping that thread's
    torch intra-op count: numba's ``omp`` layer, on its first launch, sets the calling
    thread's OpenMP count to its pool size (``omp_set_num_threads(NUMBA_NUM_THREADS)``),
    which would turn a caller's ``torch.set_num_threads(1)`` into 2 behind its back
    (its ATen kernels then ran two-threaded: a [2, 3] softmax 0.002 -> 4-8 ms on a loaded
    host). Every later launch finds the layer started and leaves the count alone."""
    import numba
    import torch
    n = torch.get_num_threads()
    try:
        numba.get_parallel_chunksize()   # launches numba's threads (parallel._launch_threads)
    finally:
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)


_start_threads()


__all__ = ["GRAIN", "LOAD_SAMPLE_S", "LOAD_TAU_S", "OpencannCacheLocator", "cache_dir", "prebound",
           "entry_point", "follow_torch_threads", "general_entry", "launch", "launch_guard", "launch_threads", "njit", "others_load",
           "own_running_threads",
           "oversubscribed", "runnable_threads", "torch_threads"]
