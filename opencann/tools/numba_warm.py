"""Ahead-of-time warm-up of the numba kernel cache (``opencann warm``, ``opencann.warm()``).

opencann's CPU kernels are numba functions compiled on their first call for the argument
types they meet and cached on disk (`opencann.ops.kernels.numba_cache`: ``$NUMBA_CACHE_DIR``,
else ``$OPENCANN_CACHE_DIR/numba``, else ``$XDG_CACHE_HOME/opencann/numba`` or
``~/.cache/opencann/numba``). With an empty cache (a new machine, a new opencann version:
the cache is stamped with the kernels' sources) the first compile, call or ``generate``
spends tens of seconds compiling them, 0.1-40 s per signature. `warm` compiles the
signatures listed in ``numba_signatures.tsv`` (shipped with this package) into the cache
first, in several processes, so later processes only load them. A compiler that caches
generated code warms it ahead of time the same way (e.g. a JIT's precompiled images).

The processes share no function: numba keeps one index file per function and rewrites it
on each save, so two writers of one function could drop an entry (numba
``caching.IndexDataCacheFile.save``). A line that cannot be read, a function that no longer
exists or a signature that no longer compiles is skipped with its reason: the first call
that needs it compiles it, as without the warm-up. The test suite's controller runs `warm`
before its pytest-xdist workers start (``tests/conftest.py``).

File format: one line per signature, ``seconds<TAB>module.function<TAB>signature`` (the
compile seconds when recorded; the signature as numba prints a tuple of its types, which
evaluates back to them in ``numba.core.types``'s namespace). Developers record it again
after kernels change with `record` and `merge` (``tests/numba_warm.py`` says how).
Progress goes to a callback; the command line draws it with rich (a dependency already).
"""
from __future__ import annotations

import atexit
import dataclasses
import importlib
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from importlib import resources
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

SIGNATURES_FILE = "numba_signatures.tsv"
_MARK = "@opencann-warm"   # prefix of a worker's result lines (other output is ignored)


class Entry(NamedTuple):
    """One line of a signatures file: recorded compile ``seconds``, ``function``
    (``module.qualname``) and ``signature`` (numba's text of the argument types)."""

    seconds: float
    function: str
    signature: str


@dataclasses.dataclass
class Skipped:
    """A signature not compiled: its ``function`` (or ``line N`` for an unreadable line),
    ``signature`` and the ``reason``."""

    function: str
    signature: str
    reason: str


@dataclasses.dataclass
class WarmResult:
    """What `warm` did: ``total`` signatures selected (unreadable lines included), how many
    were ``compiled`` into the cache, found already ``cached``, ``skipped`` (with reasons),
    ``failed`` (one message per worker process that exited with an error; the signatures
    it did not report are in no count), the wall ``seconds`` and the ``cache_dir``
    written. ``ok``: no failure."""

    total: int
    compiled: int = 0
    cached: int = 0
    skipped: List[Skipped] = dataclasses.field(default_factory=list)
    failed: List[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    cache_dir: str = ""

    @property
    def ok(self) -> bool:
        """True when every worker process finished (skipped signatures are no failure)."""
        return not self.failed

    def to_dict(self) -> Dict[str, object]:
        """A JSON-ready dict of the fields (``skipped`` as dicts) plus ``ok``."""
        d = dataclasses.asdict(self)
        d["ok"] = self.ok
        return d


class CacheStatus(NamedTuple):
    """How many of the ``total`` signatures are ``cached`` in ``cache_dir``."""

    cached: int
    total: int
    cache_dir: str


def signatures_path() -> str:
    """The path of the signatures file shipped in this package (``opencann/tools/
    numba_signatures.tsv``, package data: pyproject.toml ``[tool.setuptools.package-data]``)."""
    return str(resources.files(__package__).joinpath(SIGNATURES_FILE))


def read_file(path: Optional[str] = None) -> Tuple[List[Entry], List[Skipped]]:
    """(entries, unreadable lines as `Skipped`) of the signatures file ``path`` (default
    `signatures_path`); a missing file has none. Blank lines and ``#`` comments are
    ignored. Raises OSError when the file exists but cannot be read."""
    path = path or signatures_path()
    if not os.path.exists(path):
        return [], []
    entries, bad = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            text = line.rstrip("\n")
            if not text.strip() or text.startswith("#"):
                continue
            parts = text.split("\t")
            if len(parts) != 3:
                bad.append(Skipped(f"line {n}", text[:60], f"{len(parts)} tab-separated fields, "
                                   "expected 3 (seconds, module.function, signature)"))
                continue
            try:
                entries.append(Entry(float(parts[0]), parts[1], parts[2]))
            except ValueError:
                bad.append(Skipped(f"line {n}", parts[2][:60], f"seconds {parts[0]!r} is not a number"))
    return entries, bad


def read(path: Optional[str] = None) -> List[Entry]:
    """The readable entries of a signatures file (`read_file` without the bad lines)."""
    return read_file(path)[0]


def split(entries: Sequence[Entry], parts: int) -> List[List[Entry]]:
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
    args = eval(sig, {"__builtins__": {}}, namespace)   # noqa: S307 - names of numba types only
    return args if isinstance(args, tuple) else (args,)


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def compile_one(function: str, signature: str) -> Tuple[str, str]:
    """Compile (or load from the cache) numba kernel ``function`` for ``signature`` in this
    process: ``("compiled" | "cached" | "skipped", reason)``; never raises for a stale
    entry (a missing function, a signature it cannot name, a compile error)."""
    try:
        disp = _dispatcher(function)
    except Exception as e:  # noqa: BLE001 - a stale entry: skipped with its reason
        return "skipped", f"no function {function} ({_first_line(e)})"
    if not hasattr(disp, "overloads") or type(getattr(disp, "_cache", None)).__name__ == "NullCache":
        return "skipped", f"{function} is not a numba kernel cached on disk (cache=True)"
    try:
        sig = _types(signature)
    except Exception as e:  # noqa: BLE001 - a signature numba's types cannot name
        return "skipped", f"signature not understood ({_first_line(e)})"
    if sig in disp.overloads:   # compiled here as an earlier kernel's callee, or loaded
        return ("compiled" if disp.stats.cache_misses.get(sig) else "cached"), ""
    if _in_cache(disp, sig):
        return "cached", ""
    hits = sum(disp.stats.cache_hits.values())
    try:
        disp.compile(sig)
    except Exception as e:  # noqa: BLE001 - no longer compiles: its first call will say why
        return "skipped", f"does not compile ({_first_line(e)})"
    return ("cached" if sum(disp.stats.cache_hits.values()) > hits else "compiled"), ""


def _in_cache(disp, sig: tuple, index: Optional[dict] = None) -> bool:
    """Whether numba's cache of dispatcher ``disp`` holds machine code for ``sig`` on this
    CPU for the current sources: the key its compile looks up is in the function's index
    file (``index``: that file's contents, already read) and the data file it names
    exists; read without loading the code. Uses numba's cache internals
    (``Cache._index_key``, ``IndexDataCacheFile._load_index``, numba 0.60-0.68); False
    where they differ."""
    try:
        cache_file = disp._cache._cache_file
        if index is None:
            index = cache_file._load_index()
        name = index.get(disp._cache._index_key(sig, disp.targetctx.codegen()))
        return name is not None and os.path.exists(os.path.join(cache_file._cache_path, name))
    except Exception:  # noqa: BLE001 - another numba's internals, no cache: not known cached
        return False


def kernel_cache_dir() -> str:
    """The directory the kernels are cached in: ``$NUMBA_CACHE_DIR`` when set, else
    `opencann.ops.kernels.numba_cache.cache_dir`."""
    from ..ops.kernels.numba_cache import cache_dir
    return os.environ.get("NUMBA_CACHE_DIR") or cache_dir()


def check_writable(directory: str) -> None:
    """Create ``directory`` if needed and write a temporary file in it. Raises OSError
    with one line naming the directory, the system's reason and the fix
    (``OPENCANN_CACHE_DIR``) when either fails."""
    try:
        os.makedirs(directory, exist_ok=True)
        tempfile.TemporaryFile(dir=directory).close()
    except OSError as e:
        raise OSError(f"the kernel cache directory {directory} cannot be written "
                      f"({e.strerror or type(e).__name__}): set OPENCANN_CACHE_DIR to a writable "
                      "directory") from None


def select(entries: Sequence[Entry], only: Optional[Sequence[str]]) -> List[Entry]:
    """The entries whose function contains one of the substrings ``only`` (None: all).
    Raises ValueError naming the shipped modules when ``only`` matches none."""
    if not only:
        return list(entries)
    out = [e for e in entries if any(s in e.function for s in only)]
    if not out:
        modules = sorted({e.function.rsplit(".", 2)[-2] for e in entries})
        raise ValueError(f"no kernel signature's function contains {', '.join(map(repr, only))}; "
                         f"names contain e.g. {', '.join(modules[:6])}")
    return out


def _default_processes() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # not Linux
        return os.cpu_count() or 1


def _spawn(indexed: List[Tuple[int, Entry]], err) -> subprocess.Popen:
    """A worker process compiling ``indexed`` (entries with their index in the parent's
    list), which it reads from its stdin; stderr to the file ``err``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # has opencann/
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    p = subprocess.Popen([sys.executable, "-m", __name__, "--part"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=err, env=env, text=True)
    try:
        p.stdin.write("".join(f"{i}\t{e.seconds}\t{e.function}\t{e.signature}\n" for i, e in indexed))
        p.stdin.close()
    except BrokenPipeError:   # it died at start: its exit status and stderr say why
        pass
    return p


def _read_lines(i: int, stream, out: "queue.Queue") -> None:
    for line in stream:
        out.put((i, line))
    out.put((i, None))


def _collect(procs, entries: List[Entry], result: WarmResult,
             progress: Optional[Callable[[int, int, str], None]], done: int = 0) -> None:
    """Read the workers' result lines into ``result`` as they come, calling ``progress``
    (signatures done, counting from ``done``; total; function) after each."""
    lines: "queue.Queue" = queue.Queue()
    for i, p in enumerate(procs):
        threading.Thread(target=_read_lines, args=(i, p.stdout, lines), daemon=True).start()
    open_streams = len(procs)
    while open_streams:
        _, line = lines.get()
        if line is None:
            open_streams -= 1
            continue
        if not line.startswith(_MARK + "\t"):
            continue
        _, index, status, reason = line.rstrip("\n").split("\t", 3)
        e = entries[int(index)]
        if status == "skipped":
            result.skipped.append(Skipped(e.function, e.signature, reason))
        else:
            setattr(result, status, getattr(result, status) + 1)
        done += 1
        if progress is not None:
            progress(done, result.total, e.function)


def _last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:200] if lines else ""


def warm(processes: Optional[int] = None, only: Optional[Sequence[str]] = None,
         path: Optional[str] = None,
         progress: Optional[Callable[[int, int, str], None]] = None) -> WarmResult:
    """Compile the kernel signatures of ``path`` (default: the shipped `signatures_path`)
    into the numba cache (`kernel_cache_dir`) in ``processes`` worker processes (default:
    the CPUs this process may use, at most one per function), each function in one
    process. ``only``: substrings of function names (e.g. ``["decode_attention"]``) to
    compile those alone. ``progress(done, total, function)`` is called after each
    signature (function "" for those found cached or unreadable). Safe to repeat: signatures the cache
    already holds (`cached_flags`, checked in this process before any worker starts) are
    counted ``cached`` and not compiled again.

    Returns a `WarmResult`. Raises OSError (one line) when the cache directory cannot be
    created or written, ValueError when ``only`` matches no function or ``processes`` < 1.
    Unreadable lines and stale signatures are ``skipped`` with their reasons; a worker
    that dies is reported in ``failed``, not raised."""
    if processes is not None and processes < 1:
        raise ValueError(f"processes must be at least 1, got {processes}")
    entries, bad = read_file(path)
    entries = select(entries, only)
    result = WarmResult(total=len(entries) + len(bad), skipped=list(bad), cache_dir=kernel_cache_dir())
    check_writable(result.cache_dir)
    t0 = time.perf_counter()
    todo = [e for e, hit in zip(entries, cached_flags(entries, result.cache_dir)) if not hit]
    result.cached = len(entries) - len(todo)
    if progress is not None and result.cached + len(bad):
        progress(result.cached + len(bad), result.total, "")
    _run_workers(entries, todo, result, processes, progress)
    result.seconds = time.perf_counter() - t0
    return result


def _run_workers(entries: List[Entry], todo: List[Entry], result: WarmResult,
                 processes: Optional[int], progress) -> None:
    """Compile ``todo`` (some of ``entries``) in worker processes, whole functions each,
    into ``result``; a worker that exits with an error is one line in ``result.failed``."""
    n_fn = len({e.function for e in todo})
    groups = [g for g in split(todo, max(1, min(processes or _default_processes(), n_fn))) if g]
    index = {id(e): i for i, e in enumerate(entries)}
    with tempfile.TemporaryDirectory() as tmp:
        errs = [open(os.path.join(tmp, f"{i}.err"), "w") for i in range(len(groups))]
        procs = [_spawn([(index[id(e)], e) for e in g], err) for g, err in zip(groups, errs)]
        _collect(procs, entries, result, progress, done=result.total - len(todo))
        for i, (p, err) in enumerate(zip(procs, errs)):
            p.wait()
            err.close()
            if p.returncode != 0:
                why = _last_line(err.name) or "no message"
                result.failed.append(f"worker {i + 1} of {len(procs)} exited with status "
                                     f"{p.returncode}: {why}")


def cached_flags(entries: Sequence[Entry], directory: Optional[str] = None) -> List[bool]:
    """For each entry, whether the numba cache holds it (`_in_cache`; this process imports
    the kernel modules: ~2 s after torch). ``directory``: count only kernels this process
    caches under it (a kernel module imported before ``OPENCANN_CACHE_DIR`` changed keeps
    its old directory). A function that cannot be imported or a signature not understood
    is not cached."""
    index: Dict[str, dict] = {}
    root = os.path.join(os.path.abspath(directory), "") if directory else ""
    out = []
    for e in entries:
        try:
            disp = _dispatcher(e.function)
            if root and not os.path.join(os.path.abspath(disp._cache._cache_path), "").startswith(root):
                out.append(False)
                continue
            if e.function not in index:
                index[e.function] = disp._cache._cache_file._load_index()
            out.append(_in_cache(disp, _types(e.signature), index[e.function]))
        except Exception:  # noqa: BLE001 - stale, or not cached on disk: not cached
            out.append(False)
    return out


def cache_status(only: Optional[Sequence[str]] = None, path: Optional[str] = None) -> CacheStatus:
    """How many signatures of ``path`` (default: the shipped file; ``only`` as in `warm`)
    the numba cache holds for this CPU and these kernel sources (`cached_flags`: numba's
    index files, nothing compiled or loaded). Raises ValueError when ``only`` matches no
    function."""
    entries = select(read(path), only)
    return CacheStatus(sum(cached_flags(entries)), len(entries), kernel_cache_dir())


def record(path: str) -> None:
    """Append every opencann numba signature this process compiles to ``path`` at exit
    (``tests/conftest.py`` installs it when ``OPENCANN_NUMBA_RECORD`` is set)."""
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


def merge(recorded: str, path: Optional[str] = None, keep: bool = True) -> int:
    """Rewrite ``path`` (default: the shipped file, in a source checkout) from the
    recording ``recorded`` (each signature once, its largest seconds; only module-level
    functions that still exist and signatures `_types` can name: a callee typed inside a
    caller with literal arguments is compiled with its caller), keeping ``path``'s own
    entries unless not ``keep`` (a recording of the whole suite replaces them); returns the
    number of entries. Raises OSError when a file cannot be read or written."""
    path = path or signatures_path()
    best: Dict[Tuple[str, str], float] = {}
    old = read(path) if keep else []
    for seconds, name, sig in old + read(recorded):
        try:
            _types(sig)
            _dispatcher(name).compile   # a function since removed is dropped
        except Exception:  # noqa: BLE001 - dropped, as the docstring says
            continue
        best[(name, sig)] = max(seconds, best.get((name, sig), 0.0))
    with open(path, "w") as f:
        for (name, sig), seconds in sorted(best.items()):
            f.write(f"{seconds:.2f}\t{name}\t{sig}\n")
    return len(best)


def _worker() -> None:
    """A `warm` worker: compile each ``index<TAB>entry`` line of stdin, print one result
    line per entry (`_MARK`, index, status, reason), flushed as it finishes."""
    todo = [line.rstrip("\n").split("\t", 1) for line in sys.stdin if line.strip()]
    for index, rest in todo:
        _, function, signature = rest.split("\t", 2)
        status, reason = compile_one(function, signature)
        print(f"{_MARK}\t{index}\t{status}\t{reason}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--part"]:
        _worker()
    else:
        print(f"usage: python -m {__spec__.name if __spec__ else 'opencann.tools.numba_warm'} --part "
              "(a worker of opencann.tools.numba_warm.warm; run `opencann warm`)", file=sys.stderr)
        sys.exit(2)
