"""`OpDef` and the operator registry (CANN's operator library, "compute services").

Every IR op is described by one `OpDef`: its schema (taken from the ATen overload it
implements, so attribute names are PyTorch's), shape/dtype inference (run on meta
tensors), flags, a cost function (FLOPs and bytes moved), a reference implementation
and its kernels per device. Kernels of aten-backed ops call the ATen overload; when an
``.out`` overload exists the runtime writes straight into the planned arena buffer.
"""
from __future__ import annotations

import enum
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..devices import KINDS, parse_device
from ..ir import DataType, Node, TensorDesc, TensorListRef, TensorRef, numel


class OpKind(enum.Enum):
    """The class of an op. It decides the default `OpDef.cost` (VIEW: nothing;
    REDUCTION: FLOPs per input element; DATA, CREATION: bytes only), view-ness (VIEW
    outputs alias their input and get no ``.out`` kernel), mixed precision (MATMUL, CONV,
    ATTENTION are lowered; ELEMENTWISE, VIEW, DATA follow their inputs), the vnpu estimate
    of DATA/CREATION ops without a ``device_cost`` (copy / fill), and constant folding
    (FUSED nodes are never folded)."""

    ELEMENTWISE = "elementwise"
    REDUCTION = "reduction"
    MATMUL = "matmul"
    CONV = "conv"
    NORM = "norm"
    POOL = "pool"
    VIEW = "view"          # output aliases the input's storage (see ``OpDef.aliases``)
    DATA = "data"          # copies / gathers / concatenations
    CREATION = "creation"  # tensors made from nothing (arange, full)
    ATTENTION = "attention"
    FUSED = "fused"
    FALLBACK = "fallback"


@dataclass
class Cost:
    """Work of one node: floating-point operations and bytes read + written."""

    flops: int = 0
    bytes: int = 0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.bytes + other.bytes)


@dataclass
class OpDef:
    """One operator of the library: every per-op fact is a column here.

    ``aten``: the ATen overload it implements (None for opencann's own fused ops).
    ``flops_per_elem``: elementwise/reduction work per output (or input) element.
    ``inplace_ok``: the output may share the buffer of input 0 (same size and dtype).
    ``random``: the op draws from torch's RNG (set at `register` from the ATen overload's
    ``nondeterministic_seeded`` tag); see `is_random` for the per-node fact.
    ``kernels``: device kind ("cpu", "vnpu") -> callable taking the ATen-style args
    (positional and keyword, as ``aten``'s schema orders them; tensors in, tensors out).
    ``cpu`` defaults to ``aten``; a kernel given here replaces it (the executor calls it,
    and no ``.out`` overload is used for that device). A device without an entry runs
    the ``cpu`` kernel on the host.
    ``kernel_factories``: device kind -> bind-time factory ``f(node, in_descs, consts)
    -> callable(*inputs)`` (inputs in ``node.inputs`` order); consulted before
    ``kernels``. The callable must keep no per-call state: it is shared by concurrent
    calls (threads). Kernels live in ``ops/kernels/{cpu,vnpu}.py``.
    ``out_capable``: predicate on a node, True when the factory's kernel accepts
    ``out=`` (the planned arena buffer; for a node of several outputs, the tuple of their
    buffers, None for an output written into an input in place (``inplace_of``); the
    kernel fills them and returns its outputs as a tuple).
    ``kernel_per_shape``: the kernel the factory chooses (``node.meta["kernel"]``) holds
    for the node's shape only (attention: `opencann.ops.kernels.attention_cpu`); a dynamic
    model chooses it again per shape (`opencann.engine.dynamic.pin_kernel_choices` skips it).
    ``out_kernel``: the ``.out`` overload, when one exists, for arena binding.
    ``out_contiguous``: the operands of ``out_kernel`` (schema argument names: inputs or
    outputs) it reads or writes correctly only when they are contiguous, where the
    functional overload takes any strides (an ATen kernel that walks the tensor as if it
    were row-major): the runtime makes such an input contiguous before the call and
    calls the functional overload (its result copied into the buffer) when such an
    output's buffer is not contiguous. See `out_buffers_fit`; the table and its evidence
    are ``ops/library.py``'s ``_OUT_CONTIGUOUS``.
    ``aliases``: per return of the op, the names of the arguments whose storage that
    return may share (a view, or an input handed back as is); ``()`` for a return that
    is always fresh memory; the last entry also covers any further outputs (a
    ``Tensor[]`` return such as split's). Derived from the ATen schema's alias
    annotations at registration (``view(Tensor(a) self, ...) -> Tensor(a)``) unless
    declared; ``None`` (an op without an ATen overload that declares nothing) means
    unknown: every output may alias every tensor input. See `output_aliases`.
    ``primary_only``: the op that computes output 0 alone from the same attributes,
    cheaper because it skips the others (max.dim's indices ⇒ amax); the pass
    ``drop_unused_outputs`` runs it instead when no other output is read (inference).
    ``cost_fn``: FLOPs and bytes of a node (default: from ``kind`` and
    ``flops_per_elem``, see `cost`).
    ``device_cost``: device kind -> time model of a node on that device, ``f(node,
    spec) -> (KernelCost, cost-function name)`` (vnpu: ``ops/kernels/vnpu_cost.py``).
    ``npu_format``: how the op runs in NPU storage formats on the vnpu: "conv",
    "matmul", "elementwise", "channelwise", "lastaxis" (a last-axis norm or softmax that also
    takes FRACTAL_NZ), "quant" (AscendQuant / AscendDequant: the storage format of their
    int8 Cube neighbour), or None (ND only).
    ``channels_last``: the op's ATen CPU kernel follows a channels-last (NHWC) input,
    writing its 4-D result channels-last too (elementwise ops, pooling, H/W reductions,
    inference BatchNorm, ATen convolution); the CPU layout stage keeps NHWC through
    it (`opencann.passes.layout.cpu_layout`).
    ``keep_fp32``: mixed precision keeps it in fp32 (softmax, norms, reductions,
    exp/log/pow...; `MixedPrecision`'s default keep-list).
    ``fused_from``: for a fused op, the pre-fusion op types that stand in its place when
    mixed precision runs (stage 1, before fusion): ``options["keep_fp32"]`` naming the
    fused op keeps these (LinearAct -> MatMulV2, MatMul: every GEMM with a constant weight
    becomes a LinearAct, with or without a bias). Empty for an op that is not fused, or whose parts also run unfused
    (FusedElementwise, GatedMLP): naming it is refused with the parts to name instead.
    ``precision_keeps``: inputs (schema argument names) mixed precision never casts to
    fp16/bf16 when it lowers the op, because the op takes them in fp32 and a cast would
    change their meaning (SDPA's additive ``attn_mask``: transformers fills it with
    ``finfo(float32).min``, -inf in fp16/bf16; ATen adds a float mask to low-precision
    scores in fp32).
    ``activation``: the activation the op is, as the fused CPU kernels name it
    ("relu", "gelu", "tanh", "sigmoid", "silu"), or None.
    ``fuse_expr``: how `FusedElementwise` computes the op per element, in its neutral
    expression syntax (``"maximum({self}, {other})"``: schema argument names in braces,
    ``#1`` the number 1 in the op's compute dtype; `opencann.ops.kernels.ew_program`),
    or a function of the node's attrs giving that text (None: not fusable with those
    attrs); None for ops the elementwise fusion must not take (rounding, NaN handling or
    randomness it would change).
    ``inplace_of``: output index -> the schema argument (input) the kernel writes that
    output into, in place, returning that input: the output *is* the input's memory after
    the write (KvCacheUpdate's ``{0: "cache"}``, torch_npu's ``scatter_update_``). Memory
    planning gives such an output no buffer, scheduling puts every reader of the input's
    old contents before the write (readers of the new contents read the output), and a
    graph input written so is the caller's tensor, written directly (no copy-back:
    TorchAir's ``input_inplace_pass``). See `inplace_inputs`.
    ``custom_op`` / ``custom_op_args``: the torch custom op (qualified name,
    ``"opencann::decode_attention"``) the torch frontend captures as this op, and the
    renames of its schema arguments to this op's attribute names (``{"q": "query"}``);
    see `lookup_custom_op`.
    ``fp32_kernel``: the kernels compute in fp32 only (DecodeAttention's numba kernel):
    every precision mode keeps the op in fp32, ``force_fp16`` included.
    ``reads_layout``: the result depends on the input's memory layout (strides, storage
    offset), not only on its values (``as_strided``); see `reads_layout` for the per-node
    fact. A call whose input is made contiguous must not reach such an op.
    ``per_index``: along which dims the op is independent per index, as a rule that
    follows a padded dim through a node (`opencann.ops.per_index`: ``rule(node, axes,
    sym) -> {output: axis}`` or the reason padding could change its results); None:
    unknown, which blocks gear padding (host fallbacks, custom ops). Elementwise ops:
    every dim; Linear/Conv/pooling: the batch; softmax/norms: the dims they do not
    normalise; reductions: the dims they keep. Gear padding (`opencann.engine.gears`) uses it.
    View-ness is ``kind == OpKind.VIEW`` (`is_view`).
    """

    name: str
    kind: OpKind
    aten: Optional[torch._ops.OpOverload] = None
    flops_per_elem: float = 1.0
    inplace_ok: bool = False
    random: bool = False
    kernels: Dict[str, Callable] = field(default_factory=dict)
    kernel_factories: Dict[str, Callable] = field(default_factory=dict)
    out_capable: Optional[Callable[[Node], bool]] = None
    kernel_per_shape: bool = False
    out_kernel: Optional[torch._ops.OpOverload] = None
    out_names: Tuple[str, ...] = ()
    out_contiguous: Tuple[str, ...] = ()
    aliases: Optional[Tuple[Tuple[str, ...], ...]] = None
    cost_fn: Optional[Callable[[Node], Cost]] = None
    primary_only: Optional[str] = None
    device_cost: Dict[str, Callable] = field(default_factory=dict)
    npu_format: Optional[str] = None
    channels_last: bool = False
    keep_fp32: bool = False
    fused_from: Tuple[str, ...] = ()
    precision_keeps: Tuple[str, ...] = ()
    activation: Optional[str] = None
    fuse_expr: Any = None
    per_index: Optional[Callable] = None
    reads_layout: bool = False
    inplace_of: Dict[int, str] = field(default_factory=dict)
    custom_op: Optional[str] = None
    custom_op_args: Dict[str, str] = field(default_factory=dict)
    fp32_kernel: bool = False
    doc: str = ""

    @property
    def reference(self) -> Callable:
        """Reference implementation: the eager ATen op itself."""
        return self.aten

    @property
    def is_view(self) -> bool:
        """The output aliases the input's storage (no kernel work)."""
        return self.kind == OpKind.VIEW

    def kernel_factory(self, device: str) -> Optional[Callable]:
        """The bind-time kernel factory for a node on ``device`` (a device string): the
        device kind's, else the host's (``cpu``), else None."""
        kind = parse_device(device, load=False).kind
        return self.kernel_factories.get(kind) or self.kernel_factories.get("cpu")

    def kernel(self, device: str) -> Optional[Callable]:
        """The ATen-style kernel for a node on ``device``: the device kind's entry of
        ``kernels``, else the host's (``cpu``), else ``aten`` (None for a host fallback,
        whose overload is the node's ``meta["aten"]``)."""
        kind = parse_device(device, load=False).kind
        return self.kernels.get(kind) or self.kernels.get("cpu") or self.aten

    def writes_out(self, node: Node) -> bool:
        """True when ``node``'s factory kernel takes ``out=`` (`out_capable`)."""
        return self.out_capable is not None and bool(self.out_capable(node))

    def cost(self, node: Node) -> Cost:
        """FLOPs and bytes read + written of ``node`` (``cost_fn``, else from ``kind``)."""
        if self.cost_fn is not None:
            return self.cost_fn(node)
        if self.kind in (OpKind.VIEW,):
            return Cost(0, 0)
        moved = sum(_nbytes(v.desc) for v in node.inputs) + \
            sum(_nbytes(o.desc) for o in node.outputs)
        if self.kind == OpKind.REDUCTION:
            n = sum(numel(v.desc.shape) for v in node.inputs[:1] if v.desc.is_static)
        else:
            n = sum(numel(o.desc.shape) for o in node.outputs[:1] if o.desc.is_static)
        flops = 0 if self.kind in (OpKind.DATA, OpKind.CREATION) else int(n * self.flops_per_elem)
        return Cost(flops, moved)


def _nbytes(d: TensorDesc) -> int:
    return numel(d.shape) * d.dtype.itemsize if d.is_static else 0


# Stand-in description of an output a multi-output op does not produce (a gradient op's
# ``output_mask`` False): never planned; the kernel returns None there.
SKIPPED_OUTPUT = TensorDesc((0,), DataType.FLOAT)

_REGISTRY: Dict[str, OpDef] = {}
_BY_ATEN: Dict[torch._ops.OpOverload, OpDef] = {}
_BY_CUSTOM: Dict[str, OpDef] = {}


def _find_out_overload(op: torch._ops.OpOverload) -> Tuple[Optional[torch._ops.OpOverload], Tuple[str, ...]]:
    """The ``.out`` overload whose non-out arguments equal ``op``'s, if any."""
    packet = op.overloadpacket
    base = op._overloadname
    cands = [f"{base}_out", "out"] if base != "default" else ["out", "grad_input"]
    if base.startswith("dim_"):
        cands.insert(0, base[4:] + "_out")
    want = [a.name for a in op._schema.arguments]
    for c in cands:
        if c not in packet.overloads():
            continue
        o = getattr(packet, c)
        args = [a for a in o._schema.arguments if not a.is_out]
        outs = tuple(a.name for a in o._schema.arguments if a.is_out)
        if [a.name for a in args] == want and len(outs) == len(op._schema.returns):
            return o, outs
    return None, ()


def register(opdef: OpDef) -> OpDef:
    """Add an op to the registry. Raises ValueError on a duplicate name, overload or
    ``custom_op``, a ``kernels`` / ``kernel_factories`` / ``device_cost`` key that is
    not a device kind (naming the kinds), or an ``out_contiguous`` name that is no
    argument of the op's ``.out`` overload."""
    if opdef.name in _REGISTRY:
        raise ValueError(f"op {opdef.name} is registered twice")
    if opdef.custom_op is not None:
        if opdef.custom_op in _BY_CUSTOM:
            raise ValueError(f"custom op {opdef.custom_op} is already captured as "
                             f"{_BY_CUSTOM[opdef.custom_op].name}")
        _BY_CUSTOM[opdef.custom_op] = opdef
    for col in ("kernels", "kernel_factories", "device_cost"):
        bad = [k for k in getattr(opdef, col) if k not in KINDS]
        if bad:
            raise ValueError(f"op {opdef.name}: {col} has device {bad[0]!r}; device kinds are "
                             f"{list(KINDS)} (e.g. {col}={{'cpu': fn}})")
    if opdef.aten is not None:
        if opdef.aten in _BY_ATEN:
            raise ValueError(f"{opdef.aten} is already implemented by {_BY_ATEN[opdef.aten].name}")
        own_cpu = opdef.kernels.get("cpu") not in (None, opdef.aten)
        if opdef.out_kernel is None and opdef.kind != OpKind.VIEW and not own_cpu:
            opdef.out_kernel, opdef.out_names = _find_out_overload(opdef.aten)
        _check_out_contiguous(opdef)
        _BY_ATEN[opdef.aten] = opdef
        opdef.kernels.setdefault("cpu", opdef.aten)
        opdef.random = opdef.random or seeded(opdef.aten)
        if opdef.aliases is None:
            opdef.aliases = schema_aliases(opdef.aten)
    else:
        _check_out_contiguous(opdef)
    _REGISTRY[opdef.name] = opdef
    return opdef


def _check_out_contiguous(opdef: OpDef) -> None:
    """Raise ValueError for an ``out_contiguous`` name that is no argument of the op's
    ``.out`` overload (or an op without one), naming the arguments."""
    if not opdef.out_contiguous:
        return
    names = [a.name for a in opdef.out_kernel._schema.arguments] if opdef.out_kernel else []
    bad = [n for n in opdef.out_contiguous if n not in names]
    if bad:
        raise ValueError(f"op {opdef.name}: out_contiguous names {bad[0]!r}, not an argument of "
                         f"its .out overload (arguments: {names or 'none, it has no .out overload'})")


def out_contiguous_inputs(opdef: OpDef) -> Tuple[str, ...]:
    """The input arguments (schema names) ``opdef.out_kernel`` needs contiguous
    (``out_contiguous`` less the outputs)."""
    return tuple(n for n in opdef.out_contiguous if n not in opdef.out_names)


def out_buffers_fit(opdef: OpDef, buffers: Sequence[Optional[torch.Tensor]]) -> bool:
    """Whether ``opdef.out_kernel`` writes ``buffers`` (one per ``out_names``, any device,
    meta included; None for a skipped output) correctly: False when a buffer that
    ``out_contiguous`` names is not contiguous (the functional overload must run instead,
    its result copied into the buffer)."""
    return not any(name in opdef.out_contiguous and b is not None and not b.is_contiguous()
                   for name, b in zip(opdef.out_names, buffers))


def seeded(target: Any) -> bool:
    """True for an ATen overload tagged ``nondeterministic_seeded`` (it draws from torch's
    RNG: rand*, randn*, randint*, randperm, bernoulli, normal, multinomial, dropout...)."""
    return isinstance(target, torch._ops.OpOverload) and \
        torch.Tag.nondeterministic_seeded in target.tags


# Literal arguments that switch a seeded op's randomness off: SDPA / fused attention
# with ``dropout_p=0``, ``native_dropout(train=False)``, ``rrelu_with_noise(training=False)``.
_RANDOMNESS_OFF = (("dropout_p", 0.0), ("train", False), ("training", False))


def is_random_call(target: Any, args: Dict[str, Any], flagged: bool = False) -> bool:
    """True when calling ``target`` (an ATen overload or None) with ``args`` (schema
    argument name -> value; tensors may be any stand-in) draws from torch's RNG:
    ``flagged`` (an OpDef's ``random``) or the overload is `seeded`, unless a literal
    argument of `_RANDOMNESS_OFF` (given, or omitted and defaulted) turns the draw off."""
    od = _BY_ATEN.get(target) if target is not None else None
    if not (flagged or (od is not None and od.random) or seeded(target)):
        return False
    schema = {a.name: a for a in target._schema.arguments} if seeded(target) else {}
    for name, off in _RANDOMNESS_OFF:
        if name in args:
            val = args[name]
        elif name in schema and schema[name].has_default_value():
            val = schema[name].default_value   # an omitted argument takes its default
        else:
            continue
        if val is off if isinstance(off, bool) else (
                isinstance(val, (int, float)) and not isinstance(val, bool) and val == off):
            return False
    return True


def is_random(node: Node) -> bool:
    """The per-node fact "random": the IR ``node`` draws from torch's RNG on every run
    (its OpDef's ``random`` flag, or for a HostFallback / aten-backed node its overload's
    ``nondeterministic_seeded`` tag). Random nodes are never constant-folded, merged,
    duplicated or recomputed; their results differ per call and advance the RNG."""
    op = get_op(node.op)
    return is_random_call(op.aten or node.meta.get("aten"), node.attrs, op.random)


def reads_layout(node: Node) -> bool:
    """The per-node fact "reads the memory layout": ``node``'s results depend on the
    strides and storage offset of its tensor inputs (its OpDef's ``reads_layout``, or a
    HostFallback of an ``as_strided*`` overload such as ``as_strided_scatter``)."""
    op = get_op(node.op)
    target = op.aten or node.meta.get("aten")
    return op.reads_layout or (
        target is not None and target._schema.name.startswith("aten::as_strided"))


def get_op(name: str) -> OpDef:
    """The OpDef named ``name``; raises KeyError listing close names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        import difflib
        close = difflib.get_close_matches(name, list(_REGISTRY), n=3)
        raise KeyError(f"unknown op {name!r}" + (f"; did you mean {close}?" if close else "")) from None


def schema_aliases(op: torch._ops.OpOverload) -> Tuple[Tuple[str, ...], ...]:
    """Per return of ``op``, the arguments its storage may share, from the schema's alias
    annotations: a return aliases an argument when their alias sets meet
    (``Tensor(a) self -> Tensor(a)``) or when the argument's storage flows into the
    wildcard set (``Tensor(a -> *) self -> Tensor[]``: split, unbind). An annotated return
    whose set names no argument may alias every tensor argument."""
    args = [a for a in op._schema.arguments if a.alias_info is not None]
    wild = tuple(a.name for a in args if "*" in a.alias_info.after_set)
    tensors = tuple(a.name for a in op._schema.arguments
                    if "Tensor" in str(a.type))
    out = []
    for r in op._schema.returns:
        info = r.alias_info
        sets = (info.before_set | info.after_set) if info is not None else set()
        names = tuple(a.name for a in args
                      if sets & (a.alias_info.before_set | a.alias_info.after_set))
        if info is not None and sets and not names:
            names = tensors                 # annotated, but with no argument: unknown
        elif info is not None:
            names = tuple(dict.fromkeys(names + wild))
        out.append(names)
    return tuple(out)


def _ref_indices(val: Any) -> List[int]:
    if isinstance(val, TensorRef):
        return [val.index]
    if isinstance(val, TensorListRef):
        return list(range(val.start, val.start + val.length))
    if isinstance(val, (list, tuple)):
        return [i for v in val for i in _ref_indices(v)]
    return []


_FROZEN: ContextVar[Optional[Dict[Node, List[Tuple[int, ...]]]]] = ContextVar(
    "opencann_frozen_aliases", default=None)


@contextmanager
def frozen_graph():
    """Within it, `output_aliases` is computed once per node (in this thread/context):
    for a caller that promises no node's op, attributes or meta change meanwhile (a
    specialised graph being planned and bound, which asks each node's aliases about
    five times). Yields nothing."""
    token = _FROZEN.set({})
    try:
        yield
    finally:
        _FROZEN.reset(token)


def output_aliases(node: Node) -> List[Tuple[int, ...]]:
    """For each output of ``node``, the indices of the inputs whose storage it may share.

    Sources, first match wins: the input a kernel writes the output into in place and
    returns (`inplace_inputs`: the node's ``inplace_input`` attribute, e.g. ConvAddAct in
    place, or the OpDef's ``inplace_of``); the OpDef's ``aliases``; for a HostFallback node, the schema of its ``meta["aten"]`` overload.
    Unknown (no declaration, no schema) means every output may alias every input.
    The list is shared within `frozen_graph`: do not change it."""
    memo = _FROZEN.get()
    if memo is None:
        return _output_aliases(node)
    found = memo.get(node)
    if found is None:
        found = memo[node] = _output_aliases(node)
    return found


def inplace_inputs(node: Node) -> Dict[int, int]:
    """Output index -> index in ``node.inputs`` of the input its kernel writes that output
    into, in place (and returns): every output into the node's ``inplace_input``
    attribute (a fusion's decision, e.g. ConvAddAct on its residual), else the OpDef's
    ``inplace_of`` (an op that always writes in place, e.g. KvCacheUpdate into its
    ``cache``). Empty for a node that writes no input. Raises KeyError for an
    ``inplace_of`` argument the node does not hold as a tensor input."""
    if "inplace_input" in node.attrs:
        return {k: node.attrs["inplace_input"] for k in range(len(node.outputs))}
    facts = get_op(node.op).inplace_of
    if not facts:
        return {}
    out = {}
    for k, name in facts.items():
        ref = node.attrs.get(name)
        if not isinstance(ref, TensorRef):
            raise KeyError(f"{node.name} ({node.op}) writes in place into {name!r}, which it "
                           "does not hold as a tensor input")
        out[k] = ref.index
    return out


def written_inputs(node: Node) -> Tuple[int, ...]:
    """Indices in ``node.inputs`` of the inputs ``node`` writes in place (`inplace_inputs`),
    ascending, without repeats; ``()`` for a node that writes none."""
    return tuple(sorted(set(inplace_inputs(node).values())))


def _output_aliases(node: Node) -> List[Tuple[int, ...]]:
    written = inplace_inputs(node)
    if "inplace_input" in node.attrs:
        return [(written[k],) for k in range(len(node.outputs))]
    op = get_op(node.op)
    facts = op.aliases
    if facts is None and op.aten is None and node.meta.get("aten") is not None:
        facts = schema_aliases(node.meta["aten"])
    if facts is None:
        return [tuple(range(len(node.inputs)))] * len(node.outputs)
    out = []
    for k in range(len(node.outputs)):
        if k in written:
            out.append((written[k],))
            continue
        names = facts[min(k, len(facts) - 1)] if facts else ()
        idx = sorted({i for n in names for i in _ref_indices(node.attrs.get(n))})
        out.append(tuple(idx))
    return out


def lookup_aten(target) -> Optional[OpDef]:
    """The registered `OpDef` implementing the ATen overload ``target`` (e.g.
    ``torch.ops.aten.relu.default``), or None when no op is registered for it."""
    return _BY_ATEN.get(target)


def lookup_custom_op(target) -> Optional[OpDef]:
    """The registered `OpDef` that captures the torch custom op ``target`` (an OpOverload
    such as ``torch.ops.opencann.decode_attention.default``, or its qualified name
    ``"opencann::decode_attention"``; `OpDef.custom_op`), or None."""
    name = target if isinstance(target, str) else getattr(
        getattr(target, "_schema", None), "name", None)
    return _BY_CUSTOM.get(name) if name is not None else None


def all_ops() -> List[OpDef]:
    """Every registered `OpDef`, in registration order (a new list)."""
    return list(_REGISTRY.values())


# -- calling an op with a node's arguments -------------------------------------------

def _resolve(val: Any, inputs: Sequence[Any]) -> Any:
    if isinstance(val, TensorRef):
        return inputs[val.index]
    if isinstance(val, TensorListRef):
        return list(inputs[val.start:val.start + val.length])
    if isinstance(val, list):
        return [_resolve(v, inputs) for v in val]
    return val


def call_args(node: Node, inputs: Sequence[Any]) -> Tuple[list, dict]:
    """Rebuild ATen positional/keyword args from ``node.attrs`` and actual inputs."""
    op = get_op(node.op)
    schema = (op.aten or node.meta["aten"])._schema
    args, kwargs = [], {}
    for a in schema.arguments:
        if a.name not in node.attrs:
            continue
        val = _resolve(node.attrs[a.name], inputs)
        if a.kwarg_only:
            kwargs[a.name] = val
        else:
            args.append(val)
    return args, kwargs


def infer(node: Node) -> List[TensorDesc]:
    """Shape/dtype inference by running the op's ATen overload on meta tensors; an
    output the kernel does not produce (None, or in ``node.meta["none_outputs"]``: the
    meta kernel of ``native_batch_norm_backward`` ignores ``output_mask``) is
    `SKIPPED_OUTPUT`.

    Raises ValueError naming the node and its source location when inference fails."""
    op = get_op(node.op)
    target = op.aten or node.meta.get("aten")
    if target is None:
        return [o.desc for o in node.outputs]
    metas = [torch.empty(v.desc.shape, dtype=v.desc.dtype.torch, device="meta")
             for v in node.inputs]
    args, kwargs = call_args(node, metas)
    if "device" in kwargs:
        kwargs["device"] = "meta"
    try:
        out = target(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise ValueError(f"shape inference failed for {node.name} ({node.op}) at "
                         f"{node.where()}: {e}") from None
    outs = out if isinstance(out, (tuple, list)) else [out]
    absent = node.meta.get("none_outputs", ())
    return [SKIPPED_OUTPUT if t is None or k in absent
            else TensorDesc(tuple(int(s) for s in t.shape), DataType.from_torch(t.dtype))
            for k, t in enumerate(outs)]
