"""Compile opencann's numba kernels once, before the pytest-xdist workers start.

numba compiles a kernel per signature on first call and caches the machine code
(`opencann.ops.kernels.numba_cache`). With an empty cache (a fresh CI machine) each xdist
worker compiled every signature it met on its own: the same FlashAttention, decode
attention and GEMV kernels twice, 5-15 s each. Here the controller compiles the signatures
the suite uses (``numba_signatures.tsv``) into the cache first, in two processes, so the
workers load them (``conftest.py``'s ``pytest_configure``; ``OPENCANN_NUMBA_WARM=0`` turns it
off). The processes share no function: numba keeps one index file per function and
rewrites it on each save, so two writers of one function could drop an entry. A function
that no longer exists or a signature that no longer compiles is skipped: the worker that
needs it compiles it, as before.

Record the file again after kernels change (every opencann numba signature a test
compiles, with its compile seconds, in the order the suite met them)::

    OPENCANN_NUMBA_RECORD=/tmp/sigs.tsv OPENCANN_CACHE_DIR=$(mktemp -d) \\
        .venv/bin/python -m pytest tests -n 2 -m "not serial and not onnx_full and not full"
    python tests/numba_warm.py --replace /tmp/sigs.tsv

(``--replace``: the file becomes that recording; ``--merge``: the recording's entries are
added to the file's, for a recording of a few test files).

File format: one line per signature, ``seconds<TAB>module.function<TAB>signature`` (the
signature as numba prints a tuple of its types, which evaluates back to them in
``numba.core.types``'s namespace).
"""
from __future__ import annotations

import atexit
import importlib
import os
import subprocess
import sys
import time
from typing import Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
SIGNATURES = os.path.join(HERE, "numba_signatures.tsv")

Entry = Tuple[float, str, str]   # (compile seconds when recorded, module.function, signature)


def read(path: str = SIGNATURES) -> List[Entry]:
    """The entries of a signatures file (missing file: none)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) == 3:
                out.append((float(parts[0]), parts[1], parts[2]))
    return out


def split(entries: List[Entry], parts: int) -> List[List[Entry]]:
    """Entries in ``parts`` groups of whole functions, balanced by recorded seconds (longest
    function first into the lightest group)."""
    by_fn: Dict[str, List[Entry]] = {}
    for e in entries:
        by_fn.setdefault(e[1], []).append(e)
    groups: List[List[Entry]] = [[] for _ in range(parts)]
    load = [0.0] * parts
    for fn in sorted(by_fn, key=lambda f: -sum(e[0] for e in by_fn[f])):
        i = load.index(min(load))
        groups[i].extend(by_fn[fn])
        load[i] += sum(e[0] for e in by_fn[fn])
    return groups


def _dispatcher(qualname: str):
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _types(sig: str) -> tuple:
    """The argument types a recorded signature names (raises for one it cannot name, e.g. a
    literal a caller's typing passed)."""
    from numba.core import types
    namespace = dict(vars(types))
    namespace["bool"] = types.boolean
    args = eval(sig, {"__builtins__": {}}, namespace)   # noqa: S307 - our own file
    return args if isinstance(args, tuple) else (args,)


def compile_entries(entries: List[Entry]) -> int:
    """Compile each entry's signature (loading it when cached); returns how many compiled or
    loaded. An entry that fails is skipped."""
    done = 0
    for _, qualname, sig in entries:
        try:
            _dispatcher(qualname).compile(_types(sig))
            done += 1
        except Exception:   # a stale entry: the worker compiles what it needs
            pass
    return done


def warm(processes: int = 2, path: str = SIGNATURES) -> float:
    """Compile the file's signatures into the numba cache in ``processes`` processes; returns
    the wall seconds. Never raises for a failing process (the tests then compile lazily)."""
    entries = read(path)
    if not entries:
        return 0.0
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--part", str(i),
                               str(processes), path],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for i in range(processes)]
    for p in procs:
        p.wait()
    return time.perf_counter() - t0


def record(path: str) -> None:
    """Append every opencann numba signature this process compiles to ``path`` at exit
    (installed by conftest.py when ``OPENCANN_NUMBA_RECORD`` is set)."""
    from numba.core.dispatcher import Dispatcher
    original = Dispatcher.compile
    seen: Dict[Tuple[str, str], float] = {}

    def compile(self, sig):
        t0 = time.perf_counter()
        result = original(self, sig)
        name = f"{self.py_func.__module__}.{self.py_func.__qualname__}"
        if name.startswith("opencann.") and "<locals>" not in name:
            seen.setdefault((name, str(sig)), time.perf_counter() - t0)
        return result
    Dispatcher.compile = compile

    @atexit.register
    def _dump():
        with open(path, "a") as f:
            for (name, sig), seconds in seen.items():
                f.write(f"{seconds:.2f}\t{name}\t{sig}\n")


def merge(recorded: str, path: str = SIGNATURES, keep: bool = True) -> int:
    """Rewrite ``path`` from recordings (each signature once, its largest seconds; only
    module-level functions that still exist and signatures `_types` can name: a callee
    typed inside a caller with literal arguments is compiled with its caller), keeping
    ``path``'s own entries unless not ``keep`` (``--replace``: a recording of the whole
    suite), so a recording of a few test files adds to the file; returns the number of
    entries."""
    best: Dict[Tuple[str, str], float] = {}
    old = read(path) if keep else []
    for seconds, name, sig in old + read(recorded):
        try:
            _types(sig)
            _dispatcher(name).compile   # a function since removed is dropped
        except Exception:
            continue
        best[(name, sig)] = max(seconds, best.get((name, sig), 0.0))
    with open(path, "w") as f:
        for (name, sig), seconds in sorted(best.items()):
            f.write(f"{seconds:.2f}\t{name}\t{sig}\n")
    return len(best)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--part"]:
        index, parts, file = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
        sys.path.insert(0, os.path.dirname(HERE))
        compile_entries(split(read(file), parts)[index])
    elif sys.argv[1:2] in (["--merge"], ["--replace"]):
        sys.path.insert(0, os.path.dirname(HERE))
        print(f"{merge(sys.argv[2], keep=sys.argv[1] == '--merge')} signatures in {SIGNATURES}")
    else:
        print(f"usage: {sys.argv[0]} --merge|--replace RECORDED.tsv | --part I N FILE", file=sys.stderr)
        sys.exit(2)
