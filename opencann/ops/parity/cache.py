"""The eager-parity probe results on disk, so that only the first process on a machine
pays for the probes (seconds: the LayerNorm probe alone runs ATen's kernel on 70 rows
in 16 ways).

One JSON file per machine key (`machine_key`: this CPU's flags with the ISA overrides
read from the environment, torch's version and commit, whether oneDNN is built in, and
`PROBE_VERSION`) in ``<cache dir>/parity/<hash of the key>.json``; the file repeats its
key, and a file whose key differs (a hash collision, a hand edit) is not read. The
cache directory is ``OPENCANN_CACHE_DIR`` when set, else ``platformdirs.user_cache_dir(
"opencann")`` when platformdirs is installed, else ``$XDG_CACHE_HOME/opencann`` (default
``~/.cache/opencann``), the XDG base directory specification's place for caches.

Writes are atomic (a temporary file in the same directory, then ``os.replace``) and
merge what another process wrote meanwhile. A corrupt, unreadable or unwritable cache is
ignored with a debug log line (``OPENCANN_LOG_LEVEL=DEBUG``): the probe then runs, as
without a cache. Results are only kept when their key names no object address.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from typing import Any, Dict, Optional, Tuple

import torch

from ...devices.cpu import cpu_flags, mkldnn_available

# a child of the "opencann" logger (opencann/log.py: OPENCANN_LOG_LEVEL)
logger = logging.getLogger("opencann.parity")
# bump when a probe's inputs, kernels or comparison change: every cached result is dropped
PROBE_VERSION = 1
_FORMAT = 1
_MISSING = object()
_loaded: Dict[str, Dict[str, Optional[str]]] = {}   # cache file -> its results, read once


def cache_dir() -> str:
    """The user cache directory of opencann (module docstring: ``OPENCANN_CACHE_DIR``,
    platformdirs, ``$XDG_CACHE_HOME/opencann``, ``~/.cache/opencann``)."""
    override = os.environ.get("OPENCANN_CACHE_DIR")
    if override:
        return override
    try:
        import platformdirs
        return platformdirs.user_cache_dir("opencann")
    except ImportError:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "opencann")


def machine_key() -> Dict[str, Any]:
    """What the probe results depend on besides the probe's arguments: `cpu_flags`
    (with the ISA environment overrides), torch's version and git commit (ATen and the
    oneDNN it bundles), oneDNN's availability, `PROBE_VERSION`."""
    return {"cpu_flags": hashlib.sha256(" ".join(cpu_flags()).encode()).hexdigest(),
            "torch": str(torch.__version__), "torch_git": str(getattr(torch.version, "git_version", "")),
            "mkldnn": bool(mkldnn_available()), "probe_version": PROBE_VERSION}


def cache_file(key: Optional[Dict[str, Any]] = None) -> str:
    """The path of the results file for ``key`` (default: this machine's `machine_key`)."""
    key = machine_key() if key is None else key
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(cache_dir(), "parity", f"{digest}.json")


def _read(path: str, key: Dict[str, Any]) -> Dict[str, Optional[str]]:
    """The results in ``path`` ({} when it is missing, corrupt or for another key)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.debug("eager-parity cache %s ignored: %s", path, e)
        return {}
    if not isinstance(data, dict) or data.get("format") != _FORMAT or data.get("key") != key:
        logger.debug("eager-parity cache %s ignored: written for another machine key or format", path)
        return {}
    results = data.get("results")
    if not isinstance(results, dict) or not all(isinstance(v, (str, type(None))) for v in results.values()):
        logger.debug("eager-parity cache %s ignored: its results are not strings or null", path)
        return {}
    return results


def lookup(entry: str) -> Any:
    """The cached result of probe call ``entry`` (None or a reason string), or `MISSING`."""
    key = machine_key()
    path = cache_file(key)
    if path not in _loaded:
        _loaded[path] = _read(path, key)
    return _loaded[path].get(entry, _MISSING)


def store(entry: str, result: Optional[str]) -> None:
    """Record ``result`` for ``entry`` in memory and on disk (merged with the file as it
    is now, written atomically); a failure to write is logged at debug level and ignored."""
    if " at 0x" in entry:            # an object address: never the same in another process
        return
    key = machine_key()
    path = cache_file(key)
    results = _loaded.setdefault(path, {})
    results[entry] = result
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        merged = {**_read(path, key), **results}
        fd, tmp = tempfile.mkstemp(prefix=".parity-", suffix=".tmp", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"format": _FORMAT, "key": key, "results": merged}, f, indent=0,
                          sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        results.update(merged)
    except OSError as e:
        logger.debug("eager-parity cache %s not written: %s", path, e)


def status() -> Tuple[str, int, bool]:
    """(this machine's results file, how many answers it holds, whether its directory is
    writable or can be created): for ``opencann doctor``."""
    key = machine_key()
    path = cache_file(key)
    probe_dir = os.path.dirname(path)
    while not os.path.exists(probe_dir) and os.path.dirname(probe_dir) != probe_dir:
        probe_dir = os.path.dirname(probe_dir)
    writable = os.path.isdir(probe_dir) and os.access(probe_dir, os.W_OK | os.X_OK)
    return path, len(_read(path, key)), writable


def forget() -> None:
    """Drop what this process read from the cache files (the files stay)."""
    _loaded.clear()


MISSING = _MISSING

__all__ = ["MISSING", "PROBE_VERSION", "cache_dir", "cache_file", "forget", "lookup",
           "machine_key", "status", "store"]
