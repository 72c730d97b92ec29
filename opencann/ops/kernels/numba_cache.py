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
"""
from __future__ import annotations

import contextlib
import os
import threading

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


def follow_torch_threads() -> int:
    """Set numba's thread count for the calling thread (numba keeps it per thread) to
    torch's intra-op count, capped at numba's pool size, so a numba kernel called from
    an opencann executor uses as many threads as the ATen kernels beside it; returns it."""
    import numba
    import torch
    n = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    return n


_WORKQUEUE_LOCK = threading.Lock()


def launch_guard():
    """A lock when numba's threading layer is ``workqueue`` (not thread-safe: concurrent
    parallel launches terminate the process), else a no-op context; starts the layer if
    needed. Wrap every ``parallel=True`` kernel call an executor may make from threads."""
    import numba
    numba.get_parallel_chunksize()  # launches numba's threads: the layer is known after
    return _WORKQUEUE_LOCK if numba.threading_layer() == "workqueue" else contextlib.nullcontext()


__all__ = ["OpencannCacheLocator", "cache_dir", "follow_torch_threads", "launch_guard", "njit"]
