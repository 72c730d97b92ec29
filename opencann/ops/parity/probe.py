"""`Probe`: one declared eager-parity check, its results cached in memory and on disk.

A probe answers "does this kernel give eager's values on this CPU?" for one op or
fusion: it names what it guards (the fusion or layout move that asks it), the kernel it
compares with eager, and its inputs, and its ``run(*args)`` returns None (same values)
or one line saying where they differ. `Probe.__call__` looks the answer up per argument
tuple, first in this process, then in the disk cache (`cache`: per CPU flags, torch
version and `cache.PROBE_VERSION`), and runs the probe only when both miss. Every run is
counted in `RUNS` (its seconds in `SECONDS`) and logged at debug level ("eager-parity
probe ... ran").
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

import torch

from . import cache

# a child of the "opencann" logger (opencann/log.py: OPENCANN_LOG_LEVEL)
logger = logging.getLogger("opencann.parity")
RUNS: "collections.Counter[str]" = collections.Counter()   # probe name -> runs in this process
SECONDS: "collections.Counter[str]" = collections.Counter()  # probe name -> seconds they took
PROBES: Dict[str, "Probe"] = {}                             # name -> declaration
_memo: Dict[str, Optional[str]] = {}


def _part(a: Any) -> str:
    """A stable text form of one probe argument (the same in every process)."""
    if isinstance(a, (tuple, list)):
        return "(" + ",".join(_part(x) for x in a) + ")"
    if isinstance(a, torch.dtype):
        return str(a).replace("torch.", "")
    if isinstance(a, torch._ops.OpOverload):
        return str(a)
    return repr(a)


@dataclass(frozen=True)
class Probe:
    """An eager-parity probe. ``name``: its key (unique); ``guards``: the op, fusion or
    rewrite that asks it; ``kernel``: the kernel(s) compared with eager; ``inputs``: the
    probe inputs, in words; ``run(*args) -> None | str``: the probe itself; ``version``:
    bump it when the probe changes (its cached results are then dropped)."""

    name: str
    guards: str
    kernel: str
    inputs: str
    run: Callable[..., Optional[str]] = field(repr=False, compare=False)
    version: int = 1

    def entry(self, args: tuple) -> str:
        """The cache key of a call with ``args``."""
        return f"{self.name}/v{self.version}{_part(args)}"

    def __call__(self, *args: Any) -> Optional[str]:
        """None when the kernel gives eager's values on this CPU for ``args``, else the
        reason; cached per ``args`` (in memory, then on disk)."""
        entry = self.entry(args)
        if entry in _memo:
            return _memo[entry]
        hit = cache.lookup(entry)
        if hit is not cache.MISSING:
            _memo[entry] = hit
            return hit
        t0 = time.perf_counter()
        result = self.run(*args)
        took = time.perf_counter() - t0
        RUNS[self.name] += 1
        SECONDS[self.name] += took
        logger.debug("eager-parity probe %s ran in %.3f s: %s", entry, took,
                     result or "same values as eager")
        _memo[entry] = result
        cache.store(entry, result)
        return result


def register(probe: Probe) -> Probe:
    """Declare ``probe`` under its name (`PROBES`); returns it. Raises ValueError when
    another probe has that name."""
    if probe.name in PROBES and PROBES[probe.name] is not probe:
        raise ValueError(f"eager-parity probe {probe.name!r} is declared twice: rename one")
    PROBES[probe.name] = probe
    return probe


def clear_memory() -> None:
    """Forget every answer this process holds (the disk cache stays): the next call asks
    the disk cache, then runs the probe. For tests that change a probe's kernels; point
    ``OPENCANN_CACHE_DIR`` at an empty directory as well so the disk cannot answer."""
    _memo.clear()
    cache.forget()


__all__ = ["PROBES", "Probe", "RUNS", "SECONDS", "clear_memory", "register"]
