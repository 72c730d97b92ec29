"""What is symbolic in a graph torch.compile hands the opencann backend: the one place that
decides whether a graph is static, has symbolic shapes, or computes data-dependent ones.

Dynamo makes a value symbolic wherever it changed between calls (automatic dynamic) or
everywhere (``dynamic=True``): a tensor's sizes, strides or storage offset, or a Python
int, float or bool argument, which then arrives as a ``SymInt``/``SymFloat``/``SymBool``
input while every tensor keeps static sizes (``forward(tokens, start_pos: int)``:
``x[:start_pos]`` is symbolic only inside the graph). `graph_symbols` therefore reads
every value of the graph: the example inputs and each node's FX value (``meta["val"]``
of ATen graphs, ``meta["example_value"]`` of dynamo's), tensors (sizes, strides,
storage offset) and numbers alike, in nested lists and tuples. Its symbols are of two
kinds (torch's ``free_unbacked_symbols``): *backed* ones (``s0``) have a value at every
call, read from the inputs, so the graph is compiled once and planned per concrete
shape; *unbacked* ones (``u0``: ``.item()``, ``nonzero()``, ``x[mask]``, with
``torch._dynamo.config.capture_scalar_outputs`` or ``capture_dynamic_output_shape_ops``)
depend on tensor values, so the graph runs eagerly (`opencann.dynamo.eager_fallbacks`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Tuple

import torch

from ..frontend.torch import source_of


@dataclass(frozen=True)
class GraphSymbols:
    """The symbols of one graph: ``backed`` (sorted names, ``("s0", "s1")``) and
    ``unbacked`` (data-dependent symbol -> where it is first computed: the user's source
    line, ``"model.py:12"``, else the node's name)."""
    backed: Tuple[str, ...] = ()
    unbacked: Dict[str, str] = field(default_factory=dict)

    @property
    def dynamic(self) -> bool:
        """Whether the graph has symbolic shapes or sizes with a value at every call (it
        is compiled once and planned per concrete shape)."""
        return bool(self.backed)

    @property
    def data_dependent(self) -> bool:
        """Whether the graph computes a size or scalar from tensor values (it runs eagerly)."""
        return bool(self.unbacked)

    def why_eager(self) -> str:
        """The reason a data-dependent graph runs eagerly, naming where (one line)."""
        where = ", ".join(dict.fromkeys(self.unbacked.values()))
        return (f"this graph computes a size or scalar from tensor values ({where}: .item(), "
                "nonzero() or x[mask], captured under dynamo's capture_scalar_outputs or "
                "capture_dynamic_output_shape_ops), which opencann's per-shape plans cannot hold")


def _symbols(val: Any) -> Tuple[set, set]:
    """(all free symbols, unbacked ones) of an FX value: a tensor (sizes, strides, storage
    offset), a SymInt/SymFloat/SymBool, or a list/tuple of them; other values have none."""
    from torch.fx.experimental.symbolic_shapes import free_symbols, free_unbacked_symbols
    if isinstance(val, (list, tuple)):
        parts = [_symbols(v) for v in val]
        return set().union(*(p[0] for p in parts)), set().union(*(p[1] for p in parts))
    if not isinstance(val, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return set(), set()
    return set(free_symbols(val)), set(free_unbacked_symbols(val))


def graph_symbols(gm: torch.fx.GraphModule, example_inputs: Iterable[Any] = ()) -> GraphSymbols:
    """The backed and unbacked symbols of ``gm`` (an FX graph from dynamo or AOTAutograd)
    and of ``example_inputs`` (what dynamo passed the backend): every input, intermediate
    and output value, see the module docstring. A static graph gives ``GraphSymbols()``."""
    backed: set = set()
    unbacked: Dict[str, str] = {}
    for node in gm.graph.nodes:
        syms, unb = _symbols(node.meta.get("val", node.meta.get("example_value")))
        backed |= syms - unb
        src = source_of(node)[0] if unb else ""
        for s in sorted(str(s) for s in unb if str(s) not in unbacked):
            unbacked[s] = (src if src and not src.startswith("<") else
                           f"input {node.name}" if node.op == "placeholder" else node.name)
    for v in example_inputs:
        syms, unb = _symbols(v)
        backed |= syms - unb
        for s in unb:
            unbacked.setdefault(str(s), "an input")
    return GraphSymbols(tuple(sorted(str(s) for s in backed)), unbacked)
