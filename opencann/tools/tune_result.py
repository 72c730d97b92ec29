"""What `opencann.tune` searches over and returns: `Candidate` (a precision and how to
apply it to nodes), `CANDIDATES` (fp32, bf16, fp16, int8), `NodeChoice` (one candidate
node's verdicts, times and choice) and `TuneResult` (the choice, its report and CANN's
``--keep_dtype`` / ``--modify_mixlist`` exports). The search itself: `opencann.tools.tune`
(module docstring) and `opencann.tools.tune_search`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree

from . import tune_int8
from .tune_gate import Verdict


def _cast_emulate(dtype: torch.dtype):
    """An `Candidate.emulate` that runs ``target`` on its float tensor arguments cast to
    ``dtype`` (what the engine's Cast nodes do) and returns (result as fp32, the same op
    in fp32 on the rounded inputs)."""
    def run(target, args, kwargs):
        def low(x):
            return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        def up(x):
            return low(x).float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        a, k = pytree.tree_map(low, (args, kwargs))
        out = target(*a, **k)
        a, k = pytree.tree_map(up, (args, kwargs))
        same = target(*a, **k)
        first = (lambda r: r[0] if isinstance(r, (tuple, list)) else r)
        return first(out).float(), first(same).float()
    return run


@dataclass(frozen=True)
class Candidate:
    """A precision the search may give a node: ``name`` (what `TuneResult.precision`
    and the options say), ``dtype`` (the gate's error-ratio bounds), ``apply(options,
    nodes) -> options`` (compile options that run ``nodes`` in it; default:
    ``node_precision``), ``emulate(target, args, kwargs) -> (result, same-input fp32
    result)`` (one op on eager's inputs, for its own error; None: judged only through the
    outputs) and ``applies(fx_node, exported_program) -> str`` (why the candidate cannot
    run a node, "" when it can; None: it runs every candidate node)."""

    name: str
    dtype: torch.dtype
    apply: Optional[Callable[[Dict[str, Any], Sequence[str]], Dict[str, Any]]] = None
    emulate: Optional[Callable] = None
    applies: Optional[Callable] = None

    def options(self, options: Dict[str, Any], nodes: Sequence[str]) -> Dict[str, Any]:
        """``options`` with ``nodes`` run in this precision (a new dict)."""
        if self.apply is not None:
            return self.apply(dict(options), list(nodes))
        out = dict(options)
        out["node_precision"] = {**(out.get("node_precision") or {}), **{n: self.name for n in nodes}}
        return out


CANDIDATES: Dict[str, Candidate] = {
    "fp32": Candidate("fp32", torch.float32),
    "bf16": Candidate("bf16", torch.bfloat16, emulate=_cast_emulate(torch.bfloat16)),
    "fp16": Candidate("fp16", torch.float16, emulate=_cast_emulate(torch.float16)),
    "int8": Candidate("int8", torch.int8, emulate=tune_int8.emulate, applies=tune_int8.applies),
}


@dataclass
class NodeChoice:
    """One candidate node: its ``name``, ``op`` (IR op type), ``module`` and ``source``,
    the chosen ``precision``, ``own`` (candidate name -> the gate's `Verdict` on its own
    error), ``seconds`` (candidate name -> its measured time incl. its casts, s; a candidate
    in which nothing was measured for it is absent) and, when kept higher than the lowest
    candidate, ``why`` (the gate or step that kept it; the timing step also names there a
    precision it had no time for)."""

    name: str
    op: str
    module: str = ""
    source: str = ""
    reads: str = ""   # the FX node of its activation input: siblings reading one x merge (QKV)
    precision: str = "fp32"
    own: Dict[str, Verdict] = field(default_factory=dict)
    seconds: Dict[str, float] = field(default_factory=dict)
    why: str = ""


@dataclass
class TuneResult:
    """What `tune` chose: ``nodes`` (name -> `NodeChoice`), ``outputs`` (per output: the
    metrics against eager on each data item), ``fp32_ms`` / ``tuned_ms`` (the all-fp32 and
    the tuned compiled models' least call time in one interleaved race, both called alike,
    ms), ``compiled`` (the `CompiledModel` with the choice applied), ``candidates``,
    ``budget`` ("msprobe" or the metric's name), ``seconds`` (search time)."""

    nodes: Dict[str, NodeChoice]
    candidates: Tuple[str, ...]
    budget: str
    outputs: List[Dict[str, Any]] = field(default_factory=list)
    fp32_ms: float = 0.0
    tuned_ms: float = 0.0
    seconds: float = 0.0
    options: Dict[str, Any] = field(default_factory=dict)
    compiled: Any = None

    @property
    def precision(self) -> Dict[str, str]:
        """Node name -> chosen candidate name."""
        return {n: c.precision for n, c in self.nodes.items()}

    @property
    def kept(self) -> Dict[str, str]:
        """Node name -> why it runs above the lowest candidate (the failed gate, timing
        or the output check), for the nodes that do, and where the timing step had no
        time for a node in some precision, that note."""
        return {n: c.why for n, c in self.nodes.items() if c.why}

    @property
    def speedup(self) -> float:
        """All-fp32 compiled call time / tuned call time (``fp32_ms / tuned_ms``)."""
        return self.fp32_ms / self.tuned_ms if self.tuned_ms > 0 else 0.0

    def keep_dtype(self) -> List[str]:
        """The nodes run in fp32 (CANN ``--keep_dtype`` file lines), in graph order."""
        return [n for n, c in self.nodes.items() if c.precision == "fp32"]

    def mixlist(self) -> Tuple[List[str], List[str]]:
        """(op types whose every candidate node computes in fp32, op types whose every one
        is lowered): the per-op-type approximation of the choice that CANN's
        ``--modify_mixlist`` black and white lists can say. An int8 node computes in fp32
        here unless the search gave it bf16 inputs and outputs (``node_precision``): a
        convolution quantized from fp32 stays out of a bf16 graph's lowering that way, and
        ``quant_config`` makes it int8 again."""
        low_io = self.options.get("node_precision") or {}
        by_op: Dict[str, set] = {}
        for c in self.nodes.values():
            by_op.setdefault(c.op, set()).add(c.precision == "fp32" or (
                c.precision == "int8" and low_io.get(c.name) is None))
        keep = sorted(op for op, s in by_op.items() if s == {True})
        lower = sorted(op for op, s in by_op.items() if s == {False})
        return keep, lower

    def quant_config(self) -> Dict[str, Any]:
        """The int8 choices as the compile option ``quant_config``: the layers of the nodes
        given int8 with their calibration records (``scale_d`` / ``offset_d``); no layer
        when the search gave none int8. Only the records of layers the tuned graph has (the
        search's option also holds those of the all-fp32 compile, e.g. a Q/K/V GEMM that a
        mixed choice kept apart, and skips the name check for them): the names are checked
        again where it is compiled, so a file given to another model or device (the vnpu's
        unfused layers) is one error line there, not a graph left in fp32."""
        cfg = self.options.get("quant_config")
        if not cfg:
            return {"layers": {}, "skip_layers": [], "dynamic_linear": False}
        out = {k: v for k, v in cfg.items() if k != "check_names"}
        if self.compiled is not None:
            from ..engine.quantize import quant_report
            seen = {r["layer"] for r in quant_report(self.compiled)}
            out["layers"] = {k: r for k, r in (cfg.get("layers") or {}).items() if k in seen}
        return out

    def export(self, keep_dtype: Optional[str] = None, modify_mixlist: Optional[str] = None,
               quant_config: Optional[str] = None) -> None:
        """Write CANN's ``--keep_dtype`` file (`keep_dtype`, one node name per line), its
        ``--modify_mixlist`` JSON (`mixlist`) and / or the int8 layers' records
        (`quant_config`, JSON: `precision_files.write_quant_config`); ``opencann atc
        --keep_dtype F --modify_mixlist M --quant_config Q --precision_mode
        allow_mix_precision_bf16`` reads them back. The keep_dtype and mixlist files cannot
        say int8 (they place an int8 node by the dtype it computes in: `mixlist`); the
        quant_config file names its layer. OSError when a path cannot be written."""
        from .precision_files import write_keep_dtype, write_mixlist, write_quant_config
        if keep_dtype:
            write_keep_dtype(keep_dtype, self.keep_dtype())
        if modify_mixlist:
            write_mixlist(modify_mixlist, *self.mixlist())
        if quant_config:
            write_quant_config(quant_config, self.quant_config())

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able summary (what the model file's report keeps under ``precision``)."""
        return {"candidates": list(self.candidates), "budget": self.budget,
                "speedup": round(self.speedup, 4), "fp32_ms": round(self.fp32_ms, 4),
                "tuned_ms": round(self.tuned_ms, 4), "search_seconds": round(self.seconds, 2),
                "options": self.options, "outputs": self.outputs,
                "nodes": {n: {"op": c.op, "module": c.module, "source": c.source,
                              "precision": c.precision, "why": c.why,
                              "seconds": {k: round(v, 9) for k, v in c.seconds.items()},
                              "own": {k: {"passed": v.passed, "rule": v.rule, "detail": v.detail,
                                          "cosine": v.cosine, "max_abs": v.max_abs}
                                      for k, v in c.own.items()}}
                          for n, c in self.nodes.items()}}

    def summary(self) -> str:
        """A few lines: speed-up, counts per precision, the kept nodes and why."""
        counts: Dict[str, int] = {}
        for c in self.nodes.values():
            counts[c.precision] = counts.get(c.precision, 0) + 1
        lines = [f"tuned ({self.budget} gate, candidates {', '.join(self.candidates)}): "
                 f"{', '.join(f'{v} {k}' for k, v in counts.items()) or 'no candidate nodes'}; "
                 f"{self.speedup:.2f}x over fp32 ({self.fp32_ms:.3g} -> {self.tuned_ms:.3g} ms)"]
        lines += [f"  kept {n} ({self.nodes[n].op}) in {self.nodes[n].precision}: {w}"
                  for n, w in self.kept.items()]
        return "\n".join(lines)


__all__ = ["CANDIDATES", "Candidate", "NodeChoice", "TuneResult"]
