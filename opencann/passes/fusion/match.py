"""What the pattern fusions (SiLU, GELU, RMSNorm, LayerNorm, gated MLP) share: reading
a node as "tensor op scalar", the operands of a commutative product, the nodes of a
matched subgraph that nothing outside reads, whether this CPU's kernel keeps the
formula's NaN and ±inf, and replacing a matched subgraph by one node. Scalars arrive as
literal attributes (``Mul(%x; other=0.5)``, make_fx keeps Python numbers) or as
one-element constants; both read the same here."""
from __future__ import annotations

from typing import Any, Iterable, List, Optional, Sequence, Tuple

import sympy

from ...ops.parity import special_values_differ as _differ
from ...ir import DataType, Graph, Node, Value, numel
from ...ir.symbolic import as_expr
from ..base import Skip

_NUMBER = (int, float)


def producer(v: Optional[Value], *ops: str) -> Optional[Node]:
    """The node producing ``v`` when its op is one of ``ops`` (any op when none), else None."""
    p = v.producer if v is not None else None
    return p if p is not None and (not ops or p.op in ops) else None


def _const_scalar(v: Value) -> Optional[float]:
    if v.is_const and numel(v.desc.shape) == 1 and v.desc.dtype.torch.is_floating_point:
        return float(v.const.reshape(()).item())
    return None


def scalar_operand(node: Optional[Node], *ops: str) -> Optional[Tuple[Value, float]]:
    """(tensor, number) when ``node`` (op in ``ops``) is ``tensor ∘ number``: a literal
    ``other`` attribute, or a one-element float constant as either input (for Div/Sub
    only as the second). None otherwise, or for an Add/Sub with ``alpha`` != 1."""
    if node is None or node.op not in ops or node.attrs.get("alpha", 1) != 1:
        return None
    other = node.attrs.get("other")
    if len(node.inputs) == 1 and isinstance(other, _NUMBER) and not isinstance(other, bool):
        return node.inputs[0], float(other)
    if len(node.inputs) == 2:
        a, b = node.inputs
        if _const_scalar(b) is not None:
            return a, _const_scalar(b)
        if node.op in ("Mul", "Add") and _const_scalar(a) is not None:
            return b, _const_scalar(a)
    return None


def tensor_pair(node: Optional[Node], *ops: str) -> Optional[Tuple[Value, Value]]:
    """The two tensor operands of a binary ``node`` (op in ``ops``) with no scalar among
    them, else None."""
    if node is None or node.op not in ops or len(node.inputs) != 2 \
            or node.attrs.get("alpha", 1) != 1 or scalar_operand(node, *ops) is not None:
        return None
    return node.inputs[0], node.inputs[1]


def residual_add(x: Value):
    """The Add producing ``x`` as a residual sum of two tensors of ``x``'s shape: (the Add,
    a, b); None when no Add produces ``x``; a `Skip` naming the near miss (a scalar operand
    or alpha != 1, a broadcast) — what an add-and-norm fusion's kernel takes."""
    add = x.producer
    if add is None or add.op != "Add":
        return None
    pair = tensor_pair(add, "Add")
    if pair is None:
        return Skip("the Add has a scalar operand or alpha != 1: not a residual a + b")
    a, b = pair
    if a.desc != x.desc or b.desc != x.desc:
        return Skip(f"the Add broadcasts ({a.desc} + {b.desc}); the fused kernel adds two "
                    "tensors of the result's shape")
    return add, a, b


def residual_layer_norm(ln: Node, graph: Graph, out: str = "", float_affine: bool = True,
                        missing: str = ""):
    """The residual Add feeding LayerNorm ``ln`` when an add-and-norm node can replace the
    pair: the sum read by ``ln`` alone, the statistics unread, one normalized axis, and with
    ``float_affine`` (the nodes normalizing in float32; AddLayerNorm takes any dtype) a
    float32 norm with float32 γ / β; when no Add produces its input (the embeddings' norm of
    a model without one), None, or a `Skip` saying ``missing`` when given; else a `Skip`
    naming the near miss. ``out`` names what the fused node returns beside the norm, if
    anything (in the statistics' reason)."""
    dtype = ln.outputs[0].desc.dtype
    if float_affine and dtype != DataType.FLOAT:
        return Skip(f"the LayerNorm computes in {dtype.value}; the fused node normalizes in float32")
    found = residual_add(ln.inputs[0])
    if found is None and missing:
        return Skip(missing)
    if not isinstance(found, tuple):
        return found
    add = found[0]
    x = add.outputs[0]
    readers = [u.name for u in x.users if u is not ln]
    if readers or x in graph.outputs:
        return Skip("the sum a + b is also read by "
                    + (", ".join(readers) if readers else "the caller")
                    + "; the fused node does not write it")
    if any(o.users or o in graph.outputs for o in ln.outputs[1:]):
        return Skip("the LayerNorm's mean or rstd is read (training): the fused node "
                    f"returns the normalized output{' and ' + out if out else ''} only")
    if len(ln.attrs["normalized_shape"]) != 1:
        return Skip(f"normalizes {len(ln.attrs['normalized_shape'])} trailing axes; the "
                    "fused node normalizes the last one")
    params = [ln.inputs[ln.attrs[k].index] for k in ("weight", "bias")
              if ln.attrs.get(k) is not None]
    if float_affine and any(p.desc.dtype != DataType.FLOAT for p in params):
        return Skip(f"γ/β dtypes {[p.desc.dtype.value for p in params]}: the fused "
                    "node takes float32 γ and β, as the float32 LayerNorm it replaces")
    return add


def factors(graph: Graph, root: Node, depth: int = 2) -> Tuple[List[Value], float, List[Node]]:
    """Flatten a product tree under ``root`` (Mul nodes; an inner Mul only when ``root``'s
    side is its sole reader, to ``depth`` levels): (tensor factors, product of the scalar
    factors, the Mul nodes flattened, root first)."""
    tensors: List[Value] = []
    scale, nodes = 1.0, [root]
    so = scalar_operand(root, "Mul", "Muls")
    operands = [so[0]] if so else list(root.inputs)
    scale = so[1] if so else 1.0
    for v in operands:
        inner = producer(v, "Mul", "Muls")
        if depth > 1 and inner is not None and graph.sole_user(v) is root:
            t, s, ns = factors(graph, inner, depth - 1)
            tensors += t
            scale *= s
            nodes += ns
        else:
            tensors.append(v)
    return tensors, scale, nodes


def close(a: Optional[float], b: float, rel: float = 1e-6) -> bool:
    """``a`` equals the constant ``b`` to ``rel`` (constants are written with few digits)."""
    return a is not None and abs(a - b) <= rel * abs(b)


def used_outside(graph: Graph, nodes: Sequence[Node], root: Node) -> Optional[Tuple[Node, Value]]:
    """(node, value) of a matched node other than ``root`` whose output something outside
    ``nodes`` reads (or the caller gets): fusing it would compute it twice. None if none."""
    inside = set(nodes)
    for n in nodes:
        if n is root:
            continue
        for o in n.outputs:
            if any(o is g for g in graph.outputs) or any(u not in inside for u in o.users):
                return n, o
    return None


def read_outside(graph: Graph, nodes: Sequence[Node], root: Node, what: str) -> Optional[Skip]:
    """A `Skip` naming the first matched value (other than ``root``'s) that something outside
    ``nodes`` reads or the caller gets (`used_outside`): fusing the ``what`` would compute
    it twice. None when the match is self-contained."""
    out = used_outside(graph, nodes, root)
    if out is None:
        return None
    return Skip(f"{out[1]} ({out[0].op}) is read outside the {what}: fusing would compute "
                "it twice")


def special_values_differ(x, act: str):
    """A `Skip` when this CPU's kernels of ``act`` ("gelu", "gelu_tanh", "silu",
    "rms_norm", "layer_norm") give NaN or ±inf (or, for the norms, an overflow) elsewhere
    than the spelled-out formula for ``x``'s dtype (`opencann.ops.parity.special_values`:
    oneDNN's AVX-512 exact GELU maps +inf to NaN), else None: the rewrite would change
    eager's special values."""
    why = _differ(act, x.desc.dtype.torch)
    return Skip(f"{why}: the spelled-out form is kept") if why else None


def record_formula(graph: Graph, act: str, x: Value) -> None:
    """Note in ``graph.meta["formula_kernels"]`` ([act, dtype name] pairs) that a spelled-out
    ``act`` (an activation or a norm, `special_values_differ`) on ``x``'s dtype now runs as
    this CPU's kernel: a model file holding it is
    refused where that kernel would place NaN/±inf elsewhere (`runtime.model_file`)."""
    entry = [act, str(x.desc.dtype.torch).replace("torch.", "")]
    kept = graph.meta.setdefault("formula_kernels", [])
    if entry not in kept:
        kept.append(entry)


def contiguous_strides(shape: Sequence[Any]) -> List[Any]:
    """Row-major strides of ``shape`` (elements); a dynamic dim (a symbol's string form)
    gives strides in the same string form (``16*s27``), bound per call like the shape."""
    out, step = [], sympy.Integer(1)
    for s in reversed(list(shape)):
        out.append(int(step) if step.is_Integer else str(step))
        step = step * (as_expr(s) if not isinstance(s, int) else max(int(s), 1))
    return out[::-1]


def replace_with(graph: Graph, old_root: Node, new: Node, matched: Iterable[Node],
                 old_k: int = 0, new_k: int = 0) -> None:
    """``new`` (already inserted before ``old_root``) takes over ``old_root``'s output
    ``old_k`` with its output ``new_k`` (default: the first of each); the matched nodes,
    now unread, are erased (readers before producers). ``new`` keeps the traced strides
    of the replaced output (``meta["strides"]``)."""
    strides = old_root.meta.get("strides")
    if strides and len(strides) > old_k:
        new.meta["strides"] = [strides[old_k] if j == new_k else contiguous_strides(o.desc.shape)
                               for j, o in enumerate(new.outputs)]
    graph.replace_all_uses_with(old_root.outputs[old_k], new.outputs[new_k])
    left = [n for n in dict.fromkeys(matched) if not n.erased]
    while left:
        dead = [n for n in left if not any(o.users or any(o is g for g in graph.outputs)
                                           for o in n.outputs)]
        if not dead:
            break   # still read outside the match: kept (callers checked `used_outside`)
        for n in dead:
            graph.erase_node(n)
        left = [n for n in left if not n.erased]


__all__ = ["close", "contiguous_strides", "factors", "producer", "replace_with", "scalar_operand", "tensor_pair",
           "used_outside", "read_outside", "residual_add", "residual_layer_norm"]
