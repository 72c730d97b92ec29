"""Costs of nodes on the virtual NPU: an `OpDef`'s ``device_cost["vnpu"]`` column is one of
these, ``f(node, spec) -> (KernelCost, model)`` with ``model`` the cost function's name.

All on the op's storage sizes, in its dtype, from the vnpu cost model
(``opencann.devices.vnpu.cost_model``):

- `conv` (Conv2D, ConvBiasAct, ConvAddAct) → ``conv2d_cost`` (groups g: GE's grouped
  FRACTAL_Z, G block-diagonal GEMMs on the Cube, see ``conv2d_cost``); `matmul` (MatMul, BatchMatMul,
  MatMulV2, LinearAct) → ``matmul_cost``; `flash_attention` → ``flash_attention_cost``;
  `attention` (unfused ScaledDotProductAttention) → QKᵀ ``matmul_cost`` + ``softmax_cost``
  (+ mask add) + PV ``matmul_cost``, the S×S scores going through HBM;
- `softmax` → ``softmax_cost``; `layernorm` → ``layernorm_cost``; `batchnorm` (inference,
  x·scale + shift) → ``elementwise_cost`` with 2 vector ops per element;
- `vector(key)` (elementwise ops) → ``elementwise_cost`` with the op's vector cost ``key``
  (a key of the cost model's VECTOR_OP_COST table);
- `reduction(key)` (reductions and pooling) → ``reduction_cost``; `trans_data` →
  ``trans_data_cost``;
- `copy` (data movement and creation ops, the default of OpKind DATA / CREATION) →
  ``elementwise_cost("copy")`` on the output (read + write; creation: write only);
- `fallback` (ops without a cost): memory-bound ``copy`` of its largest tensor, read by
  each input and written once.
"""
from __future__ import annotations

from typing import Callable, List, Tuple

from ...devices.vnpu import (KernelCost, NpuSpec, c0_for, conv2d_cost, elementwise_cost, flash_attention_cost,
                             fused_vector_cost, layernorm_cost, matmul_cost, reduction_cost, softmax_cost, trans_data_cost)
from ...ir import Format, Node, Value, numel

VnpuCost = Callable[[Node, NpuSpec], Tuple[KernelCost, str]]


def combine(op: str, parts: List[KernelCost]) -> KernelCost:
    """Kernels run one after another: times, FLOPs and bytes add; the bound is the
    bound of the longest part."""
    longest = max(parts, key=lambda c: c.time_us)
    return KernelCost(op, sum(c.time_us for c in parts), sum(c.flops for c in parts),
                      sum(c.useful_flops for c in parts), sum(c.hbm_bytes for c in parts), longest.bound,
                      {"parts": [c.op for c in parts]})


def _big_inputs(node: Node) -> List[Value]:
    return [v for v in node.inputs if v.desc.is_static and numel(v.desc.shape) > 1]


def trans_data(node: Node, spec: NpuSpec) -> Tuple[KernelCost, str]:
    """TransData: bytes moved by the MTE at the C0 burst of the source dtype."""
    s, out = node.inputs[0].desc, node.outputs[0].desc
    e = s.dtype.itemsize
    return trans_data_cost(numel(s.shape), numel(out.shape), out.dtype.value, burst_bytes=c0_for(s.dtype.torch) * e,
                           spec=spec), "trans_data_cost"


def conv(node: Node, spec: NpuSpec, epilogue: Tuple[str, ...] = (), out_dtype=None) -> Tuple[KernelCost, str]:
    """Conv2D and its fusions (attrs stride, padding, dilation, groups); ``epilogue``:
    Vector ops fused after the Cube (`conv2d_cost`'s argument, see `ub_epilogues`);
    ``out_dtype``: what the kernel writes when it is not the Cube's own result (a FixPipe
    dequantization, `cube_with_epilogue`)."""
    x, w = node.arg("input").desc, node.arg("weight").desc
    n, c, h, wd = (int(s) for s in x.origin_shape)
    cout, _, kh, kw = (int(s) for s in w.origin_shape)
    a = node.attrs
    g = int(a.get("groups", 1))
    dil = list(a.get("dilation", [1, 1]))
    k = ((kh - 1) * dil[0] + 1, (kw - 1) * dil[-1] + 1)
    return conv2d_cost(n, c, h, wd, cout, k, tuple(a["stride"]), tuple(a["padding"]),
                       x.dtype.value, spec, epilogue=epilogue, groups=g, out_dtype=out_dtype), \
        "conv2d_cost" + (f" (groups={g}: grouped FRACTAL_Z blocks)" if g != 1 else "")


def matmul(node: Node, spec: NpuSpec, epilogue: Tuple[str, ...] = (), out_dtype=None) -> Tuple[KernelCost, str]:
    """mm / bmm (self, mat2) and addmm-style (mat1, mat2) products, on origin shapes;
    ``epilogue`` and ``out_dtype`` as in `conv`."""
    names = ("mat1", "mat2") if "mat1" in node.attrs else ("self", "mat2")
    a_d, b_d = node.arg(names[0]).desc, node.arg(names[1]).desc
    a_s, b_s = a_d.origin_shape, b_d.origin_shape
    m, kdim, nn = int(a_s[-2]), int(a_s[-1]), int(b_s[-1])
    out = node.outputs[0].desc
    batch = numel(out.origin_shape[:-2]) if len(a_s) > 2 else 1
    return matmul_cost(m, nn, kdim, batch, a_d.dtype.value, spec, out_dtype=out_dtype, epilogue=epilogue), \
        "matmul_cost"


def _qk(node: Node):
    q, kk = node.arg("query").desc, node.arg("key").desc
    return q, numel(q.shape[:-2]), int(q.shape[-2]), int(q.shape[-1]), int(kk.shape[-2])


def flash_attention(node: Node, spec: NpuSpec) -> Tuple[KernelCost, str]:
    """FlashAttention: the S×S scores stay on chip."""
    q, bh, sq, d, sk = _qk(node)
    heads = int(q.shape[-3]) if q.rank >= 3 else 1
    return flash_attention_cost(bh // heads, heads, sq, sk, d, node.outputs[0].desc.dtype.value,
                                causal=bool(node.attrs.get("causal")), spec=spec), "flash_attention_cost"


def attention(node: Node, spec: NpuSpec) -> Tuple[KernelCost, str]:
    """Unfused SDPA: QKᵀ, softmax (+ mask add), PV with the S×S scores in HBM."""
    _, bh, sq, d, sk = _qk(node)
    dt = node.outputs[0].desc.dtype.value
    parts = [matmul_cost(sq, sk, d, bh, dt, spec), softmax_cost(bh * sq, sk, dt, spec),
             matmul_cost(sq, d, sk, bh, dt, spec)]
    if node.attrs.get("attn_mask") is not None:
        parts.insert(1, elementwise_cost("add", bh * sq * sk, dt, 2, spec))
    return combine("attention", parts), "matmul_cost+softmax_cost (S×S scores in HBM)"


def softmax(node: Node, spec: NpuSpec) -> Tuple[KernelCost, str]:
    """(Log)softmax over ``dim``."""
    out = node.outputs[0].desc
    cols = int(out.shape[node.attrs.get("dim", -1)])
    return softmax_cost(numel(out.shape) // cols, cols, out.dtype.value, spec), "softmax_cost"


def layernorm(node: Node, spec: NpuSpec) -> Tuple[KernelCost, str]:
    """LayerNorm over ``normalized_shape``."""
    out = node.outputs[0].desc
    cols = numel(node.attrs["normalized_shape"])
    return layernorm_cost(numel(out.shape) // cols, cols, out.dtype.value, spec), "layernorm_cost"


def batchnorm(node: Node, spec: NpuSpec) -> Tuple[KernelCost, str]:
    """Inference BatchNorm, x·scale + shift: 2 vector ops/element, like clamp's entry."""
    out = node.outputs[0].desc
    return elementwise_cost("clamp", numel(out.shape), out.dtype.value, 1, spec), "elementwise_cost (2 ops/elem)"


def vector(key: str) -> VnpuCost:
    """Elementwise op costing ``key`` (VECTOR_OP_COST) per element, one read per
    full-size input."""
    def cost(node: Node, spec: NpuSpec) -> Tuple[KernelCost, str]:
        out = node.outputs[0].desc
        n_in = max(1, len(_big_inputs(node)))
        return elementwise_cost(key, max(1, numel(out.shape)), out.dtype.value, n_in, spec), "elementwise_cost"
    cost.vector_key = key
    return cost


def quant(node: Node, spec: NpuSpec) -> Tuple[KernelCost, str]:
    """AscendQuant / AscendDequant: one full-size read at the input's dtype and one write at
    the output's (each on its storage size: fp16 → int8 reads 2 B and writes 1 B per
    element), one "mul" per element on the Vector unit at the wider dtype; a per-channel
    ``deq_scale`` / ``bias`` ([C], read into UB once) is no full-size input."""
    x, out = node.inputs[0].desc, node.outputs[0].desc
    dt = max((x.dtype, out.dtype), key=lambda d: d.itemsize).value
    n = max(1, numel(out.shape))
    return fused_vector_cost(n, 1.0, max(1, numel(x.shape)) * x.dtype.itemsize, n * out.dtype.itemsize, dt, spec), \
        "fused_vector_cost (quantization)"


def reduction(key: str) -> VnpuCost:
    """Reduction / pooling of input 0 combining with ``key`` (add, max, min)."""
    def cost(node: Node, spec: NpuSpec) -> Tuple[KernelCost, str]:
        x, out = node.inputs[0].desc, node.outputs[0].desc
        n_in, n_out = max(1, numel(x.shape)), max(1, numel(out.shape))
        return reduction_cost(n_in, min(n_in, n_out), x.dtype.value, key, spec), "reduction_cost"
    cost.vector_key = key
    return cost


def copy(node: Node, spec: NpuSpec, reads: int = 1) -> Tuple[KernelCost, str]:
    """Data movement: read ``reads`` times and write the output once."""
    out = node.outputs[0].desc
    return elementwise_cost("copy", max(1, numel(out.shape)), out.dtype.value, reads, spec), \
        "elementwise_cost(copy)"


def create(node: Node, spec: NpuSpec) -> Tuple[KernelCost, str]:
    """Creation ops: write the output once."""
    return copy(node, spec, reads=0)


def fallback(node: Node, spec: NpuSpec) -> Tuple[KernelCost, str]:
    """No cost function: memory-bound copy of the largest tensor."""
    sizes = [numel(v.desc.shape) for v in (*node.inputs, *node.outputs) if v.desc.is_static]
    return elementwise_cost("copy", max([1] + sizes), node.outputs[0].desc.dtype.value,
                            max(1, len(_big_inputs(node))), spec), "fallback: elementwise_cost(copy)"


__all__ = ["VnpuCost", "attention", "batchnorm", "combine", "conv", "copy", "create", "fallback", "quant",
           "flash_attention", "layernorm", "matmul", "reduction", "softmax", "trans_data", "vector"]


def gated_mlp(node: Node, spec: NpuSpec) -> Tuple[KernelCost, str]:
    """GatedMLP(x [M, K], w1, w3 [K, N]): two Cube GEMMs, the second with SiLU and the
    product as Vector epilogue on its output (GE's post-processing), no HBM round trip."""
    x, w = node.inputs[0].desc, node.inputs[1].desc
    m, k, n = int(x.origin_shape[0]), int(x.origin_shape[1]), int(w.origin_shape[1])
    dt = x.dtype.value
    parts = [matmul_cost(m, n, k, 1, dt, spec),
             matmul_cost(m, n, k, 1, dt, spec, epilogue=("silu", "mul"))]
    return combine("gated_mlp", parts), "matmul_cost x2 (silu, mul epilogue)"


__all__ += ["gated_mlp"]


# -- UB epilogue fusion (estimate only: no graph rewrite) -------------------------------------

UB_EPILOGUE = "vnpu_ub_epilogue"
"""Name of the virtual rewrite: GE's UB fusion of a Cube kernel with the elementwise ops
after it (bias Add, Relu, residual Add), applied by the estimate's costing only."""


def _cube_fn(node: Node):
    from ..opdef import get_op
    fn = get_op(node.op).device_cost.get("vnpu")
    return fn if fn in (conv, matmul) else None


EPILOGUE_ACTIVATIONS = ("relu", "gelu", "tanh", "sigmoid", "silu")
"""Activations a Cube epilogue takes (an op's ``activation`` column); GELU's tanh form is the
role 'gelu_tanh' (costed as 'gelu')."""


def _epilogue_role(node: Node, prev: Value) -> Tuple[str, str]:
    """(role, "") when ``node`` can run as the Cube epilogue on ``prev`` (role 'bias',
    'add' or an activation of `EPILOGUE_ACTIVATIONS`, 'gelu_tanh' for GELU's tanh form),
    else ("", why not)."""
    from ..opdef import get_op
    out = node.outputs[0].desc
    if len(node.outputs) != 1 or tuple(out.shape) != tuple(prev.desc.shape) or out.dtype != prev.desc.dtype:
        return "", f"{node.name} ({node.op}) changes the shape or dtype"
    act = get_op(node.op).activation
    if act in EPILOGUE_ACTIVATIONS and len(node.inputs) == 1:
        return ("gelu_tanh" if act == "gelu" and node.attrs.get("approximate") == "tanh" else act), ""
    if node.op == "Add" and node.attrs.get("alpha", 1) == 1 and len(node.inputs) == 2:
        other = node.inputs[1] if node.inputs[0] is prev else node.inputs[0]
        if other is prev:
            return "", f"{node.name} adds the output to itself"
        if tuple(other.desc.shape) == tuple(out.shape):
            return "add", ""
        if other.desc.is_static and numel(other.desc.shape) < numel(out.shape):
            return "bias", ""
    return "", f"{node.name} ({node.op}) is not a bias Add, an activation or a residual Add"


RESHAPES = ("Reshape", "UnsafeReshape", "ReshapeCopy")


FIXPIPE_ROLES = ("dequant", "deq_bias", "quant")
"""Epilogue roles the FixPipe runs on the Cube's int32 result on its way out of L0C (where
``NpuSpec.fixpipe_quant``): 'dequant' (an AscendDequant with a per-channel deq_scale) first,
'deq_bias' (that AscendDequant's bias), 'quant' (the next int8 layer's AscendQuant:
requantization) last."""


def _fixpipe_link(nxt: Node, prev: Value, first: bool) -> str:
    """'dequant' / 'quant' when ``nxt`` is the FixPipe's part of the chain at this point
    (first link: an AscendDequant of the int32 result with a deq_scale input; later: an
    AscendQuant to int8 reading ``prev``), else ""."""
    if nxt.inputs[0] is not prev:
        return ""
    if first and nxt.op == "AscendDequant" and "deq_scale" in nxt.attrs and prev.desc.dtype.value == "int32":
        return "dequant"
    if not first and nxt.op == "AscendQuant" and nxt.outputs[0].desc.dtype.value == "int8":
        return "quant"
    return ""


def _chain(node: Node, outputs: set, taken: dict, fixpipe: bool = False) -> Tuple[List[Tuple[Node, str]], str]:
    """The epilogue chain after Cube node ``node``: [(absorbed node, role)] and why it stops
    at its first link ("" when a link was found or the consumer is not an epilogue op). A
    reshape of a 2-D MatMul's ND result ([B·S, N] → [B, S, N], a Linear in a transformer) is
    followed as role 'reshape' (free in ND) when an epilogue op comes after it. With
    ``fixpipe`` an int32 result's AscendDequant is the first link ('dequant') and an
    AscendQuant to int8 after it the last ('quant'); these do not count against the three
    Vector links."""
    chain: List[Tuple[Node, str]] = []
    prev = node.outputs[0]
    while True:
        real = [c for c in chain if c[1] != "reshape"]
        if id(prev) in outputs:
            return _trim(chain), "" if real else "its output is a graph output"
        users = list(dict.fromkeys(prev.users))
        if len(users) != 1:
            return _trim(chain), "" if real or not users else f"its output has {len(users)} consumers " \
                f"({', '.join(u.name for u in users)}), so it must be written to HBM"
        nxt = users[0]
        fix = _fixpipe_link(nxt, prev, not chain) if fixpipe and nxt not in taken else ""
        if fix and (fix == "dequant" or any(r == "dequant" for _, r in chain)):
            chain.append((nxt, fix))
            if fix == "quant":
                return chain, ""
            prev = nxt.outputs[0]
            continue
        if nxt.op in RESHAPES and node.op in ("MatMul", "MatMulV2") and prev.desc.format == Format.ND \
                and nxt.inputs[0] is prev and nxt not in taken:
            chain.append((nxt, "reshape"))
            prev = nxt.outputs[0]
            continue
        role, why = _epilogue_role(nxt, prev)
        if not role or nxt in taken or len([c for c in real if c[1] not in FIXPIPE_ROLES]) >= 3:
            busy = (f"{nxt.name} is fused into {taken[nxt].name}'s epilogue, which reads this output as its "
                    f"residual" if nxt in taken else "")
            return _trim(chain), "" if real or not (busy or nxt.op == "Add" or _is_act(nxt)) else (busy or why)
        chain.append((nxt, role))
        prev = nxt.outputs[0]


def _trim(chain: List[Tuple[Node, str]]) -> List[Tuple[Node, str]]:
    """``chain`` without trailing reshapes (a reshape alone is no epilogue)."""
    while chain and chain[-1][1] == "reshape":
        chain.pop()
    return chain


def _is_act(node: Node) -> bool:
    from ..opdef import get_op
    return get_op(node.op).activation in EPILOGUE_ACTIVATIONS


def ub_epilogues(graph, fixpipe: bool = False) -> Tuple[dict, dict, dict]:
    """GE's UB fusion on a vnpu graph (after layout): each Conv/MatMul-family node (cost
    `conv` / `matmul`) whose output has one consumer that is a bias Add (a smaller constant
    broadcast), a Relu or a residual Add (same shape and dtype), each link with one
    consumer, takes that chain (at most 3 ops) as its Cube epilogue; an activation of
    `EPILOGUE_ACTIVATIONS` (GELU, SiLU, Tanh, Sigmoid) is a link as Relu is. ``fixpipe``
    (``NpuSpec.fixpipe_quant``): an int8 Cube node's AscendDequant and a following
    AscendQuant join the chain (`FIXPIPE_ROLES`, see `_chain`). Returns
    (cube node -> epilogue roles, absorbed node -> cube node, cube node -> why not fused)."""
    outputs = {id(v) for v in graph.outputs}
    epi, absorbed, why_not = {}, {}, {}
    for n in graph.nodes:
        if _cube_fn(n) is None or len(n.outputs) != 1:
            continue
        chain, why = _chain(n, outputs, absorbed, fixpipe)
        if chain:
            epi[n] = tuple(role for _, role in chain)
            absorbed.update({a: n for a, _ in chain})
        elif why:
            why_not[n] = why
    return epi, absorbed, why_not


def cube_with_epilogue(node: Node, spec: NpuSpec, epilogue: Tuple[str, ...]) -> Tuple[KernelCost, str]:
    """Cost of Cube node ``node`` with ``epilogue`` (roles 'bias', 'add', an activation) fused:
    `conv` / `matmul` with the cost model's ``epilogue`` argument ('gelu_tanh' costs as 'gelu',
    'reshape' is free). The `FIXPIPE_ROLES` cost no Vector work (the FixPipe converts while
    L0C drains, [FIXPIPE-A2] in ``devices/vnpu/presets.py``): with them the kernel writes
    ``node``'s output dtype (fp16 / fp32 after a dequant, int8 after a requant) instead of
    the int32 accumulator."""
    fix = [r for r in epilogue if r in FIXPIPE_ROLES]
    epilogue = tuple("gelu" if r == "gelu_tanh" else r for r in epilogue if r != "reshape" and r not in FIXPIPE_ROLES)
    out_dtype = node.outputs[0].desc.dtype.value if fix else None
    c, model = _cube_fn(node)(node, spec, epilogue, out_dtype)
    return c, f"{model} + {'fixpipe(' + ', '.join(fix) + ') + ' if fix else ''}epilogue({', '.join(epilogue)})"


__all__ += ["EPILOGUE_ACTIVATIONS", "FIXPIPE_ROLES", "UB_EPILOGUE", "cube_with_epilogue", "ub_epilogues"]


def fused_elementwise(node: Node, spec: NpuSpec) -> Tuple[KernelCost, str]:
    """FusedElementwise: ONE Vector kernel over the group's domain (attr ``shape``), the
    member ops' vector costs per element added (attr ``ops``: their op names; each op's
    ``vector(key)`` / ``reduction(key)`` cost names its key), reading each input and
    writing each output to HBM once (`fused_vector_cost`)."""
    from ...devices.vnpu.cost_model import VECTOR_OP_COST
    from ..opdef import get_op
    dom = max(1, numel(node.attrs["shape"]))
    ops = 0.0
    for name in node.attrs["ops"]:
        key = getattr(get_op(name).device_cost.get("vnpu"), "vector_key", "copy")
        ops += VECTOR_OP_COST[key]

    def nbytes(v: Value) -> int:
        return max(1, numel(v.desc.shape)) * v.desc.dtype.itemsize
    read = sum(nbytes(v) for v in node.inputs)
    write = sum(nbytes(o) for o in node.outputs)
    dt = max((o.desc.dtype for o in node.outputs), key=lambda d: d.itemsize).value
    return fused_vector_cost(dom, max(ops, 1.0), read, write, dt, spec), \
        "fused_vector_cost (one Vector kernel, HBM once)"


__all__ += ["fused_elementwise"]


# -- LLM decode: the KV cache as graph state ----------------------------------------------

def _nbytes(v: Value) -> int:
    return numel(v.desc.shape) * v.desc.dtype.itemsize


def scatter_update(node: Node, spec: NpuSpec) -> Tuple[KernelCost, str]:
    """KvCacheUpdate (``torch_npu.scatter_update_``): a memory-bound copy of the new keys
    or values (input ``new`` [B, Hkv, T, D]) into the cache in place: ``new`` and
    ``positions`` read from HBM once, the same bytes written into the cache; the rest of
    the cache is neither read nor written (`fused_vector_cost`, one copy per element)."""
    new = node.arg("new")
    moved = _nbytes(new)
    return fused_vector_cost(max(1, numel(new.desc.shape)), 1.0, moved + _nbytes(node.arg("positions")),
                             moved, new.desc.dtype.value, spec), "fused_vector_cost (scatter copy, HBM once)"


def decode_attention(node: Node, spec: NpuSpec) -> Tuple[KernelCost, str]:
    """DecodeAttention (``npu_incre_flash_attention``: one query per sequence): memory-bound
    on the KV cache. HBM: K and V [B, Hkv, S_max, D] read once (each KV head once for its
    GQA group of query heads; the whole S_max, an upper bound: the live lengths are data),
    q and lengths read, the output written. Vector: per query head and cached key, D
    multiply-adds for q·k and D for p·v (4 ops per element of B·Hq·S_max·D); one
    `fused_vector_cost` kernel, the scores never leave the chip."""
    q, k = node.arg("query"), node.arg("key")
    b, hq, d = int(q.desc.shape[0]), int(q.desc.shape[1]), int(q.desc.shape[-1])
    s = int(k.desc.shape[-2])
    read = sum(_nbytes(v) for v in node.inputs)
    return fused_vector_cost(max(1, b * hq * s * d), 4.0, read, _nbytes(node.outputs[0]),
                             "float32", spec), "fused_vector_cost (KV cache read once, scores on chip)"


__all__ += ["decode_attention", "scatter_update"]
