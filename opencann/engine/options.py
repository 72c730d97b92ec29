"""Compile options: `CompileOptions`, every option `opencann.compile`, ``torch.compile(
backend="opencann", options=...)``, the training backend and ATC-style gears accept, with
its type, default, validation and meaning. Users pass a dict (``options={"streams": 2}``);
`CompileOptions.from_dict` validates it (one ValueError line naming the option and what
it takes) and readers take defaults from here (`option`), never spell their own. The
option table of the docs (``docs/guide/options.md``) is generated from the fields
(`opencann.engine.options_doc`) and a test keeps it current.
Kept apart from the pipeline so that every entry point validates the same way."""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..log import logger
from ..ops import OpKind, get_op
from ..ops.kernels.int8_quantize import check_record, check_skip_layers
from ..passes.memory import DEFAULT_ALIGNMENT
from ..runtime.pool import DEFAULT_CONCURRENT_CALLS
from ..runtime.shape_cache import DEFAULT_PLAN_CACHE_SIZE

#: option groups: "compile" options reach the pipeline (`check_options`); "gears" are
#: taken by `opencann.compile` (`opencann.engine.gears`); "training" by the training backend
GROUPS = ("compile", "gears", "training")


def _opt(default: Any, kind: str, doc: str, group: str = "compile", shown: str = "") -> Any:
    """A `CompileOptions` field: ``kind`` (the type as the docs name it), ``doc`` (one
    sentence), ``group`` (`GROUPS`), ``shown`` (the default as the docs show it, when it
    depends on the machine)."""
    meta = {"kind": kind, "doc": doc, "group": group, "shown": shown}
    if isinstance(default, (list, dict)):
        raise TypeError("mutable defaults are not allowed; use a tuple")
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class CompileOptions:
    """Every compile option, typed, with its default. Build it with `from_dict` (which
    validates); read a plain options dict through `option`."""

    disable: Tuple[str, ...] = _opt(
        (), "list of pass names", "Passes switched off, by name (`default_pipeline().names()`).")
    enable: Tuple[str, ...] = _opt(
        (), "list of pass names", "Passes switched on that are off by default.")
    verify: bool = _opt(False, "bool", "Run the IR verifier after each pass and check the memory plan.")
    alignment: int = _opt(DEFAULT_ALIGNMENT, "power of two (bytes)",
                          "Alignment of every buffer in the arena.")
    inplace: bool = _opt(True, "bool", "Let outputs reuse a dead input's buffer (in-place planning).")
    copy_out: bool = _opt(False, "bool", "Plan outputs out of the arena (copied out) instead of "
                                         "handing out arena-backed tensors.")
    precision_mode: Optional[str] = _opt(
        None, "CANN precision mode", "CANN precision mode (`opencann.passes.prepare.precision.MODES`, "
        "e.g. 'allow_mix_precision_bf16'); unset: dtypes unchanged.")
    keep_fp32: Tuple[str, ...] = _opt(
        (), "list of op names", "Ops kept in fp32 under a lowering precision_mode (e.g. 'SoftmaxV2'; a fused op "
        "such as 'LinearAct' keeps the ops it is formed from).")
    keep_dtype: Tuple[str, ...] = _opt(
        (), "list of node names", "Nodes kept in their original dtype under any precision_mode "
        "(CANN ATC --keep_dtype; names as the captured program's, e.g. 'addmm_1').")
    node_precision: Optional[Dict[str, str]] = _opt(
        None, "dict node name -> 'fp32', 'bf16' or 'fp16'", "The precision each named node "
        "computes in, over the precision_mode's lists (what opencann.tune chooses).")
    lower_ops: Tuple[str, ...] = _opt(
        (), "list of op names", "Ops lowered under a mixed precision_mode even when the default "
        "keep-fp32 list names them (CANN modify_mixlist white-list).")
    host_fallback: bool = _opt(True, "bool", "Run ops without a converter on the host; False: "
                                             "refuse to compile them.")
    concurrent_calls: int = _opt(
        DEFAULT_CONCURRENT_CALLS, "positive int", "The most calls run at once, each with its own arena.",
        shown="min(8, CPU count)")
    check_aliasing: Optional[bool] = _opt(
        None, "bool", "Check at run time that no kernel writes memory another value still "
        "needs; unset: the OPENCANN_CHECK_ALIASING environment variable decides.")
    fusion_switch_file: Optional[str] = _opt(
        None, "path", "A CANN fusion switch file (JSON) turning passes on or off; merged into "
        "disable / enable.")
    dump_graph: Optional[str] = _opt(
        None, "directory path", "Write the graph after each stage as DOT and JSON into this "
        "directory (created if missing).")
    plan_cache_size: int = _opt(
        DEFAULT_PLAN_CACHE_SIZE, "positive int", "The most concrete shapes a model with "
        "dynamic dims keeps memory plans for.")
    disable_rewrites: Tuple[str, ...] = _opt(
        (), "list of rewrite ids", "Single rewrites switched off, as '<pass>@<root node>' ids "
        "from the compile report (e.g. 'fuse_conv_act@convolution_1').")
    memory_aware_order: bool = _opt(True, "bool", "Order nodes to lower the arena's peak.")
    quant_config: Optional[Dict[str, Any]] = _opt(
        None, "dict", "int8 layers for the quantize_int8 pass ({'layers': {node: {'scale_d', "
        "'offset_d'}}, 'skip_layers': [...], 'dynamic_linear': bool}); opencann.quantize fills it. A "
        "name of no layer of the graph is an error ('check_names': False ignores it, for a config "
        "made for a whole model applied to a part).")
    streams: int = _opt(1, "positive int", "The most logical streams independent branches run "
                                           "on at once (1: one stream).")
    fuse_elementwise_fastmath: bool = _opt(
        False, "bool", "Compile fused elementwise kernels with fastmath (may change rounding).")
    stream_costs: str = _opt(
        "measured", "'measured' or 'model'", "How streams are balanced: node times measured "
        "at binding, or the cost model's FLOPs and bytes.")
    freezing: bool = _opt(True, "bool", "torch.compile backend: treat parameters and buffers "
                                        "as constants (folded, prepacked).")
    share_weights: bool = _opt(
        False, "bool", "Weights stay the module's own memory instead of a snapshot, so graphs "
        "compiled from one module (opencann.llm's prefill and decode) hold them once; a changed "
        "module is still refused at the next call.")
    dynamic_batch_size: Optional[Tuple[int, ...]] = _opt(
        None, "list of ints", "ATC-style gears: the batch sizes (dim 0 of every input) to "
        "compile plans for.", group="gears")
    dynamic_image_size: Optional[Tuple[Tuple[int, int], ...]] = _opt(
        None, "list of (height, width)", "ATC-style gears: the image sizes of 4-D (N, C, H, W) "
        "inputs to compile plans for.", group="gears")
    dynamic_dims: Optional[Tuple[Tuple[int, ...], ...]] = _opt(
        None, "list of int tuples", "ATC-style gears: values of the dims named in "
        "dynamic_shapes, one tuple per gear.", group="gears")
    memory_budget: Optional[float] = _opt(
        None, "fraction in (0, 1] or int bytes", "Training backend: the planned peak allowed "
        "(recomputation keeps under it); unset: no budget.", group="training")

    @classmethod
    def names(cls, group: str = "compile") -> Tuple[str, ...]:
        """The option names of ``group`` (`GROUPS`), in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata["group"] == group)

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of option ``name``; KeyError for an unknown name."""
        for f in dataclasses.fields(cls):
            if f.name == name:
                return f.default
        raise KeyError(f"no compile option {name!r}")

    @classmethod
    def from_dict(cls, options: Optional[Mapping[str, Any]]) -> "CompileOptions":
        """Validate the compile options ``options`` (a dict; None: all defaults) and return
        them typed; lists become tuples, a ``fusion_switch_file`` is read and merged into
        ``disable`` / ``enable``. Raises ValueError (one line naming the option and what it
        takes) for an unknown option or a bad value."""
        given = check_options(options)
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})

    def to_dict(self) -> Dict[str, Any]:
        """Every option with its value (default when not given), lists as lists."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in dataclasses.fields(self)}


#: compile options: what `check_options` accepts
KNOWN_OPTIONS = frozenset(CompileOptions.names("compile"))
#: ATC-style gear options (`opencann.engine.gears`)
GEAR_OPTIONS = CompileOptions.names("gears")
#: options of the training backend only (`opencann.dynamo.training`)
TRAINING_OPTIONS = frozenset(CompileOptions.names("training"))


def option(options: Optional[Mapping[str, Any]], name: str) -> Any:
    """Option ``name`` of a (validated) options dict: its value, or `CompileOptions`'s
    default when it is not given or None. KeyError for an unknown name."""
    v = (options or {}).get(name)
    return CompileOptions.default(name) if v is None else v


def complete(options: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """A validated options dict with every compile option set (given value or default):
    what the passes read, so none of them needs a default of its own."""
    full = CompileOptions.from_dict(options).to_dict()
    return {k: full[k] for k in KNOWN_OPTIONS}


_BOOL_OPTIONS = ("verify", "inplace", "copy_out", "host_fallback", "check_aliasing",
                 "memory_aware_order", "fuse_elementwise_fastmath", "freezing", "share_weights")
_LIST_OPTIONS = ("disable", "enable", "keep_fp32", "disable_rewrites", "keep_dtype", "lower_ops")


def _check_keep_fp32(name: str) -> None:
    """Raises ValueError (one line) for a ``keep_fp32`` entry that is no op name, or a
    fused op mixed precision cannot see (it runs before fusion; ``OpDef.fused_from``)."""
    try:
        op = get_op(name)
    except KeyError as e:
        raise ValueError(f"option 'keep_fp32': {e.args[0]}; it takes opencann op names "
                         "such as 'SoftmaxV2' or 'LayerNorm'") from None
    if op.kind == OpKind.FUSED and not op.fused_from:
        raise ValueError(f"option 'keep_fp32': {name} is formed by fusion after mixed "
                         f"precision from ops that also run unfused; name its parts "
                         f"instead (e.g. 'MatMulV2', 'Mul', 'Silu' as the compile "
                         f"report's pre-fusion ops show them)")


def _check_precision_options(options: Dict[str, Any]) -> None:
    """Raises ValueError (one line) for an unknown ``precision_mode``, a bad ``keep_fp32``
    or ``lower_ops`` op name or a bad ``node_precision``."""
    if options.get("precision_mode") is not None:
        from ..passes.prepare.precision import low_dtype
        low_dtype(options["precision_mode"])   # raises its one line for an unknown mode
    for name in options.get("keep_fp32") or ():
        _check_keep_fp32(name)
    for name in options.get("lower_ops") or ():
        try:
            get_op(name)
        except KeyError as e:
            raise ValueError(f"option 'lower_ops': {e.args[0]}; it takes opencann op names "
                             "such as 'SoftmaxV2'") from None
    _check_node_precision(options.get("node_precision"))


def _check_node_precision(np: Any) -> None:
    """Raises ValueError (one line) unless ``np`` is None or a dict of node names to
    'fp32', 'bf16' or 'fp16' (the names are checked against the graph by the precision
    pass, `opencann.passes.prepare.precision.node_overrides`)."""
    from ..passes.prepare.precision import PRECISIONS
    if np is None:
        return
    if not isinstance(np, dict) or not all(isinstance(k, str) for k in np):
        raise ValueError(f"option 'node_precision' takes a dict of node names to "
                         f"{sorted(PRECISIONS)}, e.g. {{'addmm_1': 'fp32'}}, got {np!r}")
    for k, v in np.items():
        if v not in PRECISIONS:
            raise ValueError(f"option 'node_precision': {k!r} -> {v!r}; use one of "
                             f"{sorted(PRECISIONS)}")


def check_options(options: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """Validate compile options; returns the given ones (a new dict, ``fusion_switch_file``
    merged into ``disable`` / ``enable``). Raises ValueError naming the option and fix."""
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"options must be a dict such as {{'verify': True}}, got "
                         f"{type(options).__name__} {options!r}")
    options = dict(options or {})
    unknown = set(options) - KNOWN_OPTIONS
    if unknown:
        raise ValueError(f"unknown compile option(s) {sorted(unknown)}; known options: "
                         f"{sorted(KNOWN_OPTIONS)}")
    for k in _BOOL_OPTIONS:
        if k in options and not isinstance(options[k], bool):
            raise ValueError(f"option {k!r} takes True or False, got {options[k]!r}")
    for k in _LIST_OPTIONS:
        v = options.get(k)
        if v is not None and (not isinstance(v, (list, tuple, set, frozenset))
                              or not all(isinstance(x, str) for x in v)):
            eg = repr([v]) if isinstance(v, str) else "['fuse_silu']"
            raise ValueError(f"option {k!r} takes a list of names, e.g. {eg}, got {v!r}")
        if isinstance(v, (set, frozenset)):
            options[k] = sorted(v)    # a model file stores lists, not sets
    for rid in options.get("disable_rewrites") or ():
        if not all(rid.partition("@")[::2]):
            raise ValueError(f"option 'disable_rewrites' takes rewrite ids '<pass>@<root node>' "
                             f"as in the compile report's applied entries (e.g. "
                             f"'fuse_conv_act@convolution_1'), got {rid!r}")
    _check_precision_options(options)
    c = options.get("concurrent_calls")
    if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
        raise ValueError(f"option 'concurrent_calls' takes a positive int (the most calls "
                         f"run at once, each with its own arena; e.g. 4), got {c!r}")
    c = options.get("streams")
    if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
        raise ValueError(f"option 'streams' takes a positive int (the most logical streams "
                         f"independent branches run on at once; 1 = one stream, e.g. 2), got {c!r}")
    c = options.get("stream_costs")
    if c is not None and c not in ("measured", "model"):
        raise ValueError(f"option 'stream_costs' takes 'measured' (time each node at binding, "
                         f"the default) or 'model' (FLOPs and bytes by OpDef.cost), got {c!r}")
    c = options.get("plan_cache_size")
    if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
        raise ValueError(f"option 'plan_cache_size' takes a positive int (the most concrete "
                         f"shapes a model with dynamic dims keeps plans for; e.g. 8), got {c!r}")
    if options.get("quant_config") is not None:
        options["quant_config"] = _check_quant_config(options["quant_config"])
    d = options.get("dump_graph")
    if d is not None and (not isinstance(d, str) or os.path.isfile(d)):
        raise ValueError(f"option 'dump_graph' takes a directory path (created if missing) for "
                         f"the graph after each stage as DOT and JSON, got {d!r}")
    if "fusion_switch_file" in options:
        off, on = read_fusion_switch(options.pop("fusion_switch_file"))
        for k, names in (("disable", off), ("enable", on)):
            given = list(options.get(k) or ())
            options[k] = given + [n for n in names if n not in given]
    a = options.get("alignment")
    if a is not None and (isinstance(a, bool) or not isinstance(a, int) or a <= 0 or a & (a - 1)):
        raise ValueError(f"option 'alignment' takes a power of two in bytes (e.g. 64), got {a!r}")
    return options


def _check_quant_config(cfg: Any) -> Dict[str, Any]:
    """``cfg`` with its ``skip_layers`` as a list (a set sorted: a model file stores
    lists; a new dict, the caller's untouched). Raises ValueError (one line) for a
    ``quant_config`` that is not a dict of the keys
    ``layers`` (None or node name -> a record `check_record` accepts: {"scale_d": finite float >=
    2**-126, "offset_d": int in [0, 255]}, optional "accum" / "out" the same; the line names
    the layer, the field and the bad value), ``skip_layers`` (None or a list of names:
    `check_skip_layers`, the rule ``create_quant_config`` shares) and ``dynamic_linear``
    (bool), ``check_names`` (bool, default True: the int8 passes raise for a name of no
    layer of the graph, `opencann.passes.fusion.quant_names.check_layer_names`; False
    ignores such names, for a config made for a whole model applied to a part of it)."""
    fix = ("give {'layers': {node: {'scale_d': step, 'offset_d': zero_point}}, 'skip_layers': "
           "[names], 'dynamic_linear': bool}, as opencann.quantize makes it")
    known = ("layers", "skip_layers", "dynamic_linear", "check_names")
    if not isinstance(cfg, dict):
        raise ValueError(f"option 'quant_config' got {cfg!r:.80}; {fix}")
    unknown = sorted(map(repr, set(cfg) - set(known)))
    if unknown:
        raise ValueError(f"option 'quant_config' has no key {', '.join(unknown)[:80]} (it takes "
                         f"{', '.join(known)}); {fix}")
    layers = cfg.get("layers")
    if layers is not None and not isinstance(layers, dict):
        raise ValueError(f"option 'quant_config': 'layers' must map node names to "
                         f"{{'scale_d': float > 0, 'offset_d': int}}, got {layers!r:.60}; {fix}")
    for name, rec in (layers or {}).items():
        if not isinstance(name, str):
            raise ValueError(f"option 'quant_config': 'layers' takes node names (str) as keys, "
                             f"got {name!r} ({type(name).__name__}); {fix}")
        check_record(name, rec)
    skip = check_skip_layers(cfg.get("skip_layers"))
    for key in ("dynamic_linear", "check_names"):
        flag = cfg.get(key)
        if flag is not None and not isinstance(flag, bool):
            raise ValueError(f"option 'quant_config': {key!r} takes True or False, got {flag!r:.40}")
    return dict(cfg, skip_layers=skip) if isinstance(cfg.get("skip_layers"), (set, frozenset)) else cfg


_SECTIONS = ("GraphFusion", "UBFusion")


def read_fusion_switch(path: str) -> Tuple[List[str], List[str]]:
    """Read a fusion switch file in CANN's JSON form (ATC ``--fusion_switch_file``)::

        {"Switch": {"GraphFusion": {"ConvBatchnormFusionPass": "off"},
                    "UBFusion": {"ALL": "off", "fuse_conv_act": "on"}}}

    Keys are CANN pass names with an opencann equivalent (``Pass.cann_names``, each
    from CANN's fusion pattern reference) or opencann pass names
    (``default_pipeline().names()``); values "on" or "off". ``"ALL"`` switches every
    fusion pass of that section; named entries override it. Any other CamelCase key is a
    CANN pass opencann has no equivalent of (CANN has hundreds, most for its own
    operators): a WARNING on the ``opencann`` logger listing the known names, and the
    entry is ignored, as a file written for ATC must still compile here.
    Returns (passes switched off, passes switched on), opencann names. Raises
    ValueError (one line) for a missing or non-JSON file, another structure, another
    value, or an unknown opencann-style name (lower_case: a misspelt pass of ours),
    listing the known ones."""
    from ..passes import default_pipeline  # the pass list; passes never import options
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        raise ValueError(f"option 'fusion_switch_file': {path!r} is not a file; give the path "
                         "of a JSON file such as {\"Switch\": {\"GraphFusion\": "
                         "{\"ConvBatchnormFusionPass\": \"off\"}}}")
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"fusion switch file {path}: not JSON ({str(e).splitlines()[0]})") from None
    sw = doc.get("Switch") if isinstance(doc, dict) else None
    if not isinstance(sw, dict) or set(doc) != {"Switch"} or set(sw) - set(_SECTIONS) \
            or not all(isinstance(v, dict) for v in sw.values()):
        raise ValueError(f"fusion switch file {path}: expected {{\"Switch\": {{\"GraphFusion\": "
                         "{...}, \"UBFusion\": {...}}} (pass name -> \"on\"/\"off\"), got "
                         f"{json.dumps(doc)[:120]}")
    passes = default_pipeline().passes
    ours = {p.name: p.name for p in passes}
    cann = {c: p.name for p in passes for c in p.cann_names}
    off: List[str] = []
    on: List[str] = []
    for section, entries in sw.items():
        in_section = [p.name for p in passes if p.switch_section == section]
        for key, val in sorted(entries.items(), key=lambda kv: kv[0] != "ALL"):
            if val not in ("on", "off"):
                raise ValueError(f"fusion switch file {path}: {section}.{key} is {val!r}; use "
                                 "\"on\" or \"off\"")
            if key == "ALL":
                names = in_section
            elif key in cann or key in ours:
                names = [cann.get(key) or ours[key]]
            else:
                _unknown_switch(path, section, key, cann, ours)
                continue
            target, other = (off, on) if val == "off" else (on, off)
            for n in names:   # a later entry (a named pass after ALL) wins
                if n in other:
                    other.remove(n)
                if n not in target:
                    target.append(n)
    return off, on


def _unknown_switch(path, section: str, key: str, cann: Dict[str, str], ours: Dict[str, str]) -> None:
    """A switch file entry naming no pass we know: ValueError for a lower_case key (our
    naming: a misspelt opencann pass), else a WARNING (a CANN pass without an opencann
    equivalent, ignored); both list the known names."""
    known = (f"known: ALL, {', '.join(sorted(cann))} (CANN names), "
             f"{', '.join(sorted(ours))} (opencann names)")
    if re.fullmatch(r"[a-z0-9_]+", key):
        raise ValueError(f"fusion switch file {path}: unknown pass {key!r} in {section}; {known}")
    logger.warning("fusion switch file %s: %s.%s has no opencann equivalent and is ignored; %s",
                   path, section, key, known)
