"""The names a ``quant_config`` gives, checked against the graph an int8 pass rewrites
(`QuantizeInt8` on the CPU, `VnpuQuantizeInt8` on the vnpu): a record or a
``skip_layers`` name that matches nothing would leave its layer as it was (fp32, or int8
where it was meant to stay float) without a word, so each is one ValueError line naming
the unknown names, why, near matches (``difflib``) and the names this graph has.

- ``layers``: a key must be the name of a node the pass takes (its ``ops``: the fused
  ConvBiasAct / ConvAddAct / LinearAct on the CPU, Conv2D / MatMulV2 / MatMul on the
  vnpu), as `quant_report` and the compile report show it and `opencann.quantize` writes
  it. A node of another op (a ReLU, a convolution left unfused) is refused with why it is
  not quantized; a module name or a pre-fusion traced name (``addmm``) is refused with the
  node that carries it. A record for a node the pass takes but keeps in float (in
  ``skip_layers``, ``keep_dtype``, a bf16 convolution, NaN weights) is accepted: its
  `quant_report` row says why (`opencann.quantize` records every calibrated layer).
- ``skip_layers``: a name must be a `layer_labels` entry of some node (its name, its
  module, AMCT's layer name, or a traced label).

A config must name this graph's nodes: one made for another graph (another model) is
refused rather than half applied. ``quant_config["check_names"] = False`` turns the check
off, for a config made for a whole model applied to a part of it whose names it cannot
know: `opencann.tune`'s int8 candidate (records of the all-fp32 compile, where sibling
linears may merge into one QKV GEMM that a mixed-precision choice keeps apart; the layers
left out are its report's "no calibration record"), a ``torch.compile`` piece after a
graph break."""
from __future__ import annotations

import difflib
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from ...ir import Graph, Node, traced_names


def layer_labels(node: Node) -> set:
    """The names ``skip_layers`` may give for ``node``: its own, its module's (``scope``,
    AMCT's layer name, e.g. ``layer1.0.conv2``), its traced labels, and those of the nodes
    merged into it (``meta["part_labels"]``: a Q/K/V GEMM is k_proj's and v_proj's layer
    too, `FuseQKVLinear`)."""
    own = {node.name} | ({node.scope} if node.scope else set()) | set(node.meta.get("part_labels") or ())
    return own | {lab.partition(".")[0] for lab in (node.meta.get("origin") or ()) if lab}


def check_layer_names(graph: Graph, cfg: Dict[str, Any], ops: Sequence[str],
                      why_not: Callable[[Node], Optional[str]] = lambda node: None) -> None:
    """Raise ValueError (one line) when ``cfg`` (a ``quant_config``) names what the int8
    pass about to rewrite ``graph`` cannot take (module docstring): a ``layers`` key that is
    no node of op ``ops`` (``why_not(node)``: why a node of another op stays float, None
    for the generic reason), or a ``skip_layers`` name that labels no node. Call it before
    the rewrite (the node names are then the ones calibration recorded). Nothing is
    checked when ``cfg["check_names"]`` is False."""
    if cfg.get("check_names") is False:
        return
    targets = [n for n in graph.nodes if n.op in ops]
    carriers = _carriers(targets)
    layers = cfg.get("layers") or {}
    names = {n.name for n in targets}
    unknown = [k for k in layers if k not in names]
    if unknown:
        nodes = {n.name: n for n in graph.nodes}
        kinds = " / ".join(ops)
        parts = [_why_record(k, nodes.get(k), carriers, names, kinds, why_not) for k in unknown[:3]]
        more = f"; and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise ValueError(f"option 'quant_config': 'layers' names no {kinds} node of this graph: "
                         f"{'; '.join(parts)}{more}. Fix: key each record by the node's name as quant_report "
                         f"shows it (opencann.quantize writes them): {_some(names, 'this graph has none')}")
    labels = set().union(*(layer_labels(n) for n in graph.nodes))
    skip = [s for s in (cfg.get("skip_layers") or ()) if s not in labels]
    if skip:
        choices = names | {n.scope for n in targets if n.scope}
        near = sorted({c for s in skip for c in difflib.get_close_matches(s, sorted(choices), n=3, cutoff=0.5)})
        fused = [f"{s!r} was fused into {carriers[s][0]!r}" for s in skip if s in carriers and s not in labels]
        raise ValueError(f"quant_config's skip_layers names no layer of the model: {', '.join(map(repr, skip[:4]))}"
                         f"{' ...' if len(skip) > 4 else ''}; give a convolution / linear module's name "
                         f"(AMCT's layer name) or a node name from quant_report; "
                         + (f"{'; '.join(fused[:2])}; " if fused else "")
                         + (f"near matches: {', '.join(near)}" if near else f"layers: {_some(choices, 'none')}"))


def _carriers(targets: Iterable[Node]) -> Dict[str, List[str]]:
    """Each other name of the ``targets`` (module, traced labels, pre-fusion names) -> the
    names of the target nodes that carry it."""
    out: Dict[str, List[str]] = {}
    for n in targets:
        for lab in (layer_labels(n) | set(traced_names(n))) - {n.name}:
            out.setdefault(lab, []).append(n.name)
    return out


def _why_record(key: str, node: Optional[Node], carriers: Dict[str, List[str]], names: set, kinds: str,
                why_not: Callable[[Node], Optional[str]]) -> str:
    """Why the ``layers`` key ``key`` (``node``: the graph's node of that name, if any)
    names no target: another op, a module / traced name of a target, or no node at all."""
    if node is not None:
        return f"{key!r} is a {node.op} node ({why_not(node) or f'int8 quantizes {kinds} nodes'})"
    if key in carriers:
        return f"{key!r} is the module or pre-fusion name of node {', '.join(map(repr, carriers[key][:3]))}"
    near = difflib.get_close_matches(key, sorted(names), n=3, cutoff=0.5)
    return f"{key!r} is no node" + (f" (near matches: {', '.join(near)})" if near else "")


def _some(names: Iterable[str], none: str, k: int = 6) -> str:
    """Up to ``k`` of ``names`` (sorted), with the count when there are more; ``none`` if empty."""
    names = sorted(names)
    if not names:
        return none
    return ", ".join(names[:k]) + (f" ({len(names)} in all)" if len(names) > k else "")


__all__ = ["check_layer_names", "layer_labels"]
