"""CANN's precision files, read and written: ATC ``--keep_dtype`` (a text file, one node
name per line, kept in its original dtype), ``--modify_mixlist`` (JSON changing the
mixed-precision lists by op type) and the int8 layers' quantization record (AMCT's role:
`write_quant_config`)::

    {"black-list": {"to-add": ["MatMulV2"], "to-remove": []},
     "white-list": {"to-add": ["SoftmaxV2"], "to-remove": []}}

(source: Ascend "ATC parameters: --keep_dtype, --modify_mixlist"). Black list: ops kept
in fp32 (opencann's ``keep_fp32`` option); white list: ops lowered (``lower_ops``); a
black-list "to-remove" lowers the op, a white-list "to-remove" keeps it in fp32. CANN's
gray list (ops following their inputs) is opencann's default for elementwise ops and is
refused here, as are op names opencann does not know.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List, Tuple

_LISTS = ("black-list", "white-list")
_ACTIONS = ("to-add", "to-remove")


def read_keep_dtype(path: str) -> List[str]:
    """Node names from a ``--keep_dtype`` file: one per line; blank lines and lines
    starting with ``#`` skipped; surrounding spaces stripped; each name once. A file
    without names keeps no node (what `write_keep_dtype` writes when every node is
    lowered): an empty list. Raises ValueError (one line) for a missing file or one that
    is not UTF-8 text."""
    if os.path.isdir(path):
        raise ValueError(f"--keep_dtype {path}: is a directory; give the file itself, one node name per line")
    if not os.path.isfile(path):
        raise ValueError(f"--keep_dtype {path}: no such file; write one node name per line "
                         "(opencann tune --keep-dtype-out writes one)")
    try:
        with open(path, encoding="utf-8-sig") as f:
            names = [ln.strip() for ln in f if ln.strip() and not ln.strip().startswith("#")]
    except UnicodeDecodeError as e:
        raise ValueError(f"--keep_dtype {path}: not UTF-8 text ({e.reason} at byte {e.start}); "
                         "write one node name per line") from None
    return list(dict.fromkeys(names))


def write_keep_dtype(path: str, names: Iterable[str]) -> None:
    """Write ``names`` to ``path``, one per line (CANN's ``--keep_dtype`` form); no names:
    an empty file (keep no node), which `read_keep_dtype` and ``opencann atc
    --keep_dtype`` take."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(f"{n}\n" for n in names)


def _json(path: str, flag: str, fix: str):
    """The JSON document of ``path`` (UTF-8, a byte-order mark as some editors write it
    skipped); ValueError (one line naming ``flag`` and the path)
    for a missing file (with ``fix``) or one that is not JSON."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a directory; give the file itself ({fix})")
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: no such file; {fix}")
    try:
        with open(path, encoding="utf-8-sig") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:     # JSONDecodeError, or an int of > 4300 digits
        raise ValueError(f"{flag} {path}: not JSON ({str(e).splitlines()[0]})") from None


def read_mixlist(path: str) -> Tuple[List[str], List[str]]:
    """(op types kept in fp32, op types lowered) from a ``--modify_mixlist`` JSON file
    (module docstring), as opencann's ``keep_fp32`` / ``lower_ops`` options take them.
    Raises ValueError (one line) for a missing file, non-JSON, another structure, a gray
    list, or an op opencann does not know (naming it)."""
    from ..ops import get_op
    doc = _json(path, "--modify_mixlist", 'write JSON such as {"black-list": {"to-add": ["MatMulV2"]}}')
    if isinstance(doc, dict) and "gray-list" in doc:
        raise ValueError(f"--modify_mixlist {path}: gray-list is not taken (opencann's "
                         "elementwise ops already follow their inputs); use black-list or white-list")
    if (not isinstance(doc, dict) or set(doc) - set(_LISTS) or not all(
            isinstance(v, dict) and not set(v) - set(_ACTIONS)
            and all(isinstance(x, list) and all(isinstance(o, str) for o in x) for x in v.values())
            for v in doc.values())):
        raise ValueError(f"--modify_mixlist {path}: expected {{\"black-list\": {{\"to-add\": "
                         f"[op, ...], \"to-remove\": [...]}}, \"white-list\": {{...}}}}, got "
                         f"{json.dumps(doc)[:120]}")
    keep: List[str] = []
    lower: List[str] = []
    for lst, actions in doc.items():
        for action, ops in actions.items():
            for op in ops:
                try:
                    get_op(op)
                except KeyError as e:
                    raise ValueError(f"--modify_mixlist {path}: {lst}.{action}: {e.args[0]}") from None
                to_keep = (lst == "black-list") == (action == "to-add")
                (keep if to_keep else lower).append(op)
    both = sorted(set(keep) & set(lower))
    if both:
        raise ValueError(f"--modify_mixlist {path}: {both} both kept in fp32 and lowered; "
                         "name each op once")
    return keep, lower


def write_mixlist(path: str, keep: Iterable[str], lower: Iterable[str]) -> Dict[str, Dict]:
    """Write a ``--modify_mixlist`` file adding ``keep`` to the black list and ``lower``
    to the white list; returns the document written."""
    doc = {"black-list": {"to-add": sorted(set(keep))}, "white-list": {"to-add": sorted(set(lower))}}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    return doc


def write_quant_config(path: str, cfg: Dict) -> None:
    """Write the compile option ``quant_config`` ``cfg`` (int8 layers by node name with
    their activation records ``scale_d`` / ``offset_d``, ``skip_layers``,
    ``dynamic_linear``, ``check_names``: `opencann.engine.options` checks it) as JSON: in
    CANN, AMCT quantizes a model before ATC compiles it and keeps these records in its
    record file; here ``opencann atc --quant_config FILE`` (or the option, through
    `read_quant_config`) quantizes those layers again with the same records."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def read_quant_config(path: str) -> Dict:
    """The ``quant_config`` option written by `write_quant_config` (``opencann tune
    --quant-config-out``). Raises ValueError (one line) for a missing file, non-JSON or a
    document the option refuses (the option's check, naming the layer and field)."""
    from ..engine.options import check_options
    cfg = _json(path, "--quant_config", "opencann tune --candidates fp32,int8 --quant-config-out FILE writes one")
    if cfg is None:     # the option's None is "no quant_config": a file naming none is a mistake
        raise ValueError(f"--quant_config {path}: holds null, no int8 layer; give {{\"layers\": {{node: "
                         f"{{\"scale_d\": step, \"offset_d\": zero_point}}}}}} (opencann tune "
                         f"--quant-config-out writes one), or leave --quant_config out")
    try:
        cfg = check_options({"quant_config": cfg})["quant_config"]
    except ValueError as e:
        raise ValueError(f"--quant_config {path}: {e}") from None
    return cfg


__all__ = ["read_keep_dtype", "read_mixlist", "read_quant_config", "write_keep_dtype", "write_mixlist",
           "write_quant_config"]
