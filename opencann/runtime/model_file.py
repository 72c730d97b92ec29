"""The offline model file (``.ocm``): a compiled model saved once, loaded without its
Python class, without torch.export and without running any pickled code.

Layout (all integers little-endian)::

    b"OPENCANN"  u32 format version  u64 header length  32-byte sha256 of the header
    header: UTF-8 JSON {"sections": [{"name", "offset", "size", "sha256"}, ...]}
    sections, back to back (offsets count from the end of the header)

Sections: ``metadata`` (format/opencann/torch versions, device, input/output names and
descriptions, calling convention, gears), ``graph`` (the optimized IR: values with
their `TensorDesc` incl. storage formats, nodes with op, attributes and meta),
``plan`` (the `MemoryPlan`), ``schedule`` (node order and streams), ``report`` (the
`CompileReport`), all JSON, and ``constants`` (the weights, safetensors). Every section
carries its sha256; so does the header. Nothing is pickled: ATen operators are stored by
qualified name and resolved through ``torch.ops`` only; dtypes, devices, layouts and
memory formats by name; pytree specs with ``torch.utils._pytree.treespec_dumps``
(JSON). An output class that the loading process cannot rebuild without the model's
code (a transformers ``ModelOutput`` when transformers is not imported, a namedtuple)
comes back as a plain ``dict`` (keys in order) or ``tuple``.

Why safetensors for weights: the project's rule (DESIGN.md) — a well-kept, pickle-free
tensor format with a documented header; weights keep their dtype and (via the strides
stored in ``graph``) their layout, so a loaded model runs the same kernels on the same
bytes as the live one.

Format versions: 1 is a static model; 2 adds models compiled with dynamic dims
(``opencann.compile(dynamic_shapes=...)``) and ATC-style gears: the ``graph`` is the
symbolic one (shapes such as ``float32[s0,384]``, size arguments as ``{"$sym":
"s0*s1"}``: sympy's string form, read back by `opencann.ir.symbolic.parse`, never
pickled), and ``metadata`` holds ``dynamic`` (dims with names, ranges and sources; the
model's shape conditions; the example's dim values; plan options) and ``gears`` (the
option, dim names and gear values). Version 3 (every model written now) moves the
calling convention out of the graph's ``meta`` into its own field ``signature`` of the
``graph`` section (`opencann.ir.CallSignature`: output literals and count, eager's output
aliasing and strides, mutated inputs, layout queries, shape guards, ``autocast``, ONNX
input/output names); files of versions 1 and 2 keep those under the same names in
``meta`` and are converted on load (`CallSignature.from_legacy_meta`). ``autocast`` is
the host autocast dtype the model was captured under (None: outside autocast; absent in
files written before it was recorded: read as outside), which a loaded model checks per
call as the live one does (`opencann.runtime.autocast_state`). ``metadata``'s
``onnx_inputs`` holds an ONNX model's input names, by which a loaded one binds and checks
its calls as the live one does (absent in files written before: the graph signature's
``input_names``). Constants keep their strides for every kind of view
(`_pack_constants`; gapped views saved as values carry ``fill_strides``, which older
readers ignore, reading them contiguous as before).

Every problem with a file raises `ModelFileError` (a ValueError) with one line saying
what is wrong: not an opencann model file, truncated or with bytes after its last
section (damaged, or another file appended), a section or the header failing
its checksum, a newer format version, a device or preset this opencann lacks, an
op / ATen operator it does not know, or a formula fusion (spelled-out GELU / SiLU /
RMSNorm / LayerNorm run as one kernel) whose kernel would place NaN/±inf (or overflow)
elsewhere on this CPU than where it was compiled (`opencann.ops.parity`).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.utils._pytree as pytree

from ..devices import Device, parse_device
from ..ir import CallSignature, Graph, MemoryPlan, Node, TensorListRef, TensorRef, Value
from ..ir.plan import Buffer
from ..ir.symbolic import SymExpr
from ..ir.types import DataType, Format, TensorDesc
from ..ops import get_op
from ..ops.parity import kernel_layout_differs, special_values_differ
from ..report import CompileReport, PassRecord, fmt_bytes
from .io_names import input_names, output_names

FORMAT_VERSION = 3   # 3: graph.signature; 2: dynamic dims and gears; 1: static
#: several graphs sharing one ``constants`` section (an opencann.llm generator): sections
#: ``metadata`` (the bundle's), ``constants``, and per graph ``<key>/metadata``,
#: ``<key>/graph``, ``<key>/plan``, ``<key>/schedule``, ``<key>/report``
BUNDLE_FORMAT_VERSION = 4
#: the sections a bundle file must hold (besides its graphs')
BUNDLE_SECTIONS = ("metadata", "constants")
MAGIC = b"OPENCANN"
_PREFIX = struct.Struct("<8sIQ32s")  # magic, format version, header length, header sha256
_ALIGN = 64  # bytes: every weight starts this aligned in the file and in memory (as torch's
# allocator aligns them), so a loaded model's GEMMs take the same code paths (same bits)
SECTIONS = ("metadata", "graph", "plan", "schedule", "report", "constants")


class ModelFileError(ValueError):
    """A model file that cannot be saved or loaded; the message says what is wrong."""


# -- literals ----------------------------------------------------------------------------
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _enc(x: Any, where: str) -> Any:
    """A JSON form of an attribute / meta literal. Plain JSON scalars and lists stay
    as they are; everything else is a one-key dict {"$kind": payload}."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else {"$float": repr(x)}
    if isinstance(x, list):
        return [_enc(v, where) for v in x]
    if isinstance(x, tuple):
        return {"$tuple": [_enc(v, where) for v in x]}
    if isinstance(x, frozenset):   # e.g. signature.output_storage: sets of value ids
        return {"$frozenset": [_enc(v, where) for v in sorted(x, key=repr)]}
    if isinstance(x, dict):
        return {"$dict": [[_enc(k, where), _enc(v, where)] for k, v in x.items()]}
    if isinstance(x, SymExpr):
        return {"$sym": x.expr}
    if isinstance(x, TensorRef):
        return {"$ref": x.index}
    if isinstance(x, TensorListRef):
        return {"$refs": [x.start, x.length]}
    if isinstance(x, torch.dtype):
        return {"$dtype": str(x).replace("torch.", "")}
    if isinstance(x, torch.device):
        return {"$device": str(x)}
    if isinstance(x, torch.layout):
        return {"$layout": str(x).replace("torch.", "")}
    if isinstance(x, torch.memory_format):
        return {"$memory_format": str(x).replace("torch.", "")}
    if isinstance(x, torch._ops.OpOverload):
        return {"$aten": f"{x.namespace}::{x._opname}.{x._overloadname}"}
    if isinstance(x, complex):
        return {"$complex": [_enc(x.real, where), _enc(x.imag, where)]}
    raise ModelFileError(f"cannot save {where}: a {type(x).__name__} value ({x!r:.60}) has no "
                         "model-file encoding (only literals, dtypes, devices, layouts, memory "
                         "formats and ATen operators are stored)")


def _resolve_aten(qualified: str) -> torch._ops.OpOverload:
    """``ns::name.overload`` -> the OpOverload, looked up in ``torch.ops`` only."""
    ns, _, rest = qualified.partition("::")
    name, _, overload = rest.rpartition(".")
    try:
        op = getattr(getattr(getattr(torch.ops, ns), name), overload)
    except (AttributeError, RuntimeError):
        op = None
    if not isinstance(op, torch._ops.OpOverload):
        raise ModelFileError(f"unknown ATen operator {qualified} in graph (made by a newer torch "
                             f"than {torch.__version__}?): upgrade torch or recompile the model")
    return op


def _dec(x: Any) -> Any:
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, list):
        return [_dec(v) for v in x]
    if not (isinstance(x, dict) and len(x) == 1):
        raise ModelFileError(f"graph section: unreadable literal {x!r:.60} (made by a newer opencann?)")
    (kind, p), = x.items()
    if kind == "$float":
        return _NONFINITE[p]
    if kind == "$tuple":
        return tuple(_dec(v) for v in p)
    if kind == "$frozenset":
        return frozenset(_dec(v) for v in p)
    if kind == "$dict":
        return {_dec(k): _dec(v) for k, v in p}
    if kind == "$sym":
        return SymExpr(str(p))
    if kind == "$ref":
        return TensorRef(p)
    if kind == "$refs":
        return TensorListRef(*p)
    if kind == "$device":
        return torch.device(p)
    if kind == "$aten":
        return _resolve_aten(p)
    if kind == "$complex":
        return complex(_dec(p[0]), _dec(p[1]))
    typ = {"$dtype": torch.dtype, "$layout": torch.layout, "$memory_format": torch.memory_format}.get(kind)
    obj = getattr(torch, p, None) if typ is not None else None
    if typ is None or not isinstance(obj, typ):
        raise ModelFileError(f"graph section: unknown {kind.lstrip('$')} {p!r} (made by a newer "
                             "opencann or torch?)")
    return obj


def _enc_desc(d: TensorDesc) -> Dict[str, Any]:
    out = {"shape": list(d.shape), "dtype": d.dtype.value, "format": d.format.value}
    if d.origin_shape != d.shape or d.origin_format != d.format:
        out["origin_shape"], out["origin_format"] = list(d.origin_shape), d.origin_format.value
    return out


def _dec_desc(d: Dict[str, Any]) -> TensorDesc:
    try:
        fmt = Format(d["format"])
        return TensorDesc(tuple(d["shape"]), DataType(d["dtype"]), fmt,
                          tuple(d.get("origin_shape", d["shape"])), Format(d.get("origin_format", fmt.value)))
    except ValueError as e:
        raise ModelFileError(f"graph section: {e} (made by a newer opencann?)") from None


# -- graph -------------------------------------------------------------------------------
def _graph_to_json(g: Graph) -> Dict[str, Any]:
    values = [[v.id, v.name, _enc_desc(v.desc)] for v in g.values()]
    known = {v[0] for v in values}
    missing = [v for v in g.outputs if v.id not in known]
    if missing:
        raise ModelFileError(f"cannot save graph {g.name}: output {missing[0]} is not produced in it")
    nodes = [{"op": n.op, "name": n.name, "source": n.source, "scope": n.scope,
              "device": str(n.device),
              "stream": n.stream, "inputs": [v.id for v in n.inputs], "outputs": [v.id for v in n.outputs],
              "attrs": {k: _enc(a, f"{n.name}.attrs[{k!r}]") for k, a in n.attrs.items()},
              "meta": {k: _enc(a, f"{n.name}.meta[{k!r}]") for k, a in n.meta.items()}}
             for n in g.nodes]
    return {"name": g.name, "values": values, "inputs": [v.id for v in g.inputs],
            "constants": [v.id for v in g.constants], "nodes": nodes,
            "outputs": [v.id for v in g.outputs], "meta": _enc(g.meta, "graph.meta"),
            "signature": {k: _enc(v, f"graph.signature.{k}")
                          for k, v in g.signature.to_dict().items()}}


def _graph_from_json(j: Dict[str, Any], consts: Dict[str, torch.Tensor]) -> Graph:
    g = Graph(j["name"])
    descs = {vid: (name, _dec_desc(d)) for vid, name, d in j["values"]}
    vals: Dict[int, Value] = {}
    devices: Dict[str, Device] = {}   # each device string parsed once

    def mk(vid: int, producer: Optional[Node] = None, const=None) -> Value:
        name, desc = descs[vid]
        vals[vid] = Value(vid, desc, producer=producer, const=const, name=name)
        return vals[vid]

    g.inputs = [mk(i) for i in j["inputs"]]
    for i in j["constants"]:
        if f"v{i}" not in consts:
            raise ModelFileError(f"constants section lacks the weight of value %{i}")
        g.constants.append(mk(i, const=consts[f"v{i}"]))
    for nj in j["nodes"]:
        try:
            get_op(nj["op"])
        except KeyError:
            raise ModelFileError(f"unknown op {nj['op']!r} in graph (node {nj['name']}): the file "
                                 "was made by a newer opencann; upgrade opencann") from None
        n = Node(nj["op"], [vals[i] for i in nj["inputs"]], {k: _dec(a) for k, a in nj["attrs"].items()},
                 nj["name"], nj["source"], nj["scope"])
        d = nj["device"]
        n.device = devices.get(d) or devices.setdefault(d, parse_device(d, load=False))
        n.stream = nj["stream"]
        n.meta = {k: _dec(a) for k, a in nj["meta"].items()}
        n.outputs = [mk(i, producer=n) for i in nj["outputs"]]
        g.add_node(n)   # wires its uses and registers its name
    g.outputs = [vals[i] for i in j["outputs"]]
    if "signature" in j:
        g.signature = CallSignature.from_dict({k: _dec(v) for k, v in j["signature"].items()})
        g.meta = _dec(j["meta"])
    else:   # format 1 or 2: the calling convention is in meta under the field names
        g.signature, g.meta = CallSignature.from_legacy_meta(_dec(j["meta"]))
    g._ids = iter(range(max(descs, default=-1) + 1, 1 << 62))  # new values get fresh ids
    return g


# -- constants: safetensors, layouts kept ------------------------------------------------
def _storage_order(t: torch.Tensor) -> Optional[List[int]]:
    """Dims ordered by decreasing stride if ``t`` (stride-0 dims counted as size 1) is
    dense, else None."""
    dims = [d for d in range(t.dim()) if t.shape[d] != 1 and t.stride(d) != 0]
    dims.sort(key=lambda d: -t.stride(d))
    expect = 1
    for d in reversed(dims):
        if t.stride(d) != expect:
            return None
        expect *= t.shape[d]
    return dims


_SPAN_FACTOR = 4  # a gapped constant view is saved with its gaps up to 4x its size


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (a nonzero-stride overlap or a stride 0)."""
    reach = 0
    dims = sorted(((st, n) for n, st in zip(t.shape, t.stride()) if n > 1))
    for st, n in dims:
        if st <= reach:
            return True
        reach += (n - 1) * st
    return False


def _span(t: torch.Tensor) -> int:
    """Elements of storage ``t`` reaches from its first element (strides >= 0)."""
    return 0 if t.numel() == 0 else 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))


def _pack_constants(g: Graph) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Each constant as one flat tensor plus its shape and strides, so the loader rebuilds
    the same layout for every kind of view: dense ones (transposed, offset, expanded dims
    stay expanded, not materialized) in storage order; gapped or overlapping ones
    (``b[:, ::2]``, ``w[::2]``, ``as_strided``) as the storage span they reach (gaps
    included) when it is at most `_SPAN_FACTOR` times their size, else their values alone
    (``fill_strides``: the loader copies them into ``empty_strided``). An overlapping view whose
    span is larger is saved dense (its strides are not kept)."""
    tensors: Dict[str, torch.Tensor] = {}
    layouts: Dict[str, Any] = {}
    for v in g.constants:
        t = v.const
        if t.device.type != "cpu":
            t = t.cpu()
        order = _storage_order(t)
        key = f"v{v.id}"
        fill, strides = False, list(t.stride())
        if order is not None and t.storage_offset() >= 0:
            compact = t
            for d in range(t.dim()):
                if t.stride(d) == 0:
                    compact = compact.narrow(d, 0, min(1, t.shape[d]))
            flat = compact.permute(order + [d for d in range(t.dim()) if d not in order]).reshape(-1)
        elif _span(t) <= _SPAN_FACTOR * t.numel() + 64:
            flat = torch.as_strided(t, (_span(t),), (1,), t.storage_offset())   # gaps included
        elif not _overlaps(t):
            # values; strides rebuilt on load (``strides`` None: an older loader keeps its
            # contiguous reading instead of misreading them)
            flat, fill, strides = t.contiguous().reshape(-1), True, None
        else:
            flat, strides = t.contiguous().reshape(-1), None   # large overlapping view: dense copy
        # own storage (no two entries share memory), padded to whole _ALIGN blocks
        pad = -flat.numel() % max(_ALIGN // flat.element_size(), 1)
        tensors[key] = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat.clone()
        layouts[key] = {"shape": list(t.shape), "strides": strides, "numel": flat.numel()}
        if fill:
            layouts[key]["fill_strides"] = list(t.stride())
    return tensors, layouts


def _unpack_constants(raw: Dict[str, torch.Tensor], layouts: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    out = {}
    for key, lay in layouts.items():
        if "storage" in lay:   # a view of a storage shared by several graphs (a bundle)
            flat = raw[lay["storage"]]
            out[key] = (torch.as_strided(flat, lay["shape"], lay["strides"], lay["offset"])
                        if flat.numel() else flat.reshape(lay["shape"]))
            continue
        flat = raw[key][:lay["numel"]]
        if lay.get("fill_strides") is not None:
            out[key] = torch.empty_strided(lay["shape"], lay["fill_strides"], dtype=flat.dtype)
            out[key].copy_(flat.reshape(lay["shape"]))
        elif lay["strides"] is None:
            out[key] = flat.reshape(lay["shape"])
        elif flat.numel() == 0:
            out[key] = torch.empty_strided(lay["shape"], lay["strides"], dtype=flat.dtype)
        else:
            out[key] = torch.as_strided(flat, lay["shape"], lay["strides"])
    return out


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
              "U8": torch.uint8, "BOOL": torch.bool, "C64": torch.complex64}


def safetensors_views(buf: memoryview, where: str) -> Dict[str, torch.Tensor]:
    """The tensors of a safetensors blob (written by ``safetensors.torch.save``) as views
    of ``buf``, without copying: the format is an 8-byte little-endian header length,
    a JSON header {name: {dtype, shape, data_offsets}} and the data (safetensors' spec,
    huggingface/safetensors README). ``safetensors.torch.load`` would copy the weights
    twice more, which is most of a large model's load time."""
    if len(buf) == 0:
        return {}
    try:
        n = struct.unpack_from("<Q", buf)[0]
        header = json.loads(bytes(buf[8:8 + n]))
        base, out = 8 + n, {}
        for name, e in header.items():
            if name == "__metadata__":
                continue
            lo, hi = e["data_offsets"]
            dt = _ST_DTYPES[e["dtype"]]
            if not 0 <= lo <= hi <= len(buf) - base:
                raise ValueError(f"tensor {name} lies outside the section")
            t = (torch.frombuffer(buf, dtype=dt, count=(hi - lo) // dt.itemsize, offset=base + lo)
                 if hi > lo else torch.empty(0, dtype=dt))
            if t.data_ptr() % _ALIGN:   # a file laid out by another writer: an aligned copy
                t = t.clone()
            out[name] = t.reshape(e["shape"])
        return out
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise ModelFileError(f"{where}: constants section is not valid safetensors ({e})") from None


# -- plan, report, specs -----------------------------------------------------------------
def _plan_to_json(p: MemoryPlan) -> Dict[str, Any]:
    return {"buffers": [vars(b) for b in p.buffers.values()],
            "value_buffer": [[k, v] for k, v in p.value_buffer.items()],
            "arena_bytes": p.arena_bytes, "lower_bound": p.lower_bound, "naive_bytes": p.naive_bytes,
            "alignment": p.alignment, "strategy": p.strategy,
            "inplace": [list(x) for x in p.inplace], "unplanned": p.unplanned}


def _plan_from_json(j: Dict[str, Any]) -> MemoryPlan:
    bufs = [Buffer(**b) for b in j["buffers"]]
    return MemoryPlan({b.root: b for b in bufs}, {k: v for k, v in j["value_buffer"]},
                      j["arena_bytes"], j["lower_bound"], j["naive_bytes"], j["alignment"],
                      j["strategy"], [tuple(x) for x in j["inplace"]], dict(j["unplanned"]))


def _report_from_json(j: Dict[str, Any]) -> CompileReport:
    j = dict(j)
    j.pop("opencann_seconds", None)
    j["passes"] = [PassRecord(**p) for p in j["passes"]]
    fields = CompileReport.__dataclass_fields__
    return CompileReport(**{k: v for k, v in j.items() if k in fields})


def _children(s) -> list:
    return list(s.children()) if hasattr(s, "children") else list(s.children_specs)


def _spec_to_json(spec, what: str) -> Optional[Dict[str, Any]]:
    """``treespec_dumps`` when pytree can serialize the spec, and always a plain
    structure (types by name, dict keys) to fall back on."""
    if spec is None:
        return None
    try:
        dumped = pytree.treespec_dumps(spec)
    except Exception:  # noqa: BLE001 - an unregistered class: the plain structure serves
        dumped = None

    def plain(s):
        if s.is_leaf():
            return None
        ctx = s.context
        keys = [_enc(k, what) for k in ctx] if isinstance(ctx, (list, tuple)) and all(
            isinstance(k, (str, int)) for k in ctx) else None
        return {"type": f"{s.type.__module__}.{s.type.__qualname__}", "keys": keys,
                "children": [plain(c) for c in _children(s)]}
    return {"treespec": dumped, "plain": plain(spec)}


def _spec_from_json(j: Optional[Dict[str, Any]]) -> Tuple[Any, Optional[str]]:
    """(TreeSpec, note) — note says what was rebuilt as a plain container."""
    if j is None:
        return None, None
    if j["treespec"] is not None:
        try:
            return pytree.treespec_loads(j["treespec"]), None
        except Exception:  # noqa: BLE001 - class not registered in this process
            pass
    rebuilt: List[str] = []

    def build(p):
        if p is None:
            return pytree.treespec_leaf() if hasattr(pytree, "treespec_leaf") else pytree.LeafSpec()
        kids = [build(c) for c in p["children"]]
        t = p["type"]
        if t in ("builtins.tuple", "builtins.list"):
            return pytree.TreeSpec(tuple if t == "builtins.tuple" else list, None, kids)
        if t == "builtins.dict" or p["keys"] is not None and len(p["keys"]) == len(kids):
            if t != "builtins.dict":
                rebuilt.append(f"{t} -> dict")
            return pytree.TreeSpec(dict, list(p["keys"] or []), kids)
        rebuilt.append(f"{t} -> tuple")
        return pytree.TreeSpec(tuple, None, kids)
    spec = build(j["plain"])
    return spec, ("; ".join(rebuilt) or None)


# -- save ---------------------------------------------------------------------------------
def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=False, separators=(",", ":")).encode()


def _metadata(g, report, conv: Dict[str, Any], description: str, version: int) -> Dict[str, Any]:
    """The ``metadata`` section: versions, model, device, inputs and outputs (names and
    descs), the calling convention (structures, positions, baked non-tensor inputs),
    and for a dynamic model its dims and gears."""
    from ..version import __version__
    k = len(g.signature.input_mutations)
    return {
        "format_version": version, "opencann_version": __version__,
        "torch_version": torch.__version__, "created_unix": int(time.time()),
        "model": report.model or g.name, "device": report.device, "description": description,
        "inputs": [{"name": nm, "desc": str(v.desc), **_enc_desc(v.desc)}
                   for nm, v in zip(input_names(g), g.inputs)],
        "outputs": [{"name": nm, "desc": str(v.desc), **_enc_desc(v.desc)}   # the caller's
                    for nm, v in zip(output_names(g, conv["out_spec"]), g.outputs[k:])],
        "gears": conv.get("gears") or [],   # ATC-style gears: {"option", "dims", "values"}
        "dynamic": _enc(conv.get("dynamic"), "dynamic dims"),
        "in_spec": _spec_to_json(conv["in_spec"], "input structure"),
        "out_spec": _spec_to_json(conv["out_spec"], "output structure"),
        "input_positions": conv["input_positions"],
        "baked": [[i, _enc(v, f"non-tensor input #{i}")] for i, v in conv["baked"].items()],
        "contiguous": conv["contiguous"], "concurrent_calls": conv["concurrent_calls"],
        "storage_offsets": conv.get("storage_offsets"), "strides": conv.get("strides"),
        "arg_names": conv.get("arg_names"), "onnx_inputs": conv.get("onnx_inputs"),
    }


def _layout(blobs: Dict[str, bytes]) -> Tuple[bytes, List[Dict[str, Any]], Dict[str, int]]:
    """(header, sections, pads): each section's offset, size and sha256, with the
    constants' tensor data (after safetensors' header) 64-byte aligned in the file."""
    # the header's length does not depend on the offsets' values beyond their digits: lay
    # out twice so the weights start 64-byte aligned in the file (aligned zero-copy views)
    header, pads = b"", {}
    for _ in range(3):
        sections, off, pads = [], 0, {}
        for name, b in blobs.items():
            if name == "constants" and b:  # the tensor data (after safetensors' header) aligned
                data_start = 8 + struct.unpack_from("<Q", b)[0]
                pads[name] = -(_PREFIX.size + len(header) + off + data_start) % _ALIGN
                off += pads[name]
            sections.append({"name": name, "offset": off, "size": len(b),
                             "sha256": hashlib.sha256(b).hexdigest()})
            off += len(b)
        new = _json_bytes({"sections": sections})
        if len(new) == len(header):
            break
        header = new
    return new, sections, pads


def graph_sections(compiled, description: str, version: int) -> Dict[str, Any]:
    """The ``metadata``, ``graph``, ``plan``, ``schedule`` and ``report`` sections of
    ``compiled`` (a `CompiledModel`) as JSON objects (`encode_sections` makes them
    bytes); the caller adds the graph's ``constant_layouts`` and the ``constants``.
    Raises ModelFileError when something in the graph has no file encoding (naming the
    node and attribute)."""
    g, plan, report = compiled.graph, compiled.plan, compiled.report
    conv = compiled.calling_convention()
    schedule = {"order": [n.name for n in g.nodes], "streams": {n.name: n.stream for n in g.nodes}}
    return {"metadata": _metadata(g, report, conv, description, version),
            "graph": _graph_to_json(g), "plan": _plan_to_json(plan), "schedule": schedule,
            "report": json.loads(report.to_json())}


def encode_sections(sections: Dict[str, Any]) -> Dict[str, bytes]:
    """JSON sections as bytes (compact; the report may hold non-finite numbers)."""
    return {k: json.dumps(v, separators=(",", ":")).encode() if k == "report" else _json_bytes(v)
            for k, v in sections.items()}


def check_path(path: Any) -> str:
    """``path`` as a str, checked for writing a model file: TypeError for a path that is
    not a str or os.PathLike, ModelFileError for a directory or a missing parent."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"the model file path must be a str or os.PathLike, got "
                        f"{type(path).__name__}: pass e.g. 'model.ocm'")
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ModelFileError(f"{path} is a directory: pass a file path inside it, e.g. "
                             f"{os.path.join(path, 'model.ocm')}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ModelFileError(f"directory {parent} of {path} does not exist: create it first")
    return path


def write_file(path: str, version: int, blobs: Dict[str, bytes]) -> List[Dict[str, Any]]:
    """Write the sections ``blobs`` (name -> bytes, in file order; ``constants`` a
    safetensors blob whose tensor data is laid out 64-byte aligned) under format
    ``version`` to ``path`` atomically (a temporary file renamed; none left behind on
    error). Returns the header's sections (name, offset, size, sha256). Raises OSError
    when the file cannot be written."""
    header, sections, pads = _layout(blobs)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, version, len(header), hashlib.sha256(header).digest()))
            f.write(header)
            for name in blobs:
                f.write(b"\0" * pads.get(name, 0))
                f.write(blobs[name])
        os.replace(tmp, path)   # never leave a half-written model file under the final name
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return sections


def save(compiled, path: str, description: str = "") -> Dict[str, Any]:
    """Write ``compiled`` (a `CompiledModel`) to ``path`` (conventionally ``*.ocm``).

    Returns the header (sections with offsets, sizes, sha256). Raises ModelFileError
    when something in the graph has no file encoding (naming the node and attribute) or
    ``path`` is a directory or in a directory that does not exist, TypeError for a path
    that is not a str or os.PathLike, OSError when the file cannot be written (no
    temporary file is left behind)."""
    import safetensors.torch

    path = check_path(path)
    parts = graph_sections(compiled, description, FORMAT_VERSION)
    tensors, parts["graph"]["constant_layouts"] = _pack_constants(compiled.graph)
    blobs = encode_sections(parts)
    blobs["constants"] = safetensors.torch.save(tensors) if tensors else b""
    return {"format_version": FORMAT_VERSION, "sections": write_file(path, FORMAT_VERSION, blobs)}


# -- read ----------------------------------------------------------------------------------
def read_sections(path: str, verify: bool = True) -> Tuple[Dict[str, Any], Dict[str, memoryview]]:
    """(header, section name -> bytes) of the file at ``path``, every checksum checked
    (``verify``) and its size exactly the header's sections'. Raises ModelFileError (what
    is wrong, one line: truncated, bytes after the last section, a checksum) or
    FileNotFoundError."""
    if os.path.isdir(path):
        raise ModelFileError(f"{path} is a directory, not a model file: pass the .ocm file "
                             "(written by opencann.save or opencann atc)")
    with open(path, "rb") as f:   # one copy of the file, 64-byte aligned; sections are views
        data = memoryview(torch.empty(os.fstat(f.fileno()).st_size, dtype=torch.uint8).numpy())
        f.readinto(data)
    where = os.path.basename(path)
    if len(data) < len(MAGIC) or bytes(data[:len(MAGIC)]) != MAGIC:
        raise ModelFileError(f"{where} is not an opencann model file (it does not start with "
                             f"{MAGIC.decode()!r}); write one with opencann.save")
    if len(data) < _PREFIX.size:
        raise ModelFileError(f"{where} is truncated: {len(data)} bytes, expected at least "
                             f"{_PREFIX.size} (an interrupted copy or download?)")
    _, version, hlen, hsha = _PREFIX.unpack_from(data)
    if version > BUNDLE_FORMAT_VERSION:
        raise ModelFileError(f"{where}: model file format version {version} is newer than this "
                             f"opencann supports ({BUNDLE_FORMAT_VERSION}): upgrade opencann")
    if version < 1:
        raise ModelFileError(f"{where}: format version {version} is not a valid opencann model file version")
    if len(data) < _PREFIX.size + hlen:
        raise ModelFileError(f"{where} is truncated: {len(data)} bytes, expected at least "
                             f"{_PREFIX.size + hlen} (an interrupted copy or download?)")
    raw = memoryview(data)[_PREFIX.size:_PREFIX.size + hlen]
    if hashlib.sha256(raw).digest() != hsha:
        raise ModelFileError(f"{where}: header checksum mismatch (file corrupted or modified)")
    try:
        header = json.loads(bytes(raw))
        secs = {s["name"]: s for s in header["sections"]}
    except (ValueError, KeyError, TypeError) as e:
        raise ModelFileError(f"{where}: unreadable header ({e})") from None
    base = _PREFIX.size + hlen
    end = base + max((s["offset"] + s["size"] for s in secs.values()), default=0)
    if len(data) < end:
        raise ModelFileError(f"{where} is truncated: {len(data)} bytes, expected {end} "
                             "(an interrupted copy or download?)")
    if len(data) > end:   # every writer ends the file with its last section
        raise ModelFileError(f"{where} has {len(data) - end} bytes after its last section "
                             f"({len(data)} bytes, expected {end}): the file is damaged or "
                             "something was appended to it (files concatenated?); save it again")
    missing = [s for s in (BUNDLE_SECTIONS if version == BUNDLE_FORMAT_VERSION else SECTIONS)
               if s not in secs]
    if missing:
        raise ModelFileError(f"{where}: section {missing[0]!r} is missing (made by another tool?)")
    out = {}
    for name, s in secs.items():
        mv = memoryview(data)[base + s["offset"]:base + s["offset"] + s["size"]]
        if verify and hashlib.sha256(mv).hexdigest() != s["sha256"]:
            raise ModelFileError(f"{where}: section {name!r} checksum mismatch (file corrupted "
                                 "or modified)")
        out[name] = mv
    return header, out


def peek_version(path: str) -> Optional[int]:
    """The format version in the file's prefix, or None when ``path`` is not a readable
    opencann model file (`read_sections` then says what is wrong)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_PREFIX.size)
    except OSError:
        return None
    if len(head) < _PREFIX.size or head[:len(MAGIC)] != MAGIC:
        return None
    return _PREFIX.unpack(head)[1]


def json_section(secs, name: str, where: str) -> Any:
    """Section ``name`` of ``secs`` (`read_sections`) parsed as JSON; ModelFileError
    (one line) when it is missing or not JSON."""
    if name not in secs:
        raise ModelFileError(f"{where}: section {name!r} is missing (made by another tool?)")
    try:
        return json.loads(bytes(secs[name]))
    except ValueError as e:
        raise ModelFileError(f"{where}: section {name!r} is not valid JSON ({e})") from None


def check_device(device: str, where: str = "model file") -> None:
    """Raise ModelFileError unless this opencann has ``device`` (kind and vnpu preset)."""
    from ..devices import KINDS, PRESETS, DeviceError, parse_device
    try:
        parse_device(device, load=False)
    except DeviceError as e:
        if e.reason == "kind":
            raise ModelFileError(f"{where} was compiled for device {device!r}: this opencann has no "
                                 f"such device (it has {', '.join(KINDS)}); recompile for one") from None
        if e.reason == "preset":
            raise ModelFileError(f"{where} was compiled for device {device!r}: this opencann has no "
                                 f"vnpu preset {e.preset!r} (it has {', '.join(sorted(PRESETS))}); "
                                 "upgrade opencann or recompile") from None


def _check_formula_kernels(graph, where: str) -> None:
    """Refuse a graph whose formula fusions (``graph.meta["formula_kernels"]``, set by
    ``passes.fusion.match.record_formula``) run a kernel that places NaN/±inf elsewhere
    than the spelled-out formula on this CPU (`ops.parity.special_values`): compiled on
    an AVX2 machine, a fused exact GELU would return NaN for +inf on an AVX-512 one."""
    for act, dtype in graph.meta.get("formula_kernels", []):
        why = special_values_differ(act, getattr(torch, dtype))
        if why:
            raise ModelFileError(f"{where} runs a spelled-out {act} ({dtype}) as one kernel, "
                                 f"but {why}: recompile the model on this machine")


def _check_layout_kernels(graph, where: str) -> None:
    """Refuse a graph holding a kernel that runs at another layout, or another kernel,
    than eager's and gives other values on this CPU (`ops.parity.layout_node.
    kernel_layout_differs`: compiled where GELU is layout-independent, loaded on AVX-512)."""
    for n in graph.nodes:
        why = kernel_layout_differs(n) if n.device.kind == "cpu" else ""
        if why:
            raise ModelFileError(f"{where}: {n.name} ({n.op}) runs off eager's layout or kernel, "
                                 f"but {why}: recompile the model on this machine")


def read(path: str) -> Dict[str, Any]:
    """Parse the model file at ``path`` into the keyword arguments of
    `opencann.engine.loading.model_from_parts` (graph, plan, report, calling convention), plus
    ``metadata``, ``dynamic`` and ``gears`` (None for a static model). Raises ModelFileError
    (one line, what is wrong; a bundle of several graphs, `BUNDLE_FORMAT_VERSION`, names
    its loader) or FileNotFoundError."""
    where = os.path.basename(path)
    _, secs = read_sections(path)
    if peek_version(path) == BUNDLE_FORMAT_VERSION:
        kind = json_section(secs, "metadata", where).get("kind", "a bundle of graphs")
        raise ModelFileError(f"{where} holds {kind} (several graphs, format "
                             f"{BUNDLE_FORMAT_VERSION}), not one compiled model: load it with "
                             "opencann.load or opencann.llm.load")
    consts = safetensors_views(secs["constants"], where)
    return read_graph(secs, "", consts, where)


def read_graph(secs: Dict[str, memoryview], prefix: str, consts: Dict[str, torch.Tensor],
               where: str) -> Dict[str, Any]:
    """`read`'s result for the graph whose sections are named ``prefix`` + ``metadata``,
    ``graph``, ``plan``, ``report`` in ``secs`` (`read_sections`), its weights taken from
    ``consts`` (the ``constants`` section's tensors, `safetensors_views`). Raises
    ModelFileError (one line)."""
    meta = json_section(secs, prefix + "metadata", where)
    check_device(meta.get("device", "cpu"), where)
    gj = json_section(secs, prefix + "graph", where)
    try:
        graph = _graph_from_json(gj, _unpack_constants(consts, gj["constant_layouts"]))
        _check_formula_kernels(graph, where)
        _check_layout_kernels(graph, where)
        plan = _plan_from_json(json_section(secs, prefix + "plan", where))
        report = _report_from_json(json_section(secs, prefix + "report", where))
        in_spec, _ = _spec_from_json(meta["in_spec"])
        out_spec, note = _spec_from_json(meta["out_spec"])
        baked = {i: _dec(v) for i, v in meta["baked"]}
        parts = dict(input_positions=meta["input_positions"], contiguous=meta["contiguous"],
                     concurrent_calls=meta["concurrent_calls"],
                     storage_offsets=meta.get("storage_offsets"),   # absent in older files: 0
                     strides=meta.get("strides"),   # absent in older files: not checked
                     arg_names=meta.get("arg_names"),   # absent in older files: bound by position
                     onnx_inputs=_onnx_inputs(meta, graph))
        dynamic = _dec(meta.get("dynamic"))   # absent in version 1: static
        gears = meta.get("gears") or None
    except ModelFileError:
        raise
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:
        raise ModelFileError(f"{where}: missing or malformed field ({type(e).__name__}: {e}) "
                             "(made by another opencann version?)") from None
    report.passes = [p for p in report.passes if p.name != "bind_kernels"]  # rebound on load
    report.notes.append(f"loaded from {where} (saved by opencann {meta.get('opencann_version')}, "
                        f"torch {meta.get('torch_version')})")
    if note:
        report.notes.append(f"output classes rebuilt as plain containers ({note}): import the "
                            "model's library (e.g. transformers) before opencann.load to get them back")
    return dict(graph=graph, plan=plan, report=report, in_spec=in_spec, out_spec=out_spec,
                baked=baked, metadata=meta, dynamic=dynamic, gears=gears, **parts)


def _onnx_inputs(meta: Dict[str, Any], graph: Graph) -> Optional[List[str]]:
    """An ONNX model's input names, by which its calls are bound (None: a torch model).
    Files written before ``metadata`` held ``onnx_inputs`` still carry them in the
    graph's signature (``input_names``, set only by the ONNX frontend)."""
    if "onnx_inputs" in meta:
        return meta["onnx_inputs"]
    names = graph.signature.input_names
    return list(names) if names is not None and meta.get("in_spec") is None else None


def describe(path: str) -> Dict[str, Any]:
    """Everything ``opencann inspect`` shows, as JSON-able data: metadata, sections
    (size, sha256), op counts, memory plan summary and the graph as text."""
    parts = read(path)
    header, _ = read_sections(path, verify=False)
    g, plan = parts["graph"], parts["plan"]
    return {"file": path, "file_bytes": os.path.getsize(path), "metadata": parts["metadata"],
            "sections": header["sections"], "op_counts": g.op_counts(), "nodes": len(g.nodes),
            "constants": len(g.constants),
            "constant_bytes": sum(v.const.numel() * v.const.element_size() for v in g.constants),
            "memory_plan": plan.summary(), "graph": str(g), "notes": parts["report"].notes}


def describe_text(info: Dict[str, Any]) -> str:
    """`describe`'s data as readable text."""
    m = info["metadata"]
    lines = [f"{info['file']}: opencann model file, format {m['format_version']}, "
             f"{fmt_bytes(info['file_bytes'])}",
             f"  model {m['model']} for {m['device']}; saved by opencann {m['opencann_version']}, "
             f"torch {m['torch_version']}"]
    if m.get("description"):
        lines.append(f"  {m['description']}")
    lines.append("inputs:")
    lines += [f"  {x['name']}: {x['desc']}" for x in m["inputs"]]
    lines.append("outputs:")
    lines += [f"  {x['name']}: {x['desc']}" for x in m["outputs"]]
    lines.append(f"gears: {m['gears'] or 'none'}")
    dyn = m.get("dynamic")
    if dyn:
        lines.append("dynamic dims: " + ", ".join(
            f"{d['name']} in [{d['min']}, {d['max'] if d['max'] is not None else 'inf'}]"
            for d in _dec(dyn)["dims"].values()))
    else:
        lines.append("dynamic dims: none (static shapes)")
    lines.append(f"ops ({info['nodes']} nodes, {info['constants']} constants, "
                 f"{fmt_bytes(info['constant_bytes'])} of weights):")
    lines += [f"  {k:28s} {v}" for k, v in sorted(info["op_counts"].items(), key=lambda kv: -kv[1])]
    mp = info["memory_plan"]
    lines.append(f"memory plan: arena {fmt_bytes(mp['arena_bytes'])}, lower bound "
                 f"{fmt_bytes(mp['lower_bound_bytes'])} ({mp['arena_over_lower_bound']}x), naive "
                 f"{fmt_bytes(mp['naive_bytes'])}; {mp['buffers']} buffers, {mp['inplace_reuses']} "
                 f"in-place reuses, strategy {mp['strategy']}, alignment {mp['alignment']}")
    lines.append("sections:")
    lines += [f"  {s['name']:10s} {fmt_bytes(s['size']):>10s}  sha256 {s['sha256']}" for s in info["sections"]]
    lines += [f"note: {n}" for n in info["notes"]]
    lines += ["graph:", info["graph"]]
    return "\n".join(lines)
