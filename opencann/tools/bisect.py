"""Automatic bisection of an accuracy divergence (``opencann compare --bisect``): when a
compiled model's outputs differ from eager beyond tolerance, find the pass responsible,
then the rewrite sites, then (for a precision mode) the ops whose lowering causes it.

Both searches are delta debugging: Zeller & Hildebrandt, "Simplifying and Isolating
Failure-Inducing Input", IEEE TSE 28(2), 2002, algorithm ddmin (`ddmin`), whose test
here is "with these switched off, the outputs are accurate again".

1. Passes: ddmin over the passes that ran, switched off through ``options["disable"]``,
   finds a smallest set whose disabling restores accuracy (one pass, usually, in about
   2·log2(passes) compiles).
2. Sites: when the guilty pass switches its rewrites one by one (every rewrite rule,
   ``Pass.site_switchable``), ddmin over its rewrite ids (``"<pass>@<root node>"``, the
   compile report's ``applied[i]["id"]``), switched off through
   ``options["disable_rewrites"]``, finds the 1-minimal set of sites whose disabling
   restores accuracy: the rewrites, their root nodes and source lines. For a pass that
   switches only whole, the first diverging layer (`compare`) is matched to its rewrites
   in the report instead.
3. Precision: when the guilty pass is ``precision``, ddmin over the op types it lowered,
   kept in fp32 through ``options["keep_fp32"]``, finds the ops whose lowering does it.

"Accurate" means every output's status (`compare.THRESHOLDS`, by the output's own dtype)
is better than ``on`` ("fail": fail only; "warn": warn or fail).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..runtime import ExecutionError
from .compare import CompareResult, LayerResult, Session

_NOT_PASSES = ("construct", "memory", "runtime")
# what a trial of each option does, as progress shows it
_SAY = {"disable": "disabling", "disable_rewrites": "disabling sites",
        "keep_fp32": "keeping in fp32"}


@dataclass
class BisectResult:
    """``diverged``: the outputs differ with the given options; ``passes``: the smallest
    set of passes whose disabling restores accuracy ([] when none is to blame);
    ``sites``: the 1-minimal set of the guilty pass's rewrites whose disabling restores
    accuracy (report entries: pass, detail, nodes, where, id), [] when the pass switches
    only whole; ``site``: the one guilty rewrite (the one site, or the rewrite matched to
    the first diverging layer) or None; ``layer``: the first diverging layer;
    ``keep_fp32``: op types whose lowering causes a precision-mode divergence;
    ``compiles``: compiles spent, ``steps``: per step (baseline, passes, sites,
    keep_fp32); ``message``: one line."""

    diverged: bool
    passes: List[str] = field(default_factory=list)
    site: Optional[Dict[str, str]] = None
    sites: List[Dict[str, str]] = field(default_factory=list)
    layer: Optional[LayerResult] = None
    keep_fp32: List[str] = field(default_factory=list)
    compiles: int = 0
    steps: Dict[str, int] = field(default_factory=dict)
    message: str = ""
    baseline: Optional[CompareResult] = None
    unresolved: List[str] = field(default_factory=list)

    def cost(self) -> str:
        """"N compiles (1 baseline, a passes, b sites)": the compiles per step."""
        parts = ", ".join(f"{n} {k}" for k, n in self.steps.items() if n)
        return f"{self.compiles} compiles" + (f" ({parts})" if parts else "")


def ddmin(items: Sequence[str], restores: Callable[[List[str]], bool]) -> List[str]:
    """A 1-minimal subset of ``items`` for which ``restores(subset)`` holds, given that
    it holds for all of ``items`` (Zeller & Hildebrandt 2002, delta debugging)."""
    seen: Dict[tuple, bool] = {}

    def test(subset: List[str]) -> bool:
        key = tuple(subset)
        if key not in seen:
            seen[key] = restores(subset)
        return seen[key]

    cur, n = list(items), 2
    while len(cur) >= 2:
        size = -(-len(cur) // n)
        chunks = [cur[i:i + size] for i in range(0, len(cur), size)]
        for c in chunks:
            if test(c):
                cur, n = c, 2
                break
        else:
            for c in chunks:
                rest = [x for x in cur if x not in c]
                if len(chunks) > 2 and test(rest):
                    cur, n = rest, max(n - 1, 2)
                    break
            else:
                if n >= len(cur):
                    break
                n = min(len(cur), 2 * n)
    return cur


def bisect(model: torch.nn.Module, example_inputs, device: str = "cpu",
           options: Optional[Dict[str, Any]] = None, on: str = "fail", example_kwargs=None,
           progress: Optional[Callable[[str], None]] = None,
           session: Optional[Session] = None) -> BisectResult:
    """Find what makes ``model`` compiled for ``device`` with ``options`` diverge from
    eager on ``example_inputs`` (see the module docstring). ``on``: "fail" or "warn",
    the output status that counts as divergence. Returns a `BisectResult`. Raises
    ValueError for another ``on``, CaptureError / ConversionError like
    ``opencann.compile``."""
    if on not in ("fail", "warn"):
        raise ValueError(f"on={on!r}: the status that counts as divergence is 'fail' or 'warn'")
    s = session or Session(model, example_inputs, example_kwargs)
    t = _Trial(s, device, dict(options or {}), on, progress or (lambda _m: None))
    base = s.run(device, t.opts, strict=True)
    res = BisectResult(diverged=t.bad(base), baseline=base, layer=_first(base, on))
    t.step("baseline", 1)
    if res.diverged:
        _blame(t, base, res)
    res.compiles, res.steps, res.unresolved = t.count, dict(t.steps), t.unresolved
    res.message = _message(res)
    return res


class _Trial:
    """Compiles with ``opts`` plus what a step switches off; counts compiles per step."""

    def __init__(self, s: Session, device: str, opts: Dict[str, Any], on: str, say):
        self.s, self.device, self.opts, self.on, self.say = s, device, opts, on, say
        self.count, self.steps, self.unresolved = 0, {}, []

    def bad(self, r: CompareResult) -> bool:
        return any(o.status == "fail" or (self.on == "warn" and o.status == "warn")
                   for o in r.outputs)

    def step(self, name: str, n: int) -> None:
        self.count += n
        self.steps[name] = self.steps.get(name, 0) + n

    def restores(self, step: str, key: str, extra: List[str]) -> bool:
        """Whether compiling with ``extra`` added to option ``key`` restores accuracy."""
        self.say(f"  {_SAY[key]} {', '.join(extra)}")
        self.step(step, 1)
        opts = dict(self.opts, **{key: list(self.opts.get(key) or ()) + list(extra)})
        try:
            return not self.bad(self.s.run(self.device, opts, layers=False, strict=True))
        except ExecutionError as e:   # ddmin's "unresolved" outcome: not a restoring set
            self.unresolved.append(f"{key}={list(extra)}: {str(e).splitlines()[0]}")
            self.say(f"    unresolved (the compiled model fails to run): {e}")
            return False

    def search(self, step: str, key: str, items: List[str]) -> List[str]:
        """ddmin over ``items`` switched off through option ``key``; [] when switching
        them all off does not restore accuracy."""
        test = lambda sub: self.restores(step, key, sub)   # noqa: E731
        if not items or not test(items):
            return []
        return ddmin(items, test)


def _blame(t: _Trial, base: CompareResult, res: BisectResult) -> None:
    """Passes, then the guilty pass's sites (or its precision lowering), into ``res``."""
    ran = list(dict.fromkeys(p.name for p in base.report.passes
                             if p.enabled and p.stage not in _NOT_PASSES))
    res.passes = t.search("passes", "disable", ran)
    if ran and not res.passes:
        return      # diverges with every pass off: a kernel or the conversion
    guilty = res.passes[0] if len(res.passes) == 1 else None
    if guilty is None:
        return
    ids = list(dict.fromkeys(a["id"] for a in base.report.applied
                             if a.get("pass") == guilty and a.get("id")))
    if guilty in _site_switchable():
        chosen = t.search("sites", "disable_rewrites", ids)
        res.sites = [next(a for a in base.report.applied if a.get("id") == i) for i in chosen]
    if len(res.sites) == 1:
        res.site = res.sites[0]
    elif not res.sites and res.layer is not None:
        res.site = _site(base.report.applied, guilty, res.layer)
    if guilty == "precision":
        res.keep_fp32 = _narrow_precision(t, base)


def _site_switchable() -> set:
    """Names of the passes whose rewrites ``disable_rewrites`` switches one by one."""
    from ..engine import pipeline as compiler
    return {p.name for p in compiler.default_pipeline().passes if p.site_switchable}


def _first(r: CompareResult, on: str) -> Optional[LayerResult]:
    bad = ("fail",) if on == "fail" else ("fail", "warn")
    return next((x for x in r.layers if x.status in bad), None) or (
        r.layers[r.first_divergence] if r.first_divergence is not None else None)


def _site(applied: Sequence[Dict[str, str]], guilty: str, layer: LayerResult) -> Optional[Dict[str, str]]:
    """The guilty pass's rewrite that made the first diverging layer's node: its node
    list names it, or the fused node's name starts with one of them."""
    mine = [a for a in applied if a.get("pass") == guilty]
    for a in mine:
        names = a["nodes"].split("+")
        if layer.node in names or layer.fx_node in names or any(layer.node.startswith(n) for n in names):
            return a
    return mine[0] if len(mine) == 1 else None


def _narrow_precision(t: _Trial, base: CompareResult) -> List[str]:
    """Op types the precision pass lowered whose staying in fp32 restores accuracy (views
    only follow their input's dtype: not candidates). The precision pass runs before
    fusion, so a fused layer is tried as the op types it is formed from (``fused_from``:
    LinearAct as MatMulV2); a fused op without them (FusedElementwise) is no candidate."""
    from ..ops import OpKind, get_op
    lowered = sorted({p for x in base.layers if x.dtype in ("float16", "bfloat16")
                      and x.op not in ("Cast", "HostFallback") and not get_op(x.op).is_view
                      for p in (get_op(x.op).fused_from or
                                (() if get_op(x.op).kind == OpKind.FUSED else (x.op,)))})
    return t.search("keep_fp32", "keep_fp32", lowered)


def _at(layer: Optional[LayerResult]) -> str:
    if layer is None:
        return ""
    return f"; first diverging op: {layer.node} ({layer.op}) in {layer.module or 'the model'} ({layer.source or '?'})"


def _message(res: BisectResult) -> str:
    if not res.diverged:
        return "outputs agree with eager: nothing to bisect"
    if not res.passes:
        if res.baseline is not None and any(p.enabled and p.stage not in _NOT_PASSES
                                            for p in res.baseline.report.passes):
            return ("the outputs diverge with every pass disabled: not an optimization but "
                    "a kernel or conversion" + _at(res.layer))
        return "no pass to blame" + _at(res.layer)
    if len(res.passes) > 1:
        return (f"disabling passes {', '.join(res.passes)} together restores accuracy (each "
                "alone does not)" + _at(res.layer))
    guilty = res.passes[0]
    if res.sites:
        at = " and ".join(f"at {_root(a)} ({a['where'] or '?'})" for a in res.sites)
        ids = [a["id"] for a in res.sites]
        msg = (f"disabling {_rewrite(res.sites)} {at} "
               + ("together restores accuracy (no smaller set does)" if len(ids) > 1
                  else "restores accuracy") + f"; option disable_rewrites={ids}")
    elif res.site is not None:
        detail = f" ({res.site['detail']})" if res.site.get("detail") else ""
        msg = (f"disabling {guilty}{detail} at {res.site['nodes']} "
               f"({res.site['where'] or '?'}) restores accuracy")
    else:
        msg = f"disabling {guilty} restores accuracy" + _at(res.layer)
    if res.keep_fp32:
        msg += (f"; keeping {', '.join(res.keep_fp32)} in fp32 (options keep_fp32="
                f"{res.keep_fp32}) restores it too")
    if res.unresolved:
        msg += (f"; {len(res.unresolved)} trial(s) failed to run and counted as not "
                f"restoring (first: {res.unresolved[0]})")
    return msg


def _root(entry: Dict[str, str]) -> str:
    """The root node of a rewrite (its id's part after "@")."""
    return entry["id"].partition("@")[2] or entry["nodes"]


def _rewrite(entries: List[Dict[str, str]]) -> str:
    """The pass, with the variants of ``entries`` ("fuse_conv_act (Conv+Relu)")."""
    details = list(dict.fromkeys(a["detail"] for a in entries if a.get("detail")))
    return entries[0]["pass"] + (f" ({', '.join(details)})" if details else "")
