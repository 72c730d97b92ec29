"""Automatic bisection of an accuracy divergence (``opencann compare --bisect``): when a
compiled model's outputs differ from eager beyond tolerance, find the pass responsible,
then the rewrite site, then (for a precision mode) the ops whose lowering causes it.

1. Passes: delta debugging (Zeller's ddmin) over the passes that ran, switched off
   through ``options["disable"]``, finds a smallest set whose disabling restores
   accuracy (one pass, usually, in about 2·log2(passes) compiles).
2. Site: with every pass on, the first diverging layer (`compare`) is matched to the
   guilty pass's rewrites in the compile report (each rewrite: pass, pattern, nodes,
   source line), naming the rewrite, its node and source line.
3. Precision: when the guilty pass is ``precision``, ddmin over the op types it lowered,
   kept in fp32 through ``options["keep_fp32"]``, finds the ops whose lowering does it.

"Accurate" means every output's status (`compare.THRESHOLDS`, by the output's own dtype)
is better than ``on`` ("fail": fail only; "warn": warn or fail).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .compare import CompareResult, LayerResult, Session

_NOT_PASSES = ("construct", "memory", "runtime")


@dataclass
class BisectResult:
    """``diverged``: the outputs differ with the given options; ``passes``: the smallest
    set of passes whose disabling restores accuracy ([] when none is to blame);
    ``site``: the guilty rewrite (report entry: pass, pattern, nodes, where) or None;
    ``layer``: the first diverging layer; ``keep_fp32``: op types whose lowering causes a
    precision-mode divergence; ``compiles``: compiles spent; ``message``: one line."""

    diverged: bool
    passes: List[str] = field(default_factory=list)
    site: Optional[Dict[str, str]] = None
    layer: Optional[LayerResult] = None
    keep_fp32: List[str] = field(default_factory=list)
    compiles: int = 0
    message: str = ""
    baseline: Optional[CompareResult] = None


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
    say = progress or (lambda _m: None)
    s = session or Session(model, example_inputs, example_kwargs)
    base_opts = dict(options or {})
    count = [0]

    def diverges(opts: Dict[str, Any]) -> bool:
        count[0] += 1
        r = s.run(device, opts, layers=False, strict=True)
        return any(o.status == "fail" or (on == "warn" and o.status == "warn") for o in r.outputs)

    base = s.run(device, base_opts, strict=True)
    count[0] += 1
    res = BisectResult(diverged=any(o.status == "fail" or (on == "warn" and o.status == "warn")
                                    for o in base.outputs), baseline=base)
    strict_first = _first(base, on)
    res.layer = strict_first
    if not res.diverged:
        res.compiles, res.message = count[0], "outputs agree with eager: nothing to bisect"
        return res
    ran = list(dict.fromkeys(p.name for p in base.report.passes
                             if p.enabled and p.stage not in _NOT_PASSES))
    given = list(base_opts.get("disable") or ())

    def restores(off: List[str]) -> bool:
        say(f"  disabling {', '.join(off)}")
        return not diverges(dict(base_opts, disable=given + off))

    if ran and not restores(ran):
        res.compiles = count[0]
        res.message = ("the outputs diverge with every pass disabled: not an optimization but "
                       "a kernel or conversion" + _at(strict_first))
        return res
    res.passes = ddmin(ran, restores) if ran else []
    guilty = res.passes[0] if len(res.passes) == 1 else None
    if guilty is not None and strict_first is not None:
        res.site = _site(base.report.applied, guilty, strict_first)
    if guilty == "precision":
        res.keep_fp32 = _narrow_precision(base, base_opts, diverges, say)
    res.compiles = count[0]
    res.message = _message(res, guilty)
    return res


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


def _narrow_precision(base: CompareResult, opts: Dict[str, Any], diverges, say) -> List[str]:
    """Op types the precision pass lowered whose staying in fp32 restores accuracy."""
    lowered = sorted({x.op for x in base.layers if x.dtype in ("float16", "bfloat16")
                      and x.op not in ("Cast", "HostFallback")})
    keep = list(opts.get("keep_fp32") or ())

    def restores(ops: List[str]) -> bool:
        say(f"  keeping {', '.join(ops)} in fp32")
        return not diverges(dict(opts, keep_fp32=keep + ops))

    if not lowered or not restores(lowered):
        return []
    return ddmin(lowered, restores)


def _at(layer: Optional[LayerResult]) -> str:
    if layer is None:
        return ""
    return f"; first diverging op: {layer.node} ({layer.op}) in {layer.module or 'the model'} ({layer.source or '?'})"


def _message(res: BisectResult, guilty: Optional[str]) -> str:
    if not res.passes:
        return "no pass to blame" + _at(res.layer)
    if guilty is None:
        return (f"disabling passes {', '.join(res.passes)} together restores accuracy (each "
                "alone does not)" + _at(res.layer))
    if res.site is not None:
        detail = f" ({res.site['detail']})" if res.site.get("detail") else ""
        msg = (f"disabling {guilty}{detail} at {res.site['nodes']} "
               f"({res.site['where'] or '?'}) restores accuracy")
    else:
        msg = f"disabling {guilty} restores accuracy" + _at(res.layer)
    if res.keep_fp32:
        msg += (f"; keeping {', '.join(res.keep_fp32)} in fp32 (options keep_fp32="
                f"{res.keep_fp32}) restores it too")
    return msg
