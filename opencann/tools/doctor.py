"""Environment doctor (``opencann doctor``): versions against `SUPPORTED`, the CPU (model,
AVX2 / AVX-512 / AMX from /proc/cpuinfo, torch's CPU capability), oneDNN and MKL, intra-op
threads, the eager-parity probe cache, the numba kernel cache (how many of the shipped
kernel signatures it holds: `numba_warm.cache_status`), CUDA, and the vnpu presets. Each
check is ok / warning / error with the advice that fixes it; ``opencann doctor`` exits 1
when any check is an error.
"""
from __future__ import annotations

import importlib
import os
import platform
import sys
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Tuple

# package -> (oldest supported, newest tested, required?): the one table of versions
SUPPORTED: Dict[str, Tuple[str, str, bool]] = {
    "python": ("3.10", "3.13", True),
    "torch": ("2.5", "2.13", True),
    "numba": ("0.60", "0.68", True),
    "transformers": ("4.45", "5.24", True),
    "triton": ("3.0", "3.9", False),
    "onnx": ("1.16", "1.23", False),
    "onnxruntime": ("1.18", "1.32", False),
}
_WHAT_FOR = {"triton": "CUDA code generation (flash attention on GPUs)",
             "onnx": ".onnx models", "onnxruntime": "checking .onnx models against ONNX Runtime"}


@dataclass
class Check:
    """One check: ``name``, ``status`` (ok / warning / error), what was found
    (``value``) and, unless ok, the ``advice`` that fixes it."""

    name: str
    status: str
    value: str
    advice: str = ""


def _parse(v: str) -> Tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def version_check(name: str, found: Optional[str]) -> Check:
    """The check of package ``name`` at version ``found`` (None: not installed)."""
    low, high, required = SUPPORTED[name]
    pip = "pip install 'opencann[onnx]'" if name.startswith("onnx") else f"pip install '{name}>={low}'"
    if found is None:
        if required:
            return Check(name, "error", "not installed", f"{pip} (opencann needs {name} >= {low})")
        return Check(name, "warning", "not installed", f"optional, for {_WHAT_FOR[name]}: {pip}")
    v = _parse(found)
    if v < _parse(low):
        if name == "python":
            return Check(name, "error", found, f"opencann needs Python >= {low}")
        return Check(name, "error", found, f"{name} {found} is older than the oldest supported, {low}: "
                     f"pip install -U '{name}>={low}'")
    if v[:2] > _parse(high)[:2]:
        return Check(name, "warning", found, f"newer than the newest tested ({high}); if something "
                     f"fails, try pip install '{name}=={high}.*'")
    return Check(name, "ok", found)


def _installed(name: str) -> Optional[str]:
    if name == "python":
        return platform.python_version()
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001 - any metadata problem: try the module itself
        try:
            return getattr(importlib.import_module(name), "__version__", "unknown")
        except Exception:  # noqa: BLE001 - not importable: not installed
            return None


def cpu_flags(path: str = "/proc/cpuinfo") -> Tuple[str, set]:
    """(CPU model name, ISA flags) from ``path``; ("", set()) where there is none."""
    model, flags = "", set()
    try:
        with open(path) as f:
            for line in f:
                k, _, v = line.partition(":")
                k = k.strip()
                if k == "model name" and not model:
                    model = v.strip()
                elif k in ("flags", "Features") and not flags:
                    flags = set(v.split())
    except OSError:
        pass
    return model or platform.processor(), flags


def _cpu_checks() -> List[Check]:
    import torch
    model, flags = cpu_flags()
    isa = [n for n, f in (("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AVX-512 BF16", "avx512_bf16"),
                          ("AMX", "amx_tile")) if f in flags]
    cap = torch.backends.cpu.get_cpu_capability()
    out = [Check("cpu", "ok", f"{model or platform.machine()}; ISA {', '.join(isa) or 'none of AVX2/AVX-512/AMX'}; "
                 f"torch kernels: {cap}")]
    if platform.machine() in ("x86_64", "AMD64") and "avx2" not in flags and flags:
        out[0] = Check("cpu", "warning", out[0].value, "no AVX2: torch's CPU kernels run their "
                       "slow default path; expect much lower speed than on a recent x86 CPU")
    mkldnn = torch.backends.mkldnn.is_available()
    out.append(Check("onednn", "ok" if mkldnn else "warning", "available" if mkldnn else "not available",
                     "" if mkldnn else "this torch build has no oneDNN: fused conv/linear kernels "
                     "are skipped (reported per node); install the official torch wheel"))
    mkl = torch.backends.mkl.is_available()
    out.append(Check("mkl", "ok" if mkl else "warning", "available" if mkl else "not available",
                     "" if mkl else "no MKL: packed GEMMs are skipped; install the official torch wheel"))
    n, cores = torch.get_num_threads(), os.cpu_count() or 1
    out.append(Check("threads", "ok" if n <= cores else "warning", f"{n} intra-op threads, {cores} CPUs",
                     "" if n <= cores else f"more threads than CPUs: set OMP_NUM_THREADS={cores} "
                     "or torch.set_num_threads"))
    out.append(_openmp_check())
    out += _low_precision_checks()
    return out


def _low_precision_checks() -> List[Check]:
    """bf16 and int8 on this CPU: oneDNN's bf16 kernels (else ATen's, slower) and how its
    uint8 x int8 products are exact: at 8 bits (VNNI), at 7 (x86 without VNNI: opencann
    quantizes weights to [-64, 64] there) or not at all (the int8 ops run in fp32)."""
    from ..devices.cpu import int8_weight_bound, onednn_bf16_available
    bf16 = onednn_bf16_available()
    return [Check("bf16", "ok" if bf16 else "warning",
                  "oneDNN bf16 kernels" if bf16 else "no oneDNN bf16 kernels (needs AVX-512 BW/VL, "
                  "AVX-NE-CONVERT or AMX)",
                  "" if bf16 else "bf16 GEMMs and convolutions run on ATen's kernels: expect bf16 "
                  "no faster than fp32 here"),
            _int8_check(int8_weight_bound())]


def _int8_check(bound) -> Check:
    """The ``int8`` row for `int8_weight_bound`'s answer ``bound`` (127, 64 or None)."""
    if bound == 127:
        return Check("int8", "ok", "oneDNN u8 x s8 products exact (VNNI / AMX-int8)")
    if bound is not None:
        return Check("int8", "ok", f"oneDNN u8 x s8 products exact for |w| <= {bound} (no VNNI: int16 pair "
                     f"sums): opencann.quantize gives 7-bit weights [-{bound}, {bound}] and runs oneDNN's "
                     "int8 kernels; an 8-bit int8 model (quantized on a VNNI CPU, ONNX int8 weights) runs "
                     "its arithmetic in fp32 here")
    return Check("int8", "warning", "oneDNN u8 x s8 products saturate (no VNNI)",
                 "int8 layers run their arithmetic in fp32 (correct, not faster than fp32); ONNX "
                 "Runtime's own u8 x s8 kernels saturate here too (its reduce_range)")


def _openmp_check() -> Check:
    from ..devices.cpu_threads import openmp_library, pause_available
    lib = openmp_library()
    if lib is None:
        return Check("openmp", "ok", "no GNU OpenMP runtime loaded (nothing to release)")
    if not pause_available():
        return Check("openmp", "warning", f"{lib} without omp_pause_resource_all",
                     "an idle thread's OpenMP pool cannot be released: serve from the thread "
                     "that compiled the model, or upgrade torch (GCC >= 9 libgomp)")
    return Check("openmp", "ok", f"{os.path.basename(lib)}; idle pools released by "
                 "opencann.release_openmp_pool (compile and load do it)")


def _parity_check() -> Check:
    """Where this machine's eager-parity probe answers are cached (`opencann.ops.parity.
    cache`), how many there are, and a warning when the cache cannot be written."""
    from ..ops.parity import cache
    try:
        path, n, writable = cache.status()
    except Exception as e:  # noqa: BLE001 - a broken install: say what failed
        return Check("parity-cache", "error", f"{type(e).__name__}: {e}", "reinstall opencann")
    if not writable:
        return Check("parity-cache", "warning", f"{path} cannot be written",
                     "every process probes this CPU's kernels again (seconds on its first "
                     "compile): set OPENCANN_CACHE_DIR to a writable directory")
    return Check("parity-cache", "ok", f"{n} probe answers for this CPU and torch in {path}")


def _kernel_cache_check() -> Check:
    """How many of the shipped numba kernel signatures the kernel cache holds
    (`numba_warm.cache_status`: numba's index files, nothing compiled), with ``opencann
    warm`` as the advice when some are missing."""
    from .numba_warm import cache_status, check_writable
    try:
        cached, total, path = cache_status()
        check_writable(path)
    except OSError as e:
        return Check("kernel-cache", "warning", str(e), "every process compiles the CPU kernels "
                     "it meets again (seconds each)")
    except Exception as e:  # noqa: BLE001 - a broken install: say what failed
        return Check("kernel-cache", "error", f"{type(e).__name__}: {e}", "reinstall opencann")
    value = f"{cached} of {total} shipped kernel signatures compiled in {path}"
    if cached >= total:
        return Check("kernel-cache", "ok", value)
    return Check("kernel-cache", "warning", value, "run `opencann warm` once (a minute or more): "
                 "otherwise the first compile or generate on this machine compiles them")


def _device_checks() -> List[Check]:
    import torch
    cuda = torch.cuda.is_available()
    out = [Check("cuda", "ok", f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}"
                 if cuda else f"no GPU (torch {torch.__version__}, CUDA build "
                 f"{torch.version.cuda or 'none'}); opencann compiles for cpu and vnpu")]
    try:
        from ..devices.vnpu import PRESETS
        out.append(Check("vnpu", "ok", "presets " + ", ".join(sorted(PRESETS))))
    except Exception as e:  # noqa: BLE001 - a broken install: say what failed
        out.append(Check("vnpu", "error", f"{type(e).__name__}: {e}", "reinstall opencann"))
    return out


def doctor(installed: Callable[[str], Optional[str]] = _installed) -> List[Check]:
    """Every check, in order: the `SUPPORTED` versions (``installed(name)`` gives the
    version found, None when missing; a test passes its own), CPU, oneDNN, MKL,
    threads, the eager-parity probe cache, the numba kernel cache, CUDA, vnpu."""
    checks = [version_check(name, installed(name)) for name in SUPPORTED]
    if any(c.name == "torch" and c.status == "error" for c in checks):
        return checks
    return checks + _cpu_checks() + [_parity_check(), _kernel_cache_check()] + _device_checks()


def to_json(checks: List[Check]) -> Dict[str, object]:
    """``{"status": worst status, "python": interpreter, "checks": [...]}`` for ``--json``."""
    worst = "error" if any(c.status == "error" for c in checks) else (
        "warning" if any(c.status == "warning" for c in checks) else "ok")
    return {"status": worst, "python": sys.executable, "checks": [asdict(c) for c in checks]}
