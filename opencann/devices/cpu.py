"""The host CPU as an opencann device: what this machine's CPU and torch build offer.

Facts are probed when asked (cheap; the L2 read is cached):

- `isa`: the vector instruction set ATen dispatches to (``torch.backends.cpu.
  get_cpu_capability()``: "AVX512", "AVX2", "DEFAULT", ...).
- `mkldnn_available`: oneDNN convolutions with fused post-ops exist in this torch build
  (``torch.ops.mkldnn._convolution_pointwise``), the kernels of ConvBiasAct/ConvAddAct.
- `mkl_packed_available`: MKL's packed GEMM (``torch.ops.mkl._mkl_linear``) exists, one
  of LinearAct's GEMMs.
- `onednn_linear_available`: oneDNN's inner product on a weight reordered once
  (``torch.ops.mkldnn._linear_pointwise`` on ``_reorder_linear_weight``) exists, another.
- `cpu_l2`: (bytes, source) of cpu0's L2 cache, read from
  ``/sys/devices/system/cpu/cpu0/cache/index*/{level,size}``; falls back to 1 MiB
  (a common per-core L2 of current x86 server cores) when unreadable. The
  FlashAttention tile planner sizes its CPU tiles from it.
- `memory_bytes`: host RAM in bytes (``psutil.virtual_memory().total``, else
  ``sysconf(SC_PAGE_SIZE · SC_PHYS_PAGES)``).
- `cpu_flags`: the instruction-set flags of cpu0 (``/proc/cpuinfo``'s ``flags`` line,
  sorted; ``platform.processor()`` where there is none), with the ISA overrides oneDNN
  and ATen read from the environment: what decides which kernel variant runs, so the
  eager-parity probe results (`opencann.ops.parity`) are cached per it.
- `onednn_int8_exact` / `int8_weight_bound`: whether oneDNN's uint8 x int8 products are
  exact here (VNNI / AMX-int8), else the largest |int8 weight| that keeps them exact
  (64 on x86 without VNNI: 7-bit weights), probed once per `cpu_flags`.
"""
from __future__ import annotations

import functools
import glob
import os
import platform
import time
from typing import Callable, Optional, Tuple

import torch

KIB = 1024
CPU_L2_FALLBACK = 1024 * KIB  # typical per-core L2 of recent x86 server cores
FORMATS = ("ND", "NCHW")      # storage formats the host keeps tensors in


def isa() -> str:
    """The vector ISA ATen's CPU kernels use ("AVX512", "AVX2", "DEFAULT", ...)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except AttributeError:  # pragma: no cover - very old torch
        return "unknown"


def mkldnn_available() -> bool:
    """True when oneDNN fused-post-op convolutions exist in this torch build."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_convolution_pointwise")


def mkl_packed_available() -> bool:
    """True when MKL's packed GEMM (``torch.ops.mkl._mkl_linear``) is available."""
    return hasattr(torch.ops, "mkl") and hasattr(torch.ops.mkl, "_mkl_linear") \
        and torch.backends.mkl.is_available()


def onednn_linear_available() -> bool:
    """True when oneDNN's prepacked inner product (``torch.ops.mkldnn._linear_pointwise``
    on a weight from ``torch.ops.mkldnn._reorder_linear_weight``) is available."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.lru_cache(maxsize=None)
def _read_caches() -> Tuple[Tuple[int, int, str], ...]:
    """(level, bytes, source) of cpu0's data / unified caches in sysfs, by level."""
    out = []
    for d in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        try:
            level = int(open(os.path.join(d, "level")).read().strip())
            kind = open(os.path.join(d, "type")).read().strip()
            size = open(os.path.join(d, "size")).read().strip()
            mult = {"K": KIB, "M": KIB * KIB}.get(size[-1], 1)
            nbytes = int(size.rstrip("KM")) * mult
        except (OSError, ValueError):
            continue
        if kind != "Instruction":
            out.append((level, nbytes, f"sysfs {d}/size = {size}"))
    return tuple(sorted(out))


def cpu_l2() -> Tuple[int, str]:
    """(bytes, source) of the L2 cache of cpu0, read from sysfs; falls back to 1 MiB."""
    for level, nbytes, source in _read_caches():
        if level == 2:
            return nbytes, source
    return CPU_L2_FALLBACK, "sysfs cache info unreadable; fallback 1 MiB (typical per-core L2)"


def cpu_last_level_cache() -> Tuple[int, str]:
    """(bytes, source) of cpu0's last-level (largest-level) data cache from sysfs, e.g. a
    shared L3; (0, reason) when sysfs does not say."""
    caches = _read_caches()
    if not caches:
        return 0, "sysfs cache info unreadable"
    level, nbytes, source = caches[-1]
    return nbytes, source


def memory_bytes() -> int:
    """Host RAM in bytes."""
    try:
        import psutil
        return int(psutil.virtual_memory().total)
    except ImportError:  # pragma: no cover
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# environment variables that change which vector kernels oneDNN and ATen dispatch to
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_CPU_ISA_HINTS")


@functools.lru_cache(maxsize=None)
def _proc_flags() -> Tuple[str, ...]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() in ("flags", "Features"):      # x86, arm64
                    return tuple(sorted(set(val.split())))
    except OSError:
        pass
    return (platform.machine(), platform.processor())


def cpu_flags() -> Tuple[str, ...]:
    """cpu0's instruction-set flags (``/proc/cpuinfo`` "flags" on x86, "Features" on
    arm64; sorted), then ``platform.machine()`` and each set variable of `ISA_ENV` as
    ``NAME=value``: the facts that decide which kernel variant ATen and oneDNN run. The
    file is read once per process; the environment every call."""
    env = tuple(f"{k}={os.environ[k]}" for k in ISA_ENV if k in os.environ)
    return _proc_flags() + (platform.machine(),) + env


def onednn_bf16_available() -> bool:
    """True when oneDNN's bf16 kernels run on this CPU (``torch.ops.mkldnn.
    _is_mkldnn_bf16_supported``: AVX-512 BW/VL, AVX-NE-CONVERT or AMX; without them its
    bf16 inner product refuses to reorder a weight and its bf16 convolution fails at the
    call). ATen's own bf16 kernels (``addmm``, ``convolution``) run everywhere."""
    if not torch.backends.mkldnn.is_available():
        return False
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


@functools.lru_cache(maxsize=None)
def _int8_exact(flags: Tuple[str, ...], w_max: int = 127) -> bool:
    """Whether oneDNN's ``qlinear_pointwise`` sums 64 products of 255 x ``w_max`` exactly
    on the CPU whose `cpu_flags` are ``flags`` (cached per flags and bound)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops, "onednn")
            and hasattr(torch.ops.onednn, "qlinear_pointwise")):
        return False
    k = 64
    x = torch.full((1, k), 255, dtype=torch.uint8)
    w = torch.full((2, k), w_max, dtype=torch.int8)
    one, zp = torch.ones(2), torch.zeros(2, dtype=torch.int64)
    try:
        wp = torch.ops.onednn.qlinear_prepack(w, [1, k])
        y = torch.ops.onednn.qlinear_pointwise(x, 1.0, 0, wp, one, zp, None, 1.0, 0, torch.float32,
                                               "none", [], "")
    except RuntimeError:
        return False
    return bool((y == 255 * w_max * k).all())


def onednn_int8_exact() -> bool:
    """True when oneDNN's uint8 x int8 kernels (``onednn.qlinear_pointwise``,
    ``qconv2d_pointwise``) compute their products exactly here: measured once per
    `cpu_flags` on 64 products of 255 x 127 (exact sum 2 072 640). Without VNNI / AMX-int8
    the x86 kernels add pairs of products in int16 with saturation (``vpmaddubsw``), which
    gives 32 x 32767 there; oneDNN's developer guide, "Nuances of int8 computations",
    advises 7-bit data on such CPUs. Where False, see `int8_weight_bound`."""
    return _int8_exact(cpu_flags())


#: the 7-bit weight bound: a pair of products 255 x 64 sums to 32 640 <= 32 767
INT8_WEIGHT_BOUND_7BIT = 64


def int8_weight_bound() -> Optional[int]:
    """The largest |int8 weight| for which oneDNN's uint8 x int8 kernels are exact on this
    CPU: 127 where `onednn_int8_exact` (VNNI / AMX-int8: int32 products), else 64 where a
    probe of 64 products of 255 x 64 is exact (x86 without VNNI: ``vpmaddubsw`` adds a pair
    of u8 x s8 products in int16 with saturation, and |255 x 64 x 2| = 32 640 <= 32 767;
    one more, 255 x 65 x 2 = 33 150, saturates), else None (the int8 ops then run their
    arithmetic in fp32, `opencann.ops.kernels.int8_emulated`). Measured once per
    `cpu_flags`. Sources: oneDNN developer guide, "Nuances of int8 computations" (7-bit
    data on CPUs without VNNI); NNCF / OpenVINO's ``overflow_fix`` (the weight range halved
    for the same reason)."""
    if onednn_int8_exact():
        return 127
    return INT8_WEIGHT_BOUND_7BIT if _int8_exact(cpu_flags(), INT8_WEIGHT_BOUND_7BIT) else None


def int8_weight_qmax() -> int:
    """The range [-qmax, qmax] opencann quantizes float weights to for the CPU's int8 ops:
    `int8_weight_bound` (64 on a CPU without VNNI: 7-bit weights, so oneDNN's kernels stay
    exact), 127 where it is None (the fp32 emulation is exact at 8 bits)."""
    return int8_weight_bound() or 127


__all__ = ["CPU_L2_FALLBACK", "FORMATS", "INT8_WEIGHT_BOUND_7BIT", "ISA_ENV", "cpu_flags", "cpu_l2",
           "cpu_last_level_cache", "int8_weight_bound", "int8_weight_qmax", "isa", "memory_bytes",
           "mkl_packed_available",
           "mkldnn_available", "onednn_bf16_available", "onednn_int8_exact", "onednn_linear_available"]


def best_time_us(fn: Callable[[], object], reps: int = 5, warmup: bool = True) -> float:
    """The best of ``reps`` timed calls of ``fn()`` in µs, after one untimed warm-up call
    unless ``warmup`` is False (the minimum is the figure least disturbed by other
    processes on a shared machine). Used by bind-time kernel choices that race two
    implementations and by the benches."""
    if warmup:
        fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6
