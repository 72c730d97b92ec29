"""FX (core ATen) → opencann IR.

Each ``call_function`` node becomes one IR node of the op that implements its ATen
overload; tensor arguments become inputs and every other argument an attribute under
its schema name. An overload with no OpDef becomes a ``HostFallback`` node that runs
the ATen op on the host (CANN GE fails the whole compile in that case; we run it and
report it). Output descriptions come from FX's meta values and are re-checked against
our own inference; a disagreement is an error naming the node and its source line.
"""
from __future__ import annotations

import operator
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from .. import errors
from . import custom_ops
from ...ir import DataType, Graph, TensorDesc, TensorRef, Value, is_dense
from ...ir.symbolic import SymExpr, expr_string, has_symbolic
from ...ops import infer, lookup_aten, storage_roots
from ...ops.opdef import SKIPPED_OUTPUT

_TORCH_DIR = os.path.dirname(torch.__file__)


class ConversionError(errors.ConversionError):
    """The FX graph could not be converted; the message names the node and source,
    ``kind`` the obstacle (`opencann.frontend.errors.KINDS`)."""


def source_of(node: fx.Node) -> Tuple[str, str]:
    """(``file:line``, module scope) of the user code that produced ``node``."""
    scope = ""
    stack = node.meta.get("nn_module_stack")
    if stack:
        scope = list(stack.values())[-1][0]
    src = ""
    trace = node.meta.get("stack_trace") or ""
    for line in trace.splitlines():
        line = line.strip()
        if line.startswith("File "):
            parts = line.split('"')
            if len(parts) >= 3 and not parts[1].startswith(_TORCH_DIR):
                lineno = parts[2].split("line ")[-1].split(",")[0]
                src = f"{os.path.basename(parts[1])}:{lineno}"
    return src, scope


def _desc(val: Any, where: str) -> TensorDesc:
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise ConversionError(
            f"{where}: the model computes a data-dependent value ({type(val).__name__}: a "
            "shape or scalar that depends on tensor values, e.g. x[x > 0], nonzero() or "
            ".item()). opencann compiles static graphs: keep shapes independent of the data, "
            "or use torch.compile(model, backend='opencann'), which runs such parts eagerly",
            kind="data_dependent")
    if not isinstance(val, torch.Tensor):
        raise ConversionError(f"{where}: expected a tensor meta value, got {type(val).__name__}",
                              kind="unsupported_op")
    shape = tuple(_dim(s) for s in val.shape)
    return TensorDesc(shape, DataType.from_torch(val.dtype))


def _flat_vals(val: Any) -> Tuple[List[Any], bool]:
    if isinstance(val, (list, tuple)):
        return list(val), True
    return [val], False


def _absent_outputs(node: fx.Node, vals: List[Any], mask: Any) -> List[int]:
    """Positions of the outputs of multi-output ``node`` (FX values ``vals``) that its
    kernel may not produce: a None value, or one its ``output_mask`` (a gradient op's
    list of bools, None if the op has none) turns off and that no ``getitem`` reads.
    FX's value is not enough: the meta kernels of ``native_batch_norm_backward`` and
    ``batch_norm_backward`` return grad_input whatever the mask, while the CPU kernel
    returns an undefined tensor (a BatchNorm on an input that needs no gradient), which
    an ``.out`` call into a planned buffer refuses."""
    absent = {k for k, v in enumerate(vals) if v is None}
    if isinstance(mask, (list, tuple)) and all(isinstance(m, bool) for m in mask):
        users = list(node.users)
        if all(u.target is operator.getitem for u in users):
            read = {u.args[1] for u in users}
            absent |= {k for k, m in enumerate(mask) if not m and k < len(vals) and k not in read}
    return sorted(absent)


# Outputs where ATen's meta kernel and its CPU kernel disagree, so FX's values are taken
# as they are: inference BatchNorm's saved statistics are empty on CPU ([C] on meta);
# for bf16/fp16 inputs, the normalisations' statistics dtypes differ between the meta
# kernel, the CPU kernel and the .out overload's own check.
META_DIVERGES = {"BatchNorm": {1, 2}, "LayerNorm": {1, 2}, "GroupNorm": {1, 2},
                 "BNTrainingUpdate": {1, 2, 3, 4}, "BNTrainingUpdateNoStats": {1, 2}}
LOW_PRECISION = (DataType.BF16, DataType.FLOAT16)


def _check_target(node: fx.Node, target) -> None:
    """Raise ConversionError unless ``target`` is an ATen overload: a higher-order op
    (control flow or a subgraph inside the graph) or any other callable is refused with
    the fix."""
    if isinstance(target, torch._ops.HigherOrderOperator):
        src, scope = source_of(node)
        where = src if src and not src.startswith("<") else (scope or "the model")
        raise ConversionError(
            f"{node.name} in {where}: torch.{target.name()} (a higher-order op: "
            "control flow or a subgraph inside the graph) is not supported by opencann.compile. "
            "Fix: compute both branches and pick with torch.where(pred, a, b), or use "
            "torch.compile(model, backend='opencann'), which runs such graphs eagerly",
            kind="control_flow")
    if not isinstance(target, torch._ops.OpOverload):
        if getattr(target, "__module__", None) in ("_operator", "operator", "math") or \
                getattr(target, "__name__", "").startswith("sym_"):
            src, scope = source_of(node)
            where = src if src and not src.startswith("<") else (scope or "the model")
            raise ConversionError(
                f"{node.name} in {where}: Python arithmetic on a size "
                f"({getattr(target, '__name__', target)}) that leaves the integers (e.g. "
                "x.shape[0] / 2, a float) is not supported in a compiled graph. Fix: use integer "
                "arithmetic (x.shape[0] // 2), or compute it outside the model",
                kind="size_arithmetic")
        raise ConversionError(f"{node.name}: unsupported FX target {target!r}; only ATen "
                              "overloads are expected after decomposition", kind="unsupported_op")


def _lift_args(node: fx.Node, schema, env: Dict[fx.Node, Any]) -> Tuple[List[Value], Dict[str, Any]]:
    """(inputs, attrs) of ``node``'s ATen call: each FX node argument becomes an input
    (its Value in ``env``) and a `TensorRef` to it, keyed by the schema's argument names.
    Raises ConversionError for an argument that is not a single tensor."""
    inputs: List[Value] = []
    attrs: Dict[str, Any] = {}

    def lift(x):
        if isinstance(x, fx.Node):
            v = env[x]
            if isinstance(v, (SymExpr, int, float)):   # a number computed from symbolic dims
                return v
            if not isinstance(v, Value):
                raise ConversionError(f"{node.name}: argument {x.name} is not a single tensor",
                                      kind="unsupported_op")
            inputs.append(v)
            return TensorRef(len(inputs) - 1)
        if isinstance(x, (list, tuple)):
            return [lift(y) for y in x]
        if isinstance(x, torch.device):
            return x
        return x

    for i, a in enumerate(schema.arguments):
        if i < len(node.args) and not a.kwarg_only:
            attrs[a.name] = lift(node.args[i])
        elif a.name in node.kwargs:
            attrs[a.name] = lift(node.kwargs[a.name])
    return inputs, attrs


def convert_node(graph: Graph, node: fx.Node, env: Dict[fx.Node, Any]) -> None:
    """Append the IR node for one FX ``call_function`` node; records its outputs in env."""
    target = node.target
    if target is operator.getitem:
        env[node] = env[node.args[0]][node.args[1]]
        return
    if _shape_value(node, env):
        return
    if target is torch.ops.higher_order.with_effects:
        _convert_effect(graph, node, env)
        return
    if target in custom_ops.AUTO_FUNCTIONALIZED:   # an in-place custom op, functionalized
        custom_ops.convert_auto_functionalized(graph, node, env, convert_node)
        return
    _check_target(node, target)
    custom = custom_ops.captured_op(target)
    if custom is not None and custom.inplace_of and not isinstance(node, custom_ops.CallNode):
        custom_ops.convert_inplace_call(graph, node, env, convert_node)
        return
    if not target._schema.returns and custom is None:
        # shape/dtype assertions (e.g. _assert_tensor_metadata) were checked at export time
        graph.meta.setdefault("dropped_asserts", []).append(str(target))
        cond = env.get(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
        if isinstance(cond, SymExpr):   # a condition on dynamic dims: checked per shape
            graph.signature = graph.signature.replace(
                shape_guards=graph.signature.shape_guards + (cond.expr,))
        env[node] = None
        return
    opdef = lookup_aten(target) or custom
    inputs, attrs = _lift_args(node, target._schema, env)
    if custom is not None:
        attrs = custom_ops.rename_args(custom, attrs)
    src, scope = source_of(node)
    vals, is_seq = _flat_vals(node.meta.get("val"))
    # a multi-output op may skip outputs (a gradient op's output_mask): an empty
    # stand-in value, never planned, that the kernel returns as None
    none_outputs = _absent_outputs(node, vals, attrs.get("output_mask")) if is_seq else []
    vals = [None if k in none_outputs else v for k, v in enumerate(vals)]
    descs = [SKIPPED_OUTPUT if k in none_outputs
             else _desc(v, f"{node.name} at {src}") for k, v in enumerate(vals)]
    ir = graph.create_node(opdef.name if opdef else "HostFallback", inputs, attrs, descs,
                           name=node.name, source=src, scope=scope)
    if none_outputs:
        ir.meta["none_outputs"] = none_outputs
    if ir.op in META_DIVERGES and ir.inputs and ir.inputs[0].desc.dtype in LOW_PRECISION:
        # the statistics' dtype differs between the meta kernel, the CPU kernel and the
        # .out overload's own check for bf16/fp16 inputs: let the op allocate its outputs
        ir.meta["no_out_kernel"] = True
    if opdef is None:
        ir.meta["aten"] = target
    if isinstance(node, fx.Node):
        # the FX value each output stands for ("name", or "name.k" for output k of a
        # multi-output node): layer-by-layer comparison with eager (opencann.tools.compare)
        ir.meta["origin"] = [node.name] if not is_seq else [f"{node.name}.{k}" for k in range(len(vals))]
    # strides of ATen's own result: views downstream depend on them, so planned buffers
    # reproduce them (e.g. SDPA returns a permuted-contiguous tensor)
    ir.meta["strides"] = [_strides(v) for v in vals]
    env[node] = list(ir.outputs) if is_seq else ir.outputs[0]


def _strides(v: Any):
    """ATen's strides of an FX value: ints, or symbolic dims' string forms (bound per
    shape by `opencann.ir.specialise`); None for a non-tensor or data-dependent strides."""
    if not isinstance(v, torch.Tensor):
        return None
    st = tuple(int(s) if not isinstance(s, torch.SymInt) else _backed_expr(s) for s in v.stride())
    return None if any(s is None for s in st) else st


def _backed_expr(s: "torch.SymInt | torch.SymFloat | torch.SymBool") -> "str | None":
    """The string form (`expr_string`: float constants exact) of a SymInt, SymFloat or
    SymBool that depends on input shapes only (torch.export's backed symbols ``s0``,
    ``s1``...), or None for a data-dependent one (``u0``: from ``nonzero()``,
    ``.item()``)."""
    expr = s.node.expr
    if any(not str(f).startswith("s") for f in expr.free_symbols):
        return None
    return expr_string(expr)


def _dim(s: Any) -> Any:
    """A shape entry: an int (a SymInt the shape environment has specialised to a constant,
    as in AOTAutograd's backward graphs, included), else the SymInt's string form."""
    if isinstance(s, torch.SymInt):
        e = expr_string(s.node.expr)
        return int(e) if e.lstrip("-").isdigit() else e
    return int(s)


def _size(s: Any) -> Any:
    """An int, or a symbolic size's string form (bound per call by `opencann.engine.dynamic`)."""
    if isinstance(s, torch.SymInt):
        e = _backed_expr(s)
        return int(e) if e is not None and e.lstrip("-").isdigit() else e
    return int(s)


def _shape_value(node: fx.Node, env: Dict[fx.Node, Any]) -> bool:
    """A node computing a number from symbolic input shapes becomes a `SymExpr` in
    ``env`` (ops taking it as an argument hold it as an attr, bound per call): integer
    sizes (``sym_size``, ``s0 * s1``, ``s0 // 2``) and float arithmetic on sizes alike
    (``sym_float``, ``s1 / s0``, ``1.5 * s0``, ``math.trunc``, ``math.floor``: what
    ``F.interpolate`` computes for ``size=`` or ``scale_factor=``); a SymBool (only read
    by export's range assertions) becomes a guard. A number the shape environment has
    folded to a constant becomes that int or float. Returns False, changing nothing, for
    any other node (data-dependent sizes stay errors)."""
    val = node.meta.get("val")
    if isinstance(val, torch.SymBool) and not isinstance(node.target, torch._ops.OpOverload):
        expr = _backed_expr(val)   # read by export's shape assertions only: kept as guards
        env[node] = SymExpr(expr) if expr is not None else None
        return True
    if not isinstance(val, (torch.SymInt, torch.SymFloat)):
        return False
    expr = _backed_expr(val)
    if expr is None:
        return False
    num = val.node.expr
    if num.is_number:
        env[node] = int(num) if isinstance(val, torch.SymInt) else float(num)
    else:
        env[node] = SymExpr(expr)
    return True


class _EffectNode:
    """The op inside ``with_effects(token, op, *args)``, seen as a plain FX node."""

    def __init__(self, node: fx.Node, val: Any):
        self.name, self.target = node.name, node.args[1]
        self.args, self.kwargs = node.args[2:], node.kwargs
        self.meta = dict(node.meta, val=val)


def _convert_effect(graph: Graph, node: fx.Node, env: Dict[fx.Node, Any]) -> None:
    """``with_effects(token, op, *args)``: torch.export threads a token through ops with
    side effects (``_linalg_check_errors`` of linalg.inv/solve, prints) to keep their
    order. A static graph runs in order anyway: the token is dropped and ``op`` converted
    as usual (an op without results, such as the error check, is dropped like an
    assertion). The node's value is (token, *results), the token None."""
    op = node.args[1]
    vals = list(node.meta.get("val") or ())
    if not isinstance(op, torch._ops.OpOverload):
        raise ConversionError(f"{node.name}: side-effect op {op!r} is not an ATen overload",
                              kind="unsupported_op")
    if not op._schema.returns:
        graph.meta.setdefault("dropped_asserts", []).append(str(op))
        graph.meta.setdefault("dropped_effects", []).append(str(op))
        env[node] = [None, None]
        return
    inner = _EffectNode(node, vals[1] if len(op._schema.returns) == 1 else tuple(vals[1:]))
    convert_node(graph, inner, env)
    res = env.pop(inner)
    env[node] = [None] + (list(res) if len(op._schema.returns) > 1 else [res])


def check_inference(graph: Graph) -> None:
    """Re-infer every aten-backed node's outputs and compare with FX's meta values.

    Only outputs that are used are compared, except those of `META_DIVERGES` and the
    outputs an op skips (``none_outputs``). Raises ConversionError naming the node and
    its source line on disagreement."""
    outs = {id(v) for v in graph.outputs}
    for ir in graph.nodes:
        if ir.op == "HostFallback" or not all(v.desc.is_static for v in (*ir.inputs, *ir.outputs)) \
                or has_symbolic(ir.attrs):
            continue   # symbolic shapes or sizes (dynamic dims): FX's values are the reference
        ours = infer(ir)
        skip = META_DIVERGES.get(ir.op, set()) | set(ir.meta.get("none_outputs", ()))
        for k, (a, o) in enumerate(zip(ours, ir.outputs)):
            b = o.desc
            if k in skip:
                continue
            if (o.users or id(o) in outs) and (a.shape != b.shape or a.dtype != b.dtype):
                raise ConversionError(
                    f"shape inference disagrees with FX for {ir.name} ({ir.op}, output {k}) "
                    f"at {ir.where()}: opencann {a}, FX {b}", kind="internal")


def _set_outputs(graph: Graph, node: fx.Node, env: Dict[fx.Node, Any], sig=None) -> None:
    """Graph outputs from the FX output node; non-tensor outputs (None, ints) are kept
    as literals by position so the runtime can rebuild the flat output list. Side-effect
    tokens (``sig``'s TOKEN outputs) are left out."""
    outs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
    if sig is not None:
        outs = [o for o, s in zip(outs, _output_specs(sig, all_kinds=True)) if s is not None]
    flat = [env[o] if isinstance(o, fx.Node) else o for o in outs]
    graph.outputs = [o for o in flat if isinstance(o, Value)]
    # which outputs share memory in eager (views of one tensor, one tensor returned twice):
    # passes may merge values (CSE), the runtime then keeps outputs eager kept apart apart
    roots = storage_roots(graph)
    graph.signature = graph.signature.replace(
        output_literals={i: o for i, o in enumerate(flat) if not isinstance(o, Value)},
        n_outputs=len(flat), output_storage=tuple(roots[o.id] for o in graph.outputs))


def _resolve_const(ep: torch.export.ExportedProgram, name: str) -> torch.Tensor:
    if name in ep.state_dict:
        return ep.state_dict[name]
    return ep.constants[name]


def _custom_object_error(node: fx.Node, spec) -> str:
    """The message for an object (not tensor) input lifted by torch.export: an explicit
    ``torch.Generator`` (``generator=``), or a TorchScript custom class."""
    users = [u for u in node.users if u.op == "call_function"]
    where = ", ".join(f"{u.target} at {source_of(u)[0] or '?'}" for u in users[:3])
    cls = getattr(spec.arg, "class_fqn", "?")
    if cls.endswith("Generator"):
        return (f"the model draws from its own torch.Generator (generator= in {where}); "
                "torch.export captures a copy of it, so the compiled model could not follow "
                "your generator's seed. Fix: draw from torch's global RNG (drop generator=, "
                "seed with torch.manual_seed), or use torch.compile(model, backend='opencann'), "
                "which runs those draws eagerly")
    return (f"the model uses a {cls} object ({where}); opencann compiles graphs of tensors "
            "only. Fix: keep the object out of forward, or use torch.compile(model, "
            "backend='opencann'), which runs such parts eagerly")


def _note_layout_query(graph: Graph, ep: torch.export.ExportedProgram, name: str) -> None:
    """Before input ``name`` is added: record its index in ``graph.signature.layout_queries``
    ("layout" / "offset" -> list of input indices; saved with the graph in model files)
    when the model's code asked its layout during capture
    (`opencann.frontend.torch.layout_queries`)."""
    read = next(n for n in ep.graph.nodes if n.op == "output").meta.get("layout_queries") or {}
    q = {k: list(v) for k, v in graph.signature.layout_queries.items()} or {"layout": [], "offset": []}
    for kind, names in read.items():
        if name in names:
            q.setdefault(kind, []).append(len(graph.inputs))
    graph.signature = graph.signature.replace(layout_queries=q)


def _refuse_written_state(sig, ep=None) -> None:
    """Raise ConversionError (kind ``buffer_written`` / ``parameter_written``) when the
    exported program writes a buffer or a parameter in forward (a buffer written by an
    in-place custom op such as ``opencann::kv_cache_update``: the fix is to pass it in)."""
    from torch.export.graph_signature import OutputKind
    for out in sig.output_specs:
        if out.kind == OutputKind.BUFFER_MUTATION and ep is not None:
            op = custom_ops.custom_op_writing(ep, out.target)
            if op is not None:
                raise ConversionError(
                    f"the model writes its buffer {out.target} with {op} during the forward "
                    "pass; a compiled graph keeps its buffers fixed (weights are snapshots). "
                    "Fix: pass the cache to forward as an input: the compiled model then "
                    "writes the caller's tensor in place, without a copy",
                    kind="buffer_written")
        if out.kind == OutputKind.BUFFER_MUTATION:
            bn = any(w in str(out.target) for w in ("running_mean", "running_var",
                                                   "num_batches_tracked"))
            raise ConversionError(
                f"the model mutates its buffer {out.target} during the forward pass"
                + ("; BatchNorm in training mode updates its running statistics: call "
                   "model.eval() for inference" if bn else
                   " (e.g. a counter or cache updated in forward); a compiled graph keeps "
                   "its buffers fixed: move the update out of forward")
                + ", or use torch.compile(model, backend='opencann'), which keeps mutations",
                kind="buffer_written")
        if out.kind == OutputKind.PARAMETER_MUTATION:
            raise ConversionError(
                f"the model writes into its parameter '{out.target}' during the forward pass "
                "(e.g. nn.Embedding(max_norm=...) renorming its weight, or an in-place update "
                "under torch.no_grad()); a compiled graph keeps its parameters fixed: move the "
                "update out of forward, or use torch.compile(model, backend='opencann'), "
                "which keeps mutations", kind="parameter_written")


def from_exported_program(ep: torch.export.ExportedProgram, name: str = "model",
                          check: bool = True) -> Graph:
    """Convert a (decomposed) ExportedProgram into an IR Graph.

    Parameters, buffers and lifted constants become graph constants; user inputs become
    graph inputs in flattened order. A model that writes into its inputs (``x.add_(1)``)
    returns the new values first: ``graph.signature.input_mutations`` lists, for each of
    these leading outputs, the graph input it updates, and ``returns_input`` maps
    a user output (index among the outputs after them) that is the mutated input itself
    to that graph input. Raises ConversionError for mutated buffers (training-mode
    BatchNorm statistics) and parameters (``nn.Embedding(max_norm=...)``), object inputs (an explicit ``generator=``) and unsupported
    targets."""
    from torch.export.graph_signature import InputKind

    graph = Graph(name)
    env: Dict[fx.Node, Any] = {}
    sig = ep.graph_signature
    specs = {s.arg.name: s for s in sig.input_specs if hasattr(s.arg, "name")}
    _refuse_written_state(sig, ep)
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            spec = specs.get(node.name)
            if spec is not None and spec.kind == InputKind.CUSTOM_OBJ:
                raise ConversionError(_custom_object_error(node, spec), kind="object_input")
            elif spec is not None and spec.kind == InputKind.TOKEN:
                env[node] = None   # side-effect ordering token: see _convert_effect
            elif spec is not None and spec.kind != InputKind.USER_INPUT:
                t = _resolve_const(ep, spec.target)
                env[node] = graph.add_const(t, name=spec.target)
            elif isinstance(node.meta.get("val"), torch.Tensor):
                _note_layout_query(graph, ep, node.name)
                env[node] = graph.add_input(_desc(node.meta["val"], node.name), name=node.name)
            else:
                env[node] = node.meta.get("val")
        elif node.op == "call_function":
            convert_node(graph, node, env)
        elif node.op == "output":
            _set_outputs(graph, node, env, sig)
            _input_mutations(graph, sig, node)
            _record_eager_strides(graph, node.meta.get("eager_strides"))
    if check:
        check_inference(graph)
    return graph


def _output_specs(sig, all_kinds: bool = False) -> list:
    """``sig``'s output specs without the side-effect tokens (``all_kinds``: with None in
    their places)."""
    from torch.export.graph_signature import OutputKind
    specs = [None if s.kind == OutputKind.TOKEN else s for s in sig.output_specs]
    return specs if all_kinds else [s for s in specs if s is not None]


def _record_eager_strides(graph: Graph, eager) -> None:
    """``graph.signature.eager_output_strides``: graph output index -> eager's strides, for
    the user outputs whose decomposed strides differ from eager's. ``eager``: the user
    outputs' strides before decomposition (recorded by `capture`; None for a non-tensor
    output). Decomposition functionalizes the program and can re-derive a value with other
    strides (a base updated through an in-place op on its transposed view becomes a
    permute of a contiguous clone); the runtime returns those outputs with eager's.
    Outputs that are the caller's tensor or a view of it, non-dense strides, and counts
    that do not match up one to one are left alone."""
    if not eager:
        return
    sig = graph.signature
    k = len(sig.input_mutations)
    lits = sig.output_literals
    n_user = sig.n_flat(len(graph.outputs)) - k
    if len(eager) != n_user:
        return
    mine = set(sig.returns_input) | set(sig.input_views)
    fixes: Dict[int, tuple] = {}
    g = k
    for i in range(n_user):
        if i + k in lits:
            continue
        v, st = graph.outputs[g], eager[i]
        g += 1
        if st is None or i in mine or v.producer is None or len(st) != len(v.desc.shape):
            continue
        traced = (v.producer.meta.get("strides") or [None] * len(v.producer.outputs))[
            v.producer.outputs.index(v)]
        if traced is not None and tuple(traced) != tuple(st) and is_dense(v.desc.shape, st):
            fixes[g - 1] = tuple(st)
    if fixes:
        graph.signature = sig.replace(eager_output_strides=fixes)


def _input_mutations(graph: Graph, sig, out_node: fx.Node) -> None:
    """Record which leading outputs are new values of user inputs (see
    `from_exported_program`); torch.export puts them before the user outputs."""
    from torch.export.graph_signature import OutputKind
    specs = _output_specs(sig)
    kinds = [s.kind for s in specs]
    k = sum(kind == OutputKind.USER_INPUT_MUTATION for kind in kinds)
    if not k:
        return
    if kinds[:k] != [OutputKind.USER_INPUT_MUTATION] * k:
        raise ConversionError("torch.export listed input mutations after other outputs; "
                              "opencann expects them first (report this as a bug)", kind="internal")
    names = [v.name for v in graph.inputs]
    args = [a for a, s in zip(out_node.args[0], _output_specs(sig, all_kinds=True))
            if s is not None]
    mutations, produced = [], {}
    for i, spec in enumerate(specs[:k]):
        if spec.target not in names:
            raise ConversionError(f"the model writes into its input {spec.target}, which is "
                                  "not a tensor input of the graph (report this as a bug)",
                                  kind="internal")
        mutations.append(names.index(spec.target))
        produced[args[i]] = mutations[-1]
    views = _views_of_mutated_inputs(args[k:], produced)
    graph.signature = graph.signature.replace(
        input_mutations=tuple(mutations), input_views=views,
        returns_input={j: produced[a] for j, a in enumerate(args[k:])
                       if isinstance(a, fx.Node) and a in produced})


def _views_of_mutated_inputs(outs, produced) -> Dict[int, list]:
    """User outputs that are views of a mutated input's new value (``x[0].add_(1)``,
    ``x.mul_(2)[1:]``): in eager they share the input's memory. Maps the output's index
    to [graph input, shape, strides, storage offset relative to the new value, the new
    value's strides], from the FX fake tensors (views share their base's storage)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def val(n):
        v = n.meta.get("val") if isinstance(n, fx.Node) else None
        return v if isinstance(v, torch.Tensor) else None
    bases = {}
    for node, i in produced.items():
        v = val(node)
        if v is not None:
            bases.setdefault(StorageWeakRef(v.untyped_storage()), (i, v))
    views: Dict[int, list] = {}
    for j, a in enumerate(outs):
        v = val(a)
        if v is None or a in produced:
            continue
        hit = bases.get(StorageWeakRef(v.untyped_storage()))
        if hit is not None and hit[1].dtype == v.dtype:
            i, base = hit
            views[j] = [i, [_size(s) for s in v.shape], [_size(s) for s in v.stride()],
                        _size(v.storage_offset() - base.storage_offset()),
                        [_size(s) for s in base.stride()]]
    return views


def from_fx_graph(gm: fx.GraphModule, example_inputs, name: str = "graph",
                  check: bool = True, constants: Optional[Dict[str, torch.Tensor]] = None) -> Graph:
    """Convert an ATen-level FX GraphModule (from AOTAutograd / dynamo backends).

    get_attr nodes become constants; placeholders become inputs, except those named in
    ``constants`` (placeholder name -> real tensor, same shape and dtype as the
    placeholder's value: the frozen weights of `opencann.dynamo.freezing`), which become
    constants holding that tensor (not copied)."""
    graph = Graph(name)
    env: Dict[fx.Node, Any] = {}
    constants = constants or {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name in constants:
            env[node] = graph.add_const(constants[node.name], name=node.name)
        elif node.op == "placeholder":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                env[node] = graph.add_input(_desc(val, node.name), name=node.name)
            elif not _shape_value(node, env):   # a size input (dynamo's SymInt): a SymExpr
                env[node] = val
        elif node.op == "get_attr":
            env[node] = graph.add_const(getattr(gm, node.target), name=node.target)
        elif node.op == "call_function":
            convert_node(graph, node, env)
        elif node.op == "output":
            _set_outputs(graph, node, env)
    if check:
        check_inference(graph)
    return graph
