"""What torch.compile asked of the opencann backend, per code object: every compile, why
dynamo recompiled (its guard failure reason) with the user's source line owning the
failed guard, and every graph the backend ran eagerly instead of compiling.

Sources (torch 2.13): the code object being compiled is the first of
``torch._guards.TracingContext.get_traced_code()`` and the compile id
``CompileContext.current_compile_id()`` (``"frame/compile"``: a new second number is a
recompile, the same one again is the next graph after a graph break). Dynamo appends
the reason each cached entry's guards failed to ``torch._dynamo.utils.guard_failures``
(code object -> list, ``config.report_guard_failures``, on by default) before it calls
the backend for the recompile; the same text its ``recompiles`` log artifact prints
(``torch._logging.set_logs(recompiles=True)``). A symbolic-shape guard's text names the
user's line (``# file.py:10 in forward``), the file as a shortened path resolved here
against the traced code; a tensor-match guard (``tensor 'x' size mismatch at index 0``)
belongs to the compiled function's argument, so its source is the function's ``def``.
`recompiles` and `eager_fallbacks` are the public accessors (``opencann.dynamo``).
"""
from __future__ import annotations

import linecache
import re
import threading
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from ..log import logger

_SOURCE = re.compile(r"# ([^\s#()]+\.py):(\d+) in ([\w<>]+)(?: \((user code shown is first use)?)?")
_TORCH_DIR = torch.__file__.rsplit("/", 1)[0]


@dataclass
class Compile:
    """One compile dynamo asked for: ``compile_id`` ("0/1"), ``number`` (1 = the first
    compile of this code), ``reason`` (dynamo's guard failure text, None for the first),
    ``source`` ("file:line: code" owning the failed guard), ``sources`` (every user line
    the reason names), ``graphs`` (graphs handed over: one more per graph break),
    ``dynamic`` (a graph had symbolic shapes), ``training``, ``eager`` (graphs run
    eagerly, each with its reason) and ``reports`` (compile reports of the graphs)."""
    compile_id: str
    number: int
    reason: Optional[str] = None
    source: Optional[str] = None
    sources: List[str] = field(default_factory=list)
    graphs: int = 0
    dynamic: bool = False
    training: bool = False
    eager: List[str] = field(default_factory=list)
    reports: List[Any] = field(default_factory=list)

    def summary(self) -> Dict[str, Any]:
        """Plain data (reports left out)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("reports", "_ctx")}


@dataclass
class CodeRecord:
    """The compiles of one code object (a model's ``forward`` or a function)."""
    code: types.CodeType
    compiles: List[Compile] = field(default_factory=list)

    @property
    def where(self) -> str:
        """``forward (file.py:12)``."""
        return f"{self.code.co_name} ({self.code.co_filename}:{self.code.co_firstlineno})"

    @property
    def recompiles(self) -> List[Compile]:
        """The compiles after the first (each with its reason)."""
        return [c for c in self.compiles if c.number > 1]


RECORDS: Dict[types.CodeType, CodeRecord] = {}
EAGER_FALLBACKS: List[Dict[str, Any]] = []   # every graph the backend ran eagerly
_lock = threading.Lock()


_DYNAMO_DIR = _TORCH_DIR + "/_dynamo/"
_SEEN: Dict[types.CodeType, int] = {}   # frame code -> guard failures already read


def _current() -> tuple:
    """(frame code, owner code, compile id string, the compile's context) of the compile in
    progress; (None, None, "?", None) outside dynamo (a backend called by hand). The owner
    is the frame's code, or for a module dynamo enters through one of its own wrappers
    (``external_utils.inner``: ``nn.Sequential`` and modules with hooks) the outermost
    code it inlined (recorded last), the module's ``forward``."""
    from torch._guards import CompileContext, TracingContext
    codes = (TracingContext.get_traced_code() or []) if TracingContext.try_get() else []
    cid = CompileContext.current_compile_id()
    frame = codes[0] if codes else None
    owner = frame
    if frame is not None and frame.co_filename.startswith(_DYNAMO_DIR):
        owner = next((c for c in reversed(codes) if not c.co_filename.startswith(_DYNAMO_DIR)),
                     frame)
    return frame, owner, (str(cid) if cid is not None else "?"), CompileContext.try_get()


def _resolve(short: str, files: List[str]) -> str:
    """A shortened path from a guard's text (``mp/model.py``) as the traced file it ends."""
    return next((f for f in files if f.endswith(short.lstrip("."))), short)


def guard_sources(reason: str, code: Optional[types.CodeType]) -> List[Dict[str, Any]]:
    """The user lines a guard failure ``reason`` names: [{"file", "line", "fn", "text",
    "first_use"}]; ``first_use``: dynamo says the line only first used the value (the
    guard comes from its 0/1 specialisation). A tensor-match failure (no line named)
    gives the compiled function's ``def`` line. Framework lines are left out."""
    from torch._guards import TracingContext
    files = [c.co_filename for c in (TracingContext.get_traced_code() or [])] if \
        TracingContext.try_get() else []
    if code is not None:
        files.insert(0, code.co_filename)
    out = []
    for m in _SOURCE.finditer(reason):
        path = _resolve(m.group(1), files)
        if path.startswith(_TORCH_DIR):
            continue
        line = int(m.group(2))
        out.append({"file": path, "line": line, "fn": m.group(3), "first_use": bool(m.group(4)),
                    "text": linecache.getline(path, line).strip()})
    if not out and code is not None:
        line = code.co_firstlineno
        while linecache.getline(code.co_filename, line).lstrip().startswith("@"):
            line += 1                                   # past decorators, to the def
        out.append({"file": code.co_filename, "line": line, "fn": code.co_name,
                    "first_use": False, "text": linecache.getline(code.co_filename, line).strip()})
    return out


def _fmt(s: Dict[str, Any]) -> str:
    return f"{s['file']}:{s['line']} in {s['fn']}" + (f": {s['text']}" if s["text"] else "")


def note_compile(dynamic: bool, training: bool) -> Compile:
    """Record one graph handed to the backend; returns its `Compile` (a new one for a new
    compile id, the same one for the next graph of a graph break). Logs a recompile at
    INFO with its reason and source line."""
    frame, code, cid, ctx = _current()
    with _lock:
        rec = RECORDS.setdefault(code, CodeRecord(code)) if code is not None else CodeRecord(None)
        last = rec.compiles[-1] if rec.compiles else None
        if last is not None and ctx is not None and last._ctx() is ctx:   # a graph break
            c = last
        else:
            c = Compile(cid, len(rec.compiles) + 1)
            c._ctx = weakref.ref(ctx) if ctx is not None else (lambda: None)
            rec.compiles.append(c)
            _read_reason(frame, rec.code, c)
        c.graphs += 1
        c.dynamic |= dynamic
        c.training |= training
    if c.reason is not None and c.graphs == 1:
        logger.info("torch.compile recompiled %s (compile %d, %s): %s; guard at %s",
                    rec.where, c.number, cid, c.reason, c.source or "an unknown line")
    return c


def _read_reason(frame: Optional[types.CodeType], code: Optional[types.CodeType],
                 c: Compile) -> None:
    """Take the guard failures dynamo added for ``frame`` since its last compile."""
    if frame is None:
        return
    from torch._dynamo.utils import guard_failures
    fails = guard_failures.get(frame, [])
    seen = _SEEN.get(frame, 0)
    if len(fails) < seen:   # torch._dynamo.reset() cleared them
        seen = 0
    new, _SEEN[frame] = fails[seen:], len(fails)
    if not new:
        return
    c.reason = new[0].split("\nUser stack trace:")[0]
    found = guard_sources(new[0], code)
    c.sources = [_fmt(s) for s in found]
    owner = next((s for s in found if not s["first_use"]), found[0] if found else None)
    c.source = _fmt(owner) if owner else None


def compile_in_progress() -> Optional[Compile]:
    """The `Compile` recorded for the dynamo compile in progress (`note_compile`), None
    outside one or when it was not recorded."""
    _, code, _, ctx = _current()
    with _lock:
        rec = RECORDS.get(code) if code is not None else None
        last = rec.compiles[-1] if rec is not None and rec.compiles else None
    return last if last is not None and ctx is not None and last._ctx() is ctx else None


def note_eager(c: Optional[Compile], graph: str, reason: str) -> None:
    """Count one graph run eagerly (``reason``: why it is not compiled)."""
    with _lock:
        EAGER_FALLBACKS.append({"graph": graph, "compile_id": c.compile_id if c else "?",
                                "reason": reason})
        if c is not None:
            c.eager.append(reason)


def _code_of(model_or_fn: Any) -> types.CodeType:
    f = getattr(model_or_fn, "_orig_mod", model_or_fn)     # torch.compile's wrapper
    f = getattr(f, "_torchdynamo_orig_callable", f)
    if isinstance(f, torch.nn.Module):
        f = type(f).forward
    f = getattr(f, "__func__", f)
    code = getattr(f, "__code__", None)
    if code is None:
        raise TypeError(f"recompiles() takes a module, a function or what torch.compile "
                        f"returned for one, got {type(model_or_fn).__name__}")
    return code


def recompiles(model_or_fn: Any) -> Dict[str, Any]:
    """What torch.compile with ``backend="opencann"`` compiled for ``model_or_fn`` (an
    ``nn.Module`` - its class's ``forward`` -, a function, or what ``torch.compile``
    returned for either): ``{"code": "forward (file:line)", "compiles": n,
    "recompiles": [{"compile_id", "number", "reason", "source", "sources", "graphs",
    "dynamic", "training", "eager"}...], "eager_fallbacks": n}``, the first compile
    included in ``compiles`` and left out of ``recompiles``. Counts every compile since
    the process started (a ``torch._dynamo.reset()`` does not clear them); graphs after a
    graph break run in dynamo's resume functions, counted under their own code.
    Raises TypeError for anything without a code object."""
    code = _code_of(model_or_fn)
    with _lock:
        rec = RECORDS.get(code)
        compiles = list(rec.compiles) if rec else []
    where = f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})"
    return {"code": where, "compiles": len(compiles),
            "recompiles": [c.summary() for c in compiles if c.number > 1],
            "eager_fallbacks": sum(len(c.eager) for c in compiles)}


def eager_fallbacks() -> List[Dict[str, Any]]:
    """Every graph the opencann torch.compile backend ran eagerly in this process
    (``{"graph", "compile_id", "reason"}``), oldest first: a test asserting
    ``eager_fallbacks() == []`` proves everything was compiled."""
    with _lock:
        return list(EAGER_FALLBACKS)


def stamp(c: Compile, reports: List[Any]) -> None:
    """Put ``c`` on the compile reports of its graphs (``report.torch_compile``, a note)."""
    rec = next((r for r in RECORDS.values() if c in r.compiles), None)
    info = {"code": rec.where if rec else "?", "compile": c.number, "compile_id": c.compile_id,
            "reason": c.reason, "source": c.source, "sources": c.sources}
    for r in reports:
        r.torch_compile = {**r.torch_compile, **info}
        c.reports.append(r)


def note_refreeze(c: Optional[Compile], reason: str, reports: List[Any]) -> None:
    """Count one re-freeze of a graph compiled under ``c`` (a frozen weight changed:
    `opencann.dynamo.freezing`) as a compile of the same code, with ``reason``; logged at
    INFO and stamped on the new ``reports``."""
    with _lock:
        rec = next((r for r in RECORDS.values() if c is not None and c in r.compiles), None)
        n = Compile(f"{c.compile_id if c else '?'} refreeze",
                    len(rec.compiles) + 1 if rec else (c.number + 1 if c else 1), reason=reason,
                    graphs=1, dynamic=bool(c and c.dynamic))
        n._ctx = lambda: None
        if rec is not None:
            rec.compiles.append(n)
    logger.info("torch.compile graph of %s re-frozen (compile %d): %s",
                rec.where if rec else "?", n.number, reason)
    stamp(n, reports)
