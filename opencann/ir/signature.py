"""`CallSignature`: a graph's calling convention, typed (after torch.export's
``ExportGraphSignature``): how the flat outputs a caller gets are rebuilt from the
graph's outputs, which inputs the graph writes, and what eager's aliasing and layouts
were. The frontends write it (`opencann.frontend.torch`, `opencann.frontend.onnx`,
the engine for ``autocast``); the engine, code generation, the model file and the ACL
facade read it. It lives on the graph (``graph.signature``) and is frozen: change it
with `CallSignature.replace`, never in place.

Output positions: a caller gets ``n_outputs`` flat outputs (`n_flat`). The first
``len(input_mutations)`` are the new values of mutated inputs (the engine copies them into
the caller's tensors and does not return them); the rest are the user outputs. A
position in ``output_literals`` is a non-tensor (None, an int, a symbolic size); every
other position takes the next of ``graph.outputs`` in order.

What stays in ``graph.meta`` (not the calling convention; read by one stage each):
``formula_kernels`` (fusion passes record which spelled-out formulas they run as one
kernel; the model file checks them on load), ``specialised`` (`opencann.ir.specialise`
marks a graph bound from symbolic dims; code generation reads it), ``dropped_asserts`` /
``dropped_effects`` (the torch frontend's notes on what it dropped; the pipeline reports
them) and ``frontend`` (provenance: ``"onnx"``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Tuple


@dataclass(frozen=True)
class CallSignature:
    """A graph's calling convention. Fields (defaults: a graph with tensor outputs only,
    no written inputs, traced outside autocast):

    - ``n_outputs``: the caller's flat output count (mutated inputs first); None: as many
      as ``graph.outputs``.
    - ``output_literals``: flat position -> non-tensor output (None, int, float, bool or a
      `SymExpr` size bound per call).
    - ``output_storage``: per graph output, the set of value ids whose storage it shares in
      eager (views of one tensor, one tensor returned twice); None: unknown (every output
      is taken as its own). The runtime copies outputs passes merged that eager kept apart.
    - ``input_mutations``: for each leading flat output, the graph input index it updates.
    - ``returns_input``: user output index (among those after the mutations) -> graph input
      index: that output *is* the caller's mutated tensor in eager.
    - ``input_views``: user output index -> [graph input, shape, strides, storage offset
      relative to the input's new value, the new value's strides]: the output is a view of
      a mutated input in eager (ints or `SymExpr` sizes).
    - ``eager_output_strides``: graph output index -> eager's strides (element units) for
      outputs whose decomposed strides differ from eager's.
    - ``layout_queries``: ``"layout"`` / ``"offset"`` -> graph input indices whose layout
      (strides, contiguity) or storage offset the model's code read while captured.
    - ``shape_guards``: the model's own conditions on dynamic dims (sympy strings such
      as ``"Eq(s0, 2*s1)"``), checked per call shape.
    - ``autocast``: the host autocast dtype the graph was captured under (``"bfloat16"``);
      None: outside autocast (also files written before it was recorded).
    - ``input_names`` / ``output_names``: an ONNX model's graph input / output names (its
      inputs are fed by name); None for torch graphs.
    """

    n_outputs: Optional[int] = None
    output_literals: Dict[int, Any] = field(default_factory=dict)
    output_storage: Optional[Tuple[FrozenSet[int], ...]] = None
    input_mutations: Tuple[int, ...] = ()
    returns_input: Dict[int, int] = field(default_factory=dict)
    input_views: Dict[int, list] = field(default_factory=dict)
    eager_output_strides: Dict[int, Tuple[int, ...]] = field(default_factory=dict)
    layout_queries: Dict[str, List[int]] = field(default_factory=dict)
    shape_guards: Tuple[str, ...] = ()
    autocast: Optional[str] = None
    input_names: Optional[Tuple[str, ...]] = None
    output_names: Optional[Tuple[str, ...]] = None

    def __post_init__(self):
        # sequences normalised to tuples, so a signature built from JSON lists compares
        # equal to the frontend's
        for name in ("input_mutations", "shape_guards"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("output_storage", "input_names", "output_names"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, tuple(v))

    def replace(self, **changes: Any) -> "CallSignature":
        """A copy with ``changes`` (field name -> value); raises TypeError for an unknown
        field name."""
        return dataclasses.replace(self, **changes)

    def n_flat(self, n_graph_outputs: int) -> int:
        """The caller's flat output count (mutated inputs included) for a graph with
        ``n_graph_outputs`` outputs."""
        return self.n_outputs if self.n_outputs is not None else n_graph_outputs

    @property
    def writes_inputs(self) -> bool:
        """Whether the graph writes into or returns (views of) its inputs."""
        return bool(self.input_mutations or self.returns_input or self.input_views)

    def to_dict(self) -> Dict[str, Any]:
        """The fields as a dict (field name -> value, not copied): what the model file
        encodes."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "CallSignature":
        """A signature from `to_dict`'s form; missing fields take their defaults. Raises
        TypeError naming an unknown field."""
        return cls(**d)

    @classmethod
    def from_legacy_meta(cls, meta: Dict[str, Any]) -> Tuple["CallSignature", Dict[str, Any]]:
        """(signature, the rest of ``meta``) from a ``graph.meta`` that still holds the
        calling convention under its field names (model files of formats 1 and 2): the
        keys named like a field move into the signature, the others stay."""
        names = {f.name for f in dataclasses.fields(cls)}
        sig = cls(**{k: v for k, v in meta.items() if k in names})
        return sig, {k: v for k, v in meta.items() if k not in names}
