"""The host's OpenMP thread pools: the intra-op threads of torch's CPU kernels.

torch's CPU build runs its parallel kernels (ATen's ``parallel_for``, oneDNN, MKL) on
GNU OpenMP (libgomp). libgomp keeps one pool of worker threads per OS thread that ever
started a parallel region, for that thread's whole life, and counts all of them
(``gomp_managed_threads``). While that count exceeds the CPUs available, libgomp
*throttles* every team's spin-wait at its barriers (``gomp_throttled_spin_count_var``:
100 spins instead of 300 000 without ``OMP_WAIT_POLICY``; libgomp ``env.c``,
``config/linux/wait.h``), so worker threads sleep on a futex between parallel regions
and every region pays a wake-up. The common way to get there: the main thread loads
and compiles a model (its pool: N − 1 workers), then a server's request thread calls it
with N intra-op threads (a second pool). Measured on this project's 2-core host
(docs/performance.md, "OpenMP pools"): ResNet-50 batch 1, 2 intra-op threads, a call
from a non-main thread took 59–64 ms (median) with the main thread's pool alive and
50–51 ms after the main thread released it, as fast as on the main thread.

`release_openmp_pool` frees the calling thread's pool with the OpenMP 5.0 routine
``omp_pause_resource_all(omp_pause_soft)`` (OpenMP 5.0 spec §3.2.44; libgomp's
``gomp_pause_host`` ends the pool's threads and lowers the count). The thread keeps
working: its next parallel region starts a new pool (one ``pthread_create`` per worker,
tens of µs). `opencann.compile` and `opencann.load` call it on the calling thread when
they return, so "load and compile on the main thread, serve from others" does not
throttle; a thread that runs torch's parallel kernels later (an eager reference check,
a preprocessing step) can call `opencann.release_openmp_pool()` before the serving
threads start.
"""
from __future__ import annotations

import ctypes
import os
from typing import List, Optional, Tuple

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: omp_pause_soft (OpenMP 5.0 §3.2.43)


def openmp_library() -> Optional[str]:
    """The path of the OpenMP runtime torch's kernels run on (`torch_openmp_library`),
    where it is GNU OpenMP (libgomp); None where there is none (another OpenMP runtime,
    a torch built without OpenMP, no procfs)."""
    global _LIBRARY
    if _LIBRARY is None:
        path = torch_openmp_library()
        _LIBRARY = path if path is not None and "libgomp" in os.path.basename(path) else ""
    return _LIBRARY or None


_LIBRARY: Optional[str] = None


_OMP_PREFIXES = ("libgomp", "libiomp", "libomp")


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def torch_openmp_library() -> Optional[str]:
    """The path of the OpenMP runtime libtorch_cpu itself calls: its
    ``omp_get_max_threads`` looked up through libtorch_cpu's own dependency scope
    (``dlsym`` on its handle) and named by ``dladdr`` (glibc). Other packages load their
    own copies (scikit-learn's ``libgomp-<hash>.so``, loaded by transformers): setting a
    thread count through one of those changes nothing torch reads. Falls back to the
    first libgomp / libiomp / libomp under torch's own folder, then any loaded one; None
    where none is loaded."""
    torch_cpu = next((p for p in loaded_libraries() if os.path.basename(p).startswith("libtorch_cpu")), None)
    try:
        fn = ctypes.CDLL(torch_cpu).omp_get_max_threads if torch_cpu else None
        info = _DlInfo()
        libc = ctypes.CDLL(None)
        if fn is not None and libc.dladdr(ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info)) \
                and info.dli_fname:
            return os.path.realpath(os.fsdecode(info.dli_fname))
    except (OSError, AttributeError):
        pass
    omp = [p for p in loaded_libraries() if os.path.basename(p).startswith(_OMP_PREFIXES)]
    own = [p for p in omp if torch_cpu and os.path.dirname(p) == os.path.dirname(torch_cpu)]
    return (own or omp or [None])[0]



def loaded_libraries() -> List[str]:
    """Absolute paths of the shared libraries mapped into this process, sorted (from
    ``/proc/self/maps``; empty where procfs is missing)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if ".so" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.isabs(p))


def loaded_library(prefixes: Tuple[str, ...], symbol: str) -> Optional[ctypes.CDLL]:
    """The first library already loaded here whose file name starts with one of
    ``prefixes`` and that exports ``symbol``, opened with ctypes (the same copy torch
    uses, not a second one from the system); None where there is none."""
    for path in loaded_libraries():
        if os.path.basename(path).startswith(prefixes):
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            if hasattr(lib, symbol):
                return lib
    return None


def _pause_all():
    global _PAUSE
    path = openmp_library()
    if _PAUSE is None and path is not None:
        _PAUSE = _pause_routine(path)
    return _PAUSE or None


_PAUSE = None  # the routine, False where libgomp lacks it (None: not looked up yet)


def _pause_routine(path: str):
    try:
        fn = ctypes.CDLL(path).omp_pause_resource_all  # the already-loaded library
    except (OSError, AttributeError):  # pre-OpenMP-5.0 libgomp (GCC < 9)
        return False
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def pause_available() -> bool:
    """Whether `release_openmp_pool` can act here: libgomp is loaded and has OpenMP 5.0's
    ``omp_pause_resource_all``."""
    return _pause_all() is not None


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP worker pool (``omp_pause_resource_all``, soft),
    so that pools of other threads are not throttled by an idle one (module docstring).
    Safe at any time outside a parallel region and from any thread; the thread's next
    parallel kernel starts a new pool. Returns True when libgomp released it, False
    where there is nothing to call (no libgomp, an older one without OpenMP 5.0's pause
    routines) or it refused (called inside a parallel region). Never raises."""
    fn = _pause_all()
    return fn is not None and fn(OMP_PAUSE_SOFT) == 0


__all__ = ["OMP_PAUSE_SOFT", "loaded_libraries", "loaded_library", "openmp_library", "pause_available",
           "release_openmp_pool", "torch_openmp_library"]
