"""Readers that quantize a value, looking through Reshapes: what lets a producer write the
uint8 tensor itself (``fuse_requant``: an int8 layer's output scale; ``fuse_add_layer_norm_quant``:
the norm's quantized output).

A transformer reshapes between its ops ([B, S, H] ⇄ [B·S, H] around every Linear), so the
AscendQuant of a Linear's input sits behind one or two Reshapes of the producer's output. A
Reshape does not look at values, so the chain can carry the uint8 tensor instead
(`to_uint8` retypes it); any other reader keeps the float value and stops the rewrite."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import List, Optional, Set, Tuple, Union

from ...ir import DataType, Graph, Node, Value
from ..base import Skip

#: view ops a uint8 value passes through unchanged (dtype-agnostic, no value read)
VIEWS = ("Reshape",)


@dataclass
class QuantReaders:
    """The AscendQuant nodes reading a value (``quants``), the Reshapes between (``views``,
    producers before readers) and the (AscendQuant ``scale``, ``offset``) keys they use."""

    quants: List[Node] = field(default_factory=list)
    views: List[Node] = field(default_factory=list)
    keys: Set[Tuple[float, int]] = field(default_factory=set)


def quant_readers(graph: Graph, v: Value, found: Optional[QuantReaders] = None) -> Union[QuantReaders, Skip]:
    """Every reader of ``v``, through `VIEWS`, as a `QuantReaders`; a `Skip` naming the first
    reader that is neither (an fp32/bf16 consumer) or a graph output on the way."""
    found = QuantReaders() if found is None else found
    if v in graph.outputs:
        return Skip("the value is a graph output (the caller reads it as it is)")
    for u in v.users:
        if u.op == "AscendQuant":
            found.quants.append(u)
            found.keys.add((float(u.attrs["scale"]), int(u.attrs["offset"])))
        elif u.op in VIEWS and len(u.outputs) == 1 and sum(1 for x in u.inputs if x is v) == 1:
            found.views.append(u)
            r = quant_readers(graph, u.outputs[0], found)
            if isinstance(r, Skip):
                return r
        else:
            return Skip(f"read as {v.desc.dtype.value} by {u.name} ({u.op})")
    return found


def quant_paths(graph: Graph, v: Value) -> Tuple[QuantReaders, List[Node]]:
    """The readers of ``v`` that only quantize it (an AscendQuant, or a Reshape whose
    every reader does, through `VIEWS`) as one `QuantReaders`, and those readers (the
    heads of the paths); ``v``'s other readers are left out: a producer writing both ``v``
    and its uint8 (AddLayerNormQuant: the float32 residual stream beside the next int8
    layer's input) feeds the heads its uint8 output instead."""
    found, heads = QuantReaders(), []
    for u in v.users:
        if u.op == "AscendQuant":
            found.quants.append(u)
            found.keys.add((float(u.attrs["scale"]), int(u.attrs["offset"])))
            heads.append(u)
        elif u.op in VIEWS and len(u.outputs) == 1 and sum(1 for x in u.inputs if x is v) == 1:
            r = quant_readers(graph, u.outputs[0], QuantReaders())
            if isinstance(r, QuantReaders) and r.quants:
                found.quants += r.quants
                found.views += [u] + r.views
                found.keys |= r.keys
                heads.append(u)
    return found, heads


def to_uint8(graph: Graph, r: QuantReaders) -> None:
    """Retype the Reshapes of ``r`` to uint8 and bypass its AscendQuant nodes (erased):
    call once the producer writes the uint8 value itself."""
    for view in r.views:
        view.outputs[0].desc = replace(view.outputs[0].desc, dtype=DataType.UINT8)
    for q in r.quants:
        graph.replace_all_uses_with(q.outputs[0], q.inputs[0])
        graph.erase_node(q)


__all__ = ["QuantReaders", "VIEWS", "quant_paths", "quant_readers", "to_uint8"]
