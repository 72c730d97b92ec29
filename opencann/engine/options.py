"""Compile options: the names `opencann.compile`, ``torch.compile(backend="opencann",
options=...)`` and the training backend accept, and their validation (one ValueError
line naming the option and what it takes). Kept apart from the compiler so that every
entry point validates the same way without importing it."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

from ..ops import get_op

KNOWN_OPTIONS = {"disable", "enable", "verify", "alignment", "inplace", "copy_out",
                 "precision_mode", "keep_fp32", "host_fallback", "concurrent_calls",
                 "check_aliasing", "fusion_switch_file", "dump_graph", "plan_cache_size",
                 "disable_rewrites", "memory_aware_order", "streams", "fuse_elementwise_fastmath",
                 "stream_costs", "freezing"}

_BOOL_OPTIONS = ("verify", "inplace", "copy_out", "host_fallback", "check_aliasing",
                 "memory_aware_order", "fuse_elementwise_fastmath", "freezing")
_LIST_OPTIONS = ("disable", "enable", "keep_fp32", "disable_rewrites")


def check_options(options: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """Validate compile options; raises ValueError naming the option and what it takes."""
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
        if v is not None and (isinstance(v, str) or not all(isinstance(x, str) for x in v)):
            eg = repr([v]) if isinstance(v, str) else "['fuse_silu']"
            raise ValueError(f"option {k!r} takes a list of names, e.g. {eg}, got {v!r}")
    for rid in options.get("disable_rewrites") or ():
        if not all(rid.partition("@")[::2]):
            raise ValueError(f"option 'disable_rewrites' takes rewrite ids '<pass>@<root node>' "
                             f"as in the compile report's applied entries (e.g. "
                             f"'fuse_conv_act@convolution_1'), got {rid!r}")
    if "keep_fp32" in options:
        for name in options["keep_fp32"]:
            try:
                get_op(name)
            except KeyError as e:
                raise ValueError(f"option 'keep_fp32': {e.args[0]}; it takes opencann op names "
                                 "such as 'SoftmaxV2' or 'LayerNorm'") from None
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


_SECTIONS = ("GraphFusion", "UBFusion")


def read_fusion_switch(path: str) -> Tuple[List[str], List[str]]:
    """Read a fusion switch file in CANN's JSON form (ATC ``--fusion_switch_file``)::

        {"Switch": {"GraphFusion": {"ConvBatchnormFusionPass": "off"},
                    "UBFusion": {"ALL": "off", "fuse_conv_act": "on"}}}

    Keys are CANN pass names with an opencann equivalent (``Pass.cann_names``) or
    opencann pass names (``default_pipeline().names()``); values "on" or "off".
    ``"ALL"`` switches every fusion pass of that section; named entries override it.
    Returns (passes switched off, passes switched on), opencann names. Raises
    ValueError (one line) for a missing or non-JSON file, another structure, another
    value, or an unknown pass name (listing the known ones)."""
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
                raise ValueError(f"fusion switch file {path}: unknown pass {key!r} in {section}; "
                                 f"known: ALL, {', '.join(sorted(cann))} (CANN names), "
                                 f"{', '.join(sorted(ours))} (opencann names)")
            target, other = (off, on) if val == "off" else (on, off)
            for n in names:   # a later entry (a named pass after ALL) wins
                if n in other:
                    other.remove(n)
                if n not in target:
                    target.append(n)
    return off, on
