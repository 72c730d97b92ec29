"""Compile options: the names `opencann.compile`, ``torch.compile(backend="opencann",
options=...)`` and the training backend accept, and their validation (one ValueError
line naming the option and what it takes). Kept apart from the compiler so that every
entry point validates the same way without importing it."""
from __future__ import annotations

from typing import Any, Dict, Optional

from .ops import get_op

KNOWN_OPTIONS = {"disable", "enable", "verify", "alignment", "inplace", "copy_out",
                 "precision_mode", "keep_fp32", "host_fallback", "concurrent_calls",
                 "check_aliasing"}

_BOOL_OPTIONS = ("verify", "inplace", "copy_out", "host_fallback", "check_aliasing")
_LIST_OPTIONS = ("disable", "enable", "keep_fp32")


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
            raise ValueError(f"option {k!r} takes a list of names, e.g. [{v!r}], got {v!r}")
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
    a = options.get("alignment")
    if a is not None and (isinstance(a, bool) or not isinstance(a, int) or a <= 0 or a & (a - 1)):
        raise ValueError(f"option 'alignment' takes a power of two in bytes (e.g. 64), got {a!r}")
    return options
