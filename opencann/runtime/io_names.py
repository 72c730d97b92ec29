"""The names of a compiled graph's inputs and outputs, as a model file's metadata,
``opencann inspect`` and the ACL facade (``acl.mdl.get_output_name_by_index``) give them:
one ``str`` per tensor the caller passes or receives, unique within the inputs and within
the outputs. An ONNX model keeps its graph's names; a torch model's outputs are named by
the dict keys / ModelOutput fields along their place in the returned structure
(``logits``, ``extra.mask``), else by their position among the caller's outputs
(``output0``, ``output1``...); its inputs by the graph's input names (``input<i>`` where
one has none)."""
from __future__ import annotations

from typing import Any, List

from ..ir import Graph


def _children(spec) -> list:
    return list(spec.children()) if hasattr(spec, "children") else list(spec.children_specs)


def structure_names(spec: Any, n: int) -> List[str]:
    """One name per leaf of the pytree TreeSpec ``spec`` (``n`` leaves): the dict keys /
    ModelOutput fields along its path joined by ``.`` (a list or tuple position adds its
    index once a key is on the path); ``output<i>`` for a leaf with no key on its path,
    and for all when ``spec`` is None or has another leaf count."""
    if spec is None:
        return [f"output{i}" for i in range(n)]
    names: List[str] = []

    def walk(s, prefix: str) -> None:
        if s.is_leaf():
            names.append(prefix or f"output{len(names)}")
            return
        kids, ctx = _children(s), s.context
        keys = list(ctx) if isinstance(ctx, (list, tuple)) and len(ctx) == len(kids) else None
        for i, c in enumerate(kids):
            walk(c, f"{prefix}.{keys[i] if keys else i}" if prefix else
                 (str(keys[i]) if keys else ""))
    walk(spec, "")
    return names if len(names) == n else [f"output{i}" for i in range(n)]


def output_names(graph: Graph, out_spec: Any) -> List[str]:
    """The names of the tensors a call returns: ``graph.outputs`` after the mutated inputs'
    new values (``signature.input_mutations``), in order. ``out_spec``: the caller's
    output structure (a TreeSpec, None for a flat tuple); literal (non-tensor) outputs
    take no name. Unique and never None: duplicates fall back to ``output<i>``."""
    sig = graph.signature
    k = len(sig.input_mutations)
    n = len(graph.outputs) - k
    if sig.output_names is not None and len(sig.output_names) == n:
        names = [str(x) for x in sig.output_names]
    else:
        flat = structure_names(out_spec, sig.n_flat(len(graph.outputs)) - k)
        names = [nm for i, nm in enumerate(flat) if i + k not in sig.output_literals]
    if len(names) != n or len(set(names)) != n:
        names = [f"output{i}" for i in range(n)]
    return names


def input_names(graph: Graph) -> List[str]:
    """The names of the graph's inputs (``input<i>`` for one with none; all of them when
    two share a name)."""
    names = [v.name if isinstance(v.name, str) and v.name else f"input{i}"
             for i, v in enumerate(graph.inputs)]
    return names if len(set(names)) == len(names) else [f"input{i}" for i in range(len(names))]
