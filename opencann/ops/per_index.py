"""Per-index independence of ops: the rules of the `OpDef.per_index` column.

Padding a dynamic dim (ATC's gear padding: a batch of 3 served by the batch-4 plan)
is only correct when every op computes the entries at a real index of that dim from
entries at the same index alone, so the padded rows cannot reach the real ones. A rule
answers that for one node and follows the padded dim through it:

``rule(node, axes, sym) -> Dict[int, int] | str`` (a rule may name, in its
``shape_attrs``, attributes that are only the node's own output shape: a padded size
there is not the size taken as a value). ``axes`` maps the index of each input
that depends on padded data to the axis of that input along which the padded dim runs
(its size there is ``sym`` times a factor free of ``sym``; the padded rows are the
trailing block). The result maps each output that carries the padded dim to its axis
(an output left out does not depend on padded data), or is the reason, one phrase,
why padding could change the node's results ("reduces over the padded dim").

The rules here are the families of the operator library: `ALL` (elementwise: every dim
independent), `except_dims` (softmax, norms, pooling, convolution: the dims an op does
not mix), `REDUCE`, `MM`/`BMM`/`ADDMM`, `ATTENTION`, the data and view ops. An op
without a rule (host fallbacks, custom ops, gradients) is unknown, and unknown blocks
padding. Random ops are refused by the analysis itself (`is_random`: the draws depend
on the padded shape). Source of the semantics: CANN ATC documentation,
"--dynamic_batch_size" (a smaller batch is served by a larger gear).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import sympy
import torch

from ..ir import Node, TensorRef
from ..ir.symbolic import SymExpr, as_expr, parse, symbols_of


class Axis(int):
    """An axis that carries the padded dim, merged (by a reshape) with ``outer`` (a sympy
    expression) elements of other dims before it within that axis: its size is
    ``outer * sym * inner``. A plain int means ``outer`` 1. Rules that only move or keep
    an axis return ints; the analysis keeps the input's ``outer``. ``iota``: the value
    at padded index i is i (``arange(sym)`` and views of it), so indexing a padded
    tensor with it picks each row itself."""

    outer: sympy.Expr
    iota: bool

    def __new__(cls, value: int, outer: Any = 1, iota: bool = False):
        a = super().__new__(cls, value)
        a.outer, a.iota = sympy.sympify(outer), iota
        return a


def outer_of(axis: int) -> sympy.Expr:
    """``axis.outer`` for an `Axis`, 1 for a plain int."""
    return getattr(axis, "outer", sympy.Integer(1))


Axes = Dict[int, int]
Result = Union[Axes, str]
Rule = Callable[[Node, Axes, str], Result]

_MAX_INT = 2 ** 62


def _idx(node: Node, name: str) -> Optional[int]:
    """The input index of tensor argument ``name`` (None: absent or not a tensor)."""
    a = node.attrs.get(name)
    return a.index if isinstance(a, TensorRef) else None


def _norm(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _rank(node: Node, i: int) -> int:
    return len(node.inputs[i].desc.shape)


def _carries(shape: Sequence, sym: str) -> List[int]:
    """Positions of ``shape`` whose size depends on ``sym``."""
    return [k for k, d in enumerate(shape) if isinstance(d, str) and sym in {
        str(s) for s in parse(d).free_symbols}]


def _outputs(node: Node, main: int, p: int, sym: str) -> Result:
    """Output axes of a node whose outputs keep input ``main``'s rank (axis ``p`` stays):
    an output of another rank that still has ``sym`` in its shape carries it at its only
    such position (GroupNorm's [N, G] statistics), or cannot be followed."""
    rank = _rank(node, main)
    out: Axes = {}
    for k, o in enumerate(node.outputs):
        where = _carries(o.desc.shape, sym)
        if len(o.desc.shape) == rank:
            out[k] = p
        elif len(where) == 1 and where[0] == p:
            out[k] = p
        elif where:
            return f"output {k} carries the padded dim at a position that cannot be followed"
    return out


def elementwise(node: Node, axes: Axes, sym: str) -> Result:
    """Every dim independent (broadcasting aligns the trailing dims)."""
    rank = max((len(o.desc.shape) for o in node.outputs), default=0)
    pos = {p + rank - _rank(node, i) for i, p in axes.items()}
    if len(pos) > 1:
        return ("pairs every index of the padded dim with every other (its inputs carry it "
                "at different positions, e.g. an S×S attention mask): padded indices would "
                "meet real ones")
    return {k: next(iter(pos)) for k in range(len(node.outputs))} if pos else {}


ALL: Rule = elementwise


def offset(node: Node, axes: Axes, sym: str) -> Result:
    """Elementwise; adding a literal 0 to ``arange(sym)`` keeps it "index i holds i"
    (transformers' ``arange(kv_length) + kv_offset``)."""
    res = elementwise(node, axes, sym)
    other, alpha = node.attrs.get("other"), node.attrs.get("alpha", 1)
    if isinstance(res, dict) and len(axes) == 1 and other == 0 and alpha == 1 and \
            not isinstance(other, bool) and getattr(next(iter(axes.values())), "iota", False):
        p = next(iter(axes.values()))
        return {k: Axis(q, outer_of(p), True) for k, q in res.items()}
    return res


def fused_elementwise(node: Node, axes: Axes, sym: str) -> Result:
    """Every dim independent (broadcasting aligns the trailing dims, as for one
    elementwise op), but the last when the program ends in a reduction over it: the
    reduction's output ``r`` drops that dim (keeps it as 1 with keepdim)."""
    rank = len(node.attrs.get("shape", ())) or max(len(o.desc.shape) for o in node.outputs)
    pos = {p + rank - _rank(node, i) for i, p in axes.items()}
    if len(pos) > 1:
        return ("pairs every index of the padded dim with every other (its inputs carry it "
                "at different positions): padded indices would meet real ones")
    if not pos:
        return {}
    p = next(iter(pos))
    if node.attrs.get("reduce") and p == rank - 1:
        return f"reduces over the padded dim (axis {p}, the program's last-dim reduction)"
    return {k: p for k in range(len(node.outputs))}


#: attributes that are the node's own broadcast domain (the kernel takes its sizes from
#: the inputs): they follow the padded data, they are not a value of the dim's size
fused_elementwise.shape_attrs = ("shape",)


def _add_norm(node: Node, axes: Axes, addend_names, outputs: int) -> Result:
    """A norm over the last dim of the sum of two addends (named ``addend_names``): every
    dim but the last independent; either addend may carry the padded dim (at the same
    axis), the weights may not; ``outputs`` outputs of the addends' shape carry it."""
    addends = {_idx(node, a) for a in addend_names}
    rank = len(node.outputs[0].desc.shape)
    pos = set()
    for i, p in axes.items():
        if i not in addends:
            return "the padded dim reaches a weight or parameter input"
        pos.add(p + rank - _rank(node, i))
    if len(pos) > 1:
        return "the addends carry the padded dim at different positions"
    p = next(iter(pos), None)
    if p is None:
        return {}
    if p >= rank - 1:
        return f"mixes entries along the padded dim (axis {p})"
    return {k: p for k in range(outputs)}


def add_layer_norm(node: Node, axes: Axes, sym: str) -> Result:
    """LayerNorm(self + other) over the last dim (`_add_norm`; γ and β carry no padding)."""
    return _add_norm(node, axes, ("self", "other"), 1)


def add_layer_norm_cast(node: Node, axes: Axes, sym: str) -> Result:
    """LayerNorm(x1 + x2) over the last dim and its cast, both outputs of the addends'
    shape (`_add_norm`; γ and β carry no padding)."""
    return _add_norm(node, axes, ("x1", "x2"), 2)


def add_rms_norm(node: Node, axes: Axes, sym: str) -> Result:
    """RMSNorm(x1 + x2) over the last dim, both outputs (y, the sum) of the addends'
    shape (`_add_norm`; the weight ``gamma`` carries no padding)."""
    return _add_norm(node, axes, ("x1", "x2"), 2)


def rotary_mul(node: Node, axes: Axes, sym: str) -> Result:
    """x·cos + rotate_half(x)·sin: elementwise (`elementwise`) but along the last dim,
    which rotate_half mixes."""
    res = elementwise(node, axes, sym)
    if isinstance(res, dict) and res and next(iter(res.values())) >= len(node.outputs[0].desc.shape) - 1:
        return "rotate_half mixes entries along the padded (last) dim"
    return res


def except_dims(allowed: Callable[[Node, int], Sequence[int]], main: str = "self",
                others: Sequence[str] = ()) -> Rule:
    """A rule for an op that mixes entries along some dims of input ``main`` (softmax's
    ``dim``, a norm's normalized dims, pooling's spatial dims, convolution's channels
    and window): ``allowed(node, rank)`` lists the axes it keeps apart. Tensor inputs
    in ``others`` (a residual addend) may carry the padded dim at the same axis; any
    other input (weights) must not."""
    def rule(node: Node, axes: Axes, sym: str) -> Result:
        m = _idx(node, main)
        if m is None or m not in axes:
            return "the padded dim reaches a weight or parameter input"
        p = axes[m]
        ok = {_norm(d, _rank(node, m)) for d in allowed(node, _rank(node, m))}
        if p not in ok:
            return f"mixes entries along the padded dim (axis {p})"
        extra = {_idx(node, n) for n in others}
        for i, q in axes.items():
            if i != m and (i not in extra or q + _rank(node, m) - _rank(node, i) != p):
                return "the padded dim reaches a weight or parameter input"
        return _outputs(node, m, p, sym)
    rule.__doc__ = f"independent along {allowed.__doc__ or 'some dims'}"
    return rule


def _dim_attr(name: str, default=None) -> Callable[[Node, int], Sequence[int]]:
    def allowed(node: Node, rank: int) -> Sequence[int]:
        d = node.attrs.get(name, default)
        return [k for k in range(rank) if k != _norm(int(d), rank)]
    allowed.__doc__ = f"every dim but ``{name}``"
    return allowed


def _leading(keep: int) -> Callable[[Node, int], Sequence[int]]:
    def allowed(node: Node, rank: int) -> Sequence[int]:
        return range(max(rank - keep, 0))
    allowed.__doc__ = f"the dims before the last {keep}"
    return allowed


def _normalized(node: Node, rank: int) -> Sequence[int]:
    """the dims before the normalized ones"""
    return range(rank - len(node.attrs.get("normalized_shape", ())))


def _not_channel(node: Node, rank: int) -> Sequence[int]:
    """every dim but the channels (1)"""
    return [k for k in range(rank) if k != 1]


def _channel(node: Node, rank: int) -> Sequence[int]:
    """the channels (1) only"""
    return [1]


def _batch_channel(node: Node, rank: int) -> Sequence[int]:
    """the batch and channels (0, 1)"""
    return [0, 1]


def _batch(node: Node, rank: int) -> Sequence[int]:
    """the batch (0) only"""
    return [0]


SOFTMAX = except_dims(_dim_attr("dim"))
CUMULATIVE = except_dims(_dim_attr("dim"))
LAYER_NORM = except_dims(_normalized, main="input")
BATCH_NORM_INFERENCE = except_dims(_not_channel, main="input")
BATCH_NORM_TRAINING = except_dims(_channel, main="input")
GROUP_NORM = except_dims(_batch, main="input")
POOL = except_dims(_leading(2))
CONV = except_dims(_batch, main="input")
RESIZE = except_dims(_batch_channel, main="input")   # F.interpolate: mixes the spatial dims
CONV_ADD = except_dims(_batch, main="input", others=("other",))


def reduction(node: Node, axes: Axes, sym: str) -> Result:
    """Independent along the dims not reduced (``dim`` None or empty: all reduced)."""
    if set(axes) != {0}:
        return "the padded dim reaches a non-data input"
    rank, p = _rank(node, 0), axes[0]
    dims = node.attrs.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    dims = [_norm(d, rank) for d in dims] if dims else list(range(rank))
    if p in dims:
        return f"reduces over the padded dim (axis {p})"
    q = p if node.attrs.get("keepdim", False) else p - sum(d < p for d in dims)
    return {k: q for k in range(len(node.outputs))}


REDUCE: Rule = reduction


def _contract(node: Node, axes: Axes, a: Optional[int], b: Optional[int], rank: int,
              bias: Optional[int] = None) -> Result:
    """A (batched) product ``a @ b`` of rank ``rank``: rows of ``a`` (axis rank-2), columns
    of ``b`` (axis rank-1) and the batch dims (both, same axis) stay apart."""
    pa, pb = axes.get(a), axes.get(b)
    if pa == rank - 1 or pb == rank - 2:
        return "contracts over the padded dim (a GEMM's K)"
    if pa is not None and pb is not None and (pa != pb or pa >= rank - 2):
        return "both operands carry the padded dim (every row meets every column)"
    q = pa if pa is not None else pb
    if bias is not None and bias in axes and (q is None or axes[bias] + rank - _rank(node, bias) != q):
        return "the padded dim reaches the bias only"
    return {0: q} if q is not None else {}


def mm(node: Node, axes: Axes, sym: str) -> Result:
    """Rows of ``self`` and columns of ``mat2`` independent."""
    return _contract(node, axes, _idx(node, "self"), _idx(node, "mat2"), 2)


def addmm(node: Node, axes: Axes, sym: str) -> Result:
    """Rows of ``mat1`` and columns of ``mat2`` independent (``self``: the bias)."""
    return _contract(node, axes, _idx(node, "mat1"), _idx(node, "mat2"), 2, _idx(node, "self"))


def bmm(node: Node, axes: Axes, sym: str) -> Result:
    """Batch, rows of ``self`` and columns of ``mat2`` independent."""
    return _contract(node, axes, _idx(node, "self"), _idx(node, "mat2"), 3)


def gated_mlp(node: Node, axes: Axes, sym: str) -> Result:
    """Rows of ``x`` independent (two GEMMs with the weights)."""
    return _contract(node, axes, _idx(node, "x"), None, 2) if set(axes) <= {_idx(node, "x")} \
        else "the padded dim reaches a weight"


def attention(node: Node, axes: Axes, sym: str) -> Result:
    """softmax(QKᵀ)V: the batch and head dims independent when q, k, v (and the mask)
    all carry the padded dim there; the query positions independent when only the
    query does. Padding keys or values adds keys every query attends to."""
    q, k, v, m = (_idx(node, n) for n in ("query", "key", "value", "attn_mask"))
    rank = _rank(node, q)
    at = {i: p + rank - _rank(node, i) for i, p in axes.items()}
    if set(at) == {q} and at[q] == rank - 2:
        p = rank - 2
    elif {q, k, v} <= set(at) and len(set(at.values())) == 1 and at[q] < rank - 2:
        p = at[q]
    else:
        return ("attention mixes positions along the padded dim: padded keys/values "
                "would be attended to (pad with an attention mask, or use exact gears)")
    out: Axes = {}
    for j, o in enumerate(node.outputs):
        if _carries(o.desc.shape, sym):
            out[j] = p
    return out


def _same_axis(node: Node, axes: Axes, names: Sequence[str]) -> "int | str":
    """The one axis the padded inputs among ``names`` carry the dim at, or a reason."""
    at = {n: axes[i] for n in names for i in [_idx(node, n)] if i is not None and i in axes}
    if len(set(at.values())) != 1:
        return (f"its inputs carry the padded dim at different axes "
                f"({', '.join(f'{n} {a}' for n, a in at.items())})")
    return next(iter(at.values()))


def kv_cache_update(node: Node, axes: Axes, sym: str) -> Result:
    """KvCacheUpdate (cache [B, H, S, D], new [B, H, T, D], positions [B]): the batch,
    head and head-dim axes independent when the cache and the new rows carry the padded
    dim at the same axis (positions too, on the batch); the sequence axis is written at
    per-row positions, so padded tokens would land at real cache positions."""
    p = _same_axis(node, axes, ("cache", "new", "positions"))
    if isinstance(p, str):
        return p
    c, n, pos = (_idx(node, a) for a in ("cache", "new", "positions"))
    if p == 2 or pos in axes and (axes[pos] != 0 or p != 0) or not {c, n} <= set(axes):
        return ("KvCacheUpdate writes new tokens at per-row positions along the cache's "
                "sequence axis: padded rows or tokens would be written over real cache "
                "positions (serve it with exact shapes: opencann.llm's step graphs)")
    return {0: p}


def decode_attention_kv_update(node: Node, axes: Axes, sym: str) -> Result:
    """DecodeAttentionKvUpdate (`kv_cache_update` twice, then `decode_attention`): rows
    independent along the batch when every input carries the padded dim there; any
    other axis reaches the caches' sequence axis or the GQA head groups."""
    names = ("query", "key", "value", "key_new", "value_new", "positions", "lengths")
    rope = {_idx(node, n) for n in ("cos", "sin") if n in node.attrs}
    if rope and any(axes.get(i, Axis(0)) != Axis(0) for i in rope):   # RoPE's cos / sin
        return "the rotary cos/sin carry the padded dim off their batch axis"
    axes = {i: a for i, a in axes.items() if i not in rope}   # per row, or one for all rows
    p = _same_axis(node, axes, names)
    if isinstance(p, str):
        return p
    if p != 0 or len(axes) != len(names):
        return ("DecodeAttentionKvUpdate writes new tokens at per-row cache positions and "
                "mixes cache positions and GQA head groups: only the batch axis of all its "
                "inputs can be padded")
    return {0: 0, 1: 0, 2: 0}


def decode_attention(node: Node, axes: Axes, sym: str) -> Result:
    """DecodeAttention (q [B, Hq, 1, D], k/v caches [B, Hkv, S, D], lengths [B]): rows
    independent along the batch when q, both caches and the lengths all carry the padded
    dim there; any other axis mixes heads (GQA groups) or cache positions."""
    p = _same_axis(node, axes, ("query", "key", "value", "lengths"))
    if isinstance(p, str):
        return p
    if p != 0 or len(axes) != 4:
        return ("DecodeAttention mixes the padded dim's entries (cache positions or GQA head "
                "groups): only the batch axis of all its inputs can be padded")
    return {0: 0}


def embedding(node: Node, axes: Axes, sym: str) -> Result:
    """Each index looked up on its own (the table must not carry the padded dim)."""
    i = _idx(node, "indices")
    if set(axes) != {i}:
        return "the padded dim reaches the embedding table"
    return {0: axes[i]}


def gather(node: Node, axes: Axes, sym: str) -> Result:
    """``out[..i..] = self[..index[..i..]..]`` along ``dim``: independent along the dims
    other than ``dim``, and along every dim of the indices when ``self`` does not carry
    the padded dim."""
    si, ii = _idx(node, "self"), _idx(node, "index")
    d = _norm(int(node.attrs["dim"]), _rank(node, si))
    if si not in axes:
        return {0: axes[ii]}
    if axes[si] == d or (ii in axes and axes[ii] != axes[si]):
        return f"gathers along the padded dim (axis {d})"
    return {0: axes[si]}


def index(node: Node, axes: Axes, sym: str) -> Result:
    """Advanced indexing ``self[idx0, idx1, ...]`` (integer index tensors): ``self``
    independent along the dims it does not index, the indices along all their dims
    (when ``self`` does not carry the padded dim). Boolean masks are not followed."""
    si = _idx(node, "self")
    refs = list(node.attrs.get("indices") or [])
    idx = [r.index if isinstance(r, TensorRef) else None for r in refs]
    if any(i is not None and node.inputs[i].desc.dtype.torch == torch.bool for i in idx):
        return "indexes with a boolean mask"
    ks = [k for k, i in enumerate(idx) if i is not None]
    width = max(_rank(node, i) for i in idx if i is not None)
    adjacent = ks == list(range(ks[0], ks[-1] + 1))
    start = ks[0] if adjacent else 0
    tainted = [i for i in idx if i is not None and i in axes]
    if si in axes:
        p = axes[si]
        if p in ks:   # self[arange(sym), ...]: each padded row picks itself
            own = idx[p]
            if own not in axes or not getattr(axes[own], "iota", False) or \
                    any(i in axes for i in idx if i not in (None, own)):
                return f"indexes the padded dim (axis {p})"
            return {0: start + axes[own] + width - _rank(node, own)}
        if tainted:
            return "both the tensor and its indices carry the padded dim"
        rest = sum(1 for k in range(p) if k not in ks)
        q = p if adjacent and p < ks[0] else (rest + width if not adjacent else p - len(ks) + width)
        return {0: q}
    pos = {axes[i] + width - _rank(node, i) for i in tainted}
    if len(pos) != 1:
        return "its indices carry the padded dim at different positions"
    return {0: start + pos.pop()}


def index_select(node: Node, axes: Axes, sym: str) -> Result:
    """``self`` independent along the dims other than ``dim``; padded indices give
    padded rows at ``dim``."""
    s, i = _idx(node, "self"), _idx(node, "index")
    d = _norm(int(node.attrs["dim"]), _rank(node, s))
    if s in axes and i in axes:
        return "both the table and the indices carry the padded dim"
    if s in axes:
        return {0: axes[s]} if axes[s] != d else f"selects along the padded dim (axis {d})"
    return {0: d}


def _list_axes(node: Node, axes: Axes) -> "int | str":
    ps = set(axes.values())
    return ps.pop() if len(ps) == 1 else "its inputs carry the padded dim at different positions"


def cat(node: Node, axes: Axes, sym: str) -> Result:
    """Independent along the dims it does not concatenate."""
    p = _list_axes(node, axes)
    if isinstance(p, str):
        return p
    d = _norm(int(node.attrs.get("dim", 0)), len(node.outputs[0].desc.shape))
    return {0: p} if p != d else "concatenates along the padded dim"


def stack(node: Node, axes: Axes, sym: str) -> Result:
    """Every dim independent; the new dim shifts the ones after it."""
    p = _list_axes(node, axes)
    if isinstance(p, str):
        return p
    d = _norm(int(node.attrs.get("dim", 0)), len(node.outputs[0].desc.shape))
    return {0: p + (d <= p)}


def constant_pad(node: Node, axes: Axes, sym: str) -> Result:
    """Independent along the dims it does not pad."""
    rank, p = _rank(node, 0), axes[0]
    pad = list(node.attrs.get("pad", ()))
    k = rank - 1 - p
    if 2 * k + 1 < len(pad) and (pad[2 * k] or pad[2 * k + 1]):
        return "pads the padded dim"
    return {0: p}


def repeat(node: Node, axes: Axes, sym: str) -> Result:
    """Independent along the dims repeated once."""
    reps = list(node.attrs["repeats"])
    q = axes[0] + len(reps) - _rank(node, 0)
    return {0: q} if reps[q] == 1 else "repeats along the padded dim"


def source(node: Node, axes: Axes, sym: str) -> Result:
    """A tensor made from nothing (arange, full): its value at an index does not depend
    on the size it is made with; it carries the padded dim where its shape does."""
    where = _carries(node.outputs[0].desc.shape, sym)
    sized = [k for k, v in node.attrs.items() if k not in ("size", "end", "self")
             and isinstance(v, SymExpr) and sym in symbols_of(v)]
    if sized or not where:
        return f"makes a value from the padded dim's size ({', '.join(sized) or 'its value'})"
    if len(where) != 1:
        return "makes a tensor whose shape uses the padded dim more than once"
    a = node.attrs
    iota = "end" in a and a.get("start", 0) == 0 and a.get("step", 1) == 1 and \
        not isinstance(a["end"], (int, float)) and as_expr(a["end"]) == parse(sym)
    return {0: Axis(where[0], 1, iota)}


# -- views -----------------------------------------------------------------------------

def _prod(dims) -> sympy.Expr:
    e = sympy.Integer(1)
    for d in dims:
        e *= as_expr(d)
    return sympy.expand(e)


def _whole_expr(e: sympy.Expr) -> bool:
    """``e`` is a product of dims (no fraction left)."""
    return sympy.fraction(sympy.cancel(e))[1] == 1


def reshape(node: Node, axes: Axes, sym: str) -> Result:
    """Followed through the shapes: the padded dim's rows keep the same number of
    elements before them (row-major), so it lands in the one output dim that has it,
    possibly merged with other dims (`Axis.outer`)."""
    src, dst = node.inputs[0].desc.shape, node.outputs[0].desc.shape
    p = axes.get(0)
    if p is None:
        return source(node, axes, sym) if set(axes) == set() else "reshapes by a tensor"
    s = parse(sym)
    before = sympy.expand(_prod(src[:p]) * outer_of(p))
    where = _carries(dst, sym)
    if len(where) == 1:
        q = where[0]
        outer = sympy.cancel(before / _prod(dst[:q]))
        inner = sympy.cancel(as_expr(dst[q]) / (outer * s))
        if _whole_expr(outer) and _whole_expr(inner) and s not in (
                outer.free_symbols | inner.free_symbols):
            return {0: Axis(q, outer)}
    return (f"reshapes {list(src)} -> {list(dst)} so the padded dim's rows cannot be "
            "followed")


def permute(node: Node, axes: Axes, sym: str) -> Result:
    """The padded dim moves where ``dims`` puts it."""
    rank = _rank(node, 0)
    dims = [_norm(d, rank) for d in node.attrs["dims"]]
    return {0: dims.index(axes[0])}


def transpose(node: Node, axes: Axes, sym: str) -> Result:
    """``dim0`` and ``dim1`` swap (``t``: the two dims of a matrix)."""
    rank, p = _rank(node, 0), axes[0]
    a = _norm(int(node.attrs.get("dim0", 0)), rank)
    b = _norm(int(node.attrs.get("dim1", 1)), rank)
    return {0: b if p == a else a if p == b else p}


def unsqueeze(node: Node, axes: Axes, sym: str) -> Result:
    """A new dim of size 1 shifts the ones after it."""
    d = _norm(int(node.attrs["dim"]), _rank(node, 0) + 1)
    return {0: axes[0] + (d <= axes[0])}


def squeeze(node: Node, axes: Axes, sym: str) -> Result:
    """Dims of size 1 removed before the padded dim shift it."""
    rank, p = _rank(node, 0), axes[0]
    dims = node.attrs.get("dim", list(range(rank)))
    dims = [dims] if isinstance(dims, int) else list(dims)
    shape = node.inputs[0].desc.shape
    gone = [_norm(d, rank) for d in dims if shape[_norm(d, rank)] == 1]
    return {0: p - sum(d < p for d in gone)}


def expand(node: Node, axes: Axes, sym: str) -> Result:
    """Broadcast: new leading dims shift the padded dim."""
    if 0 not in axes:
        return source(node, axes, sym)
    return {0: axes[0] + len(node.outputs[0].desc.shape) - _rank(node, 0)}


def _whole(node: Node, p: int) -> bool:
    """slice(start, end, step) takes the whole dim ``p``."""
    start, end = node.attrs.get("start"), node.attrs.get("end")
    step = node.attrs.get("step", 1)
    if start not in (None, 0) or step != 1:
        return False
    if end is None or (isinstance(end, int) and end >= _MAX_INT):
        return True
    return sympy.expand(as_expr(end) - as_expr(node.inputs[0].desc.shape[p])) == 0


def slice_(node: Node, axes: Axes, sym: str) -> Result:
    """Independent along the dims it does not slice (a whole-dim slice is free); a
    constant sliced to the padded dim's size from 0 is a `source`."""
    if 0 not in axes:
        start, step = node.attrs.get("start"), node.attrs.get("step", 1)
        return source(node, axes, sym) if start in (None, 0) and step == 1 \
            else "slices by the padded dim's size from another start"
    p = axes[0]
    d = _norm(int(node.attrs.get("dim", 0)), _rank(node, 0))
    return {0: p} if d != p or _whole(node, p) else "slices the padded dim"


def select(node: Node, axes: Axes, sym: str) -> Result:
    """Picking one index of another dim removes that dim."""
    p = axes[0]
    d = _norm(int(node.attrs["dim"]), _rank(node, 0))
    return {0: p - (d < p)} if d != p else "picks one index of the padded dim"


def split(node: Node, axes: Axes, sym: str) -> Result:
    """Independent along the dims it does not split."""
    p = axes[0]
    d = _norm(int(node.attrs.get("dim", 0)), _rank(node, 0))
    return {k: p for k in range(len(node.outputs))} if d != p else "splits the padded dim"


def same(node: Node, axes: Axes, sym: str) -> Result:
    """The output is the input (alias)."""
    return {0: axes[0]}


def describe(rule: Optional[Rule]) -> str:
    """One line for a rule (docs, reports): its docstring's first line or 'unknown'."""
    if rule is None:
        return "unknown"
    return (rule.__doc__ or rule.__name__).strip().splitlines()[0]


__all__ = ["Axis", "outer_of", "ALL", "offset", "REDUCE", "SOFTMAX", "CUMULATIVE", "LAYER_NORM", "BATCH_NORM_INFERENCE",
           "BATCH_NORM_TRAINING", "GROUP_NORM", "POOL", "RESIZE", "CONV", "CONV_ADD", "mm", "addmm", "bmm",
           "gated_mlp", "add_rms_norm", "rotary_mul", "attention", "kv_cache_update", "decode_attention", "decode_attention_kv_update", "embedding", "gather", "index", "index_select", "cat", "stack",
           "constant_pad", "repeat", "source", "reshape", "permute", "transpose", "unsqueeze",
           "squeeze", "expand", "slice_", "select", "split", "same", "describe"]
