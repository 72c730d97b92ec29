"""The ``opencann tune`` command's arguments and runner (`add_arguments`, `run_args`),
apart from `opencann.tools.tune` so that building the CLI parser does not import the op
library; the search is imported when the command runs. The table is printed with rich
(the project's terminal library, DESIGN.md)."""
from __future__ import annotations

import argparse

from .argtypes import output_file, positive_int


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``tune`` options to ``ap`` (a CLI subparser)."""
    ap.add_argument("model", help="zoo name (minilm, bert-base, gpt2, resnet50) or file.py:factory")
    ap.add_argument("--budget", default="msprobe", help="the accuracy gate: msprobe (default), "
                    "or file.py:metric, a function metric(actual_outputs, eager_outputs) -> bool")
    ap.add_argument("--candidates", default="fp32,bf16",
                    help="precisions, highest first (fp32,bf16; fp32,bf16,fp16; fp32,bf16,int8: "
                    "int8 calibrated on the example inputs)")
    ap.add_argument("--batch", type=positive_int, default=1)
    ap.add_argument("--seq", type=positive_int, default=128)
    ap.add_argument("--time-budget", type=float, default=120.0, metavar="S",
                    help="seconds the search may spend lowering and fixing (default 120)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-timing", action="store_true",
                    help="keep every node that passes the gate low (skip the per-node timing)")
    ap.add_argument("--out", type=output_file, help="write the tuned model file (.ocm) here")
    ap.add_argument("--keep-dtype-out", type=output_file,
                    help="write CANN's --keep_dtype file (nodes kept in fp32) here")
    ap.add_argument("--mixlist-out", type=output_file,
                    help="write CANN's --modify_mixlist JSON (by op type) here")
    ap.add_argument("--quant-config-out", type=output_file,
                    help="write the int8 layers' calibration records (JSON; opencann atc --quant_config) here")
    ap.add_argument("--rows", type=positive_int, default=30, help="nodes shown in the table")
    return ap


def _metric(spec: str):
    """``file.py:function`` -> the function; ValueError (one line) otherwise."""
    import importlib.util
    import os
    path, _, fn = spec.rpartition(":")
    if not path.endswith(".py") or not fn:
        raise ValueError(f"--budget takes msprobe or file.py:metric, got {spec!r}")
    if not os.path.isfile(path):
        raise ValueError(f"--budget {spec}: {path} does not exist")
    mod_spec = importlib.util.spec_from_file_location("user_metric", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    if not callable(getattr(mod, fn, None)):
        raise ValueError(f"--budget {spec}: {path} has no function {fn!r}")
    return _one_line_errors(getattr(mod, fn), spec, path)


def _one_line_errors(metric, spec: str, path: str):
    """``metric`` whose failures are ValueError lines the command line prints as one
    ``error:`` line: an exception it raises (with the line of ``path`` where it was raised)
    and an answer that is not a bool (`tune_search._metric_verdict`'s TypeError)."""
    import functools
    import os
    import traceback
    from .tune_search import _metric_verdict

    @functools.wraps(metric)
    def checked(actual, expected):
        try:
            value = metric(actual, expected)
        except Exception as e:  # noqa: BLE001 - the user's file: reported in one line
            frames = [f for f in traceback.extract_tb(e.__traceback__)
                      if os.path.abspath(f.filename) == os.path.abspath(path)]
            at = f" at {path}:{frames[-1].lineno}" if frames else ""
            first = (str(e).splitlines() or [""])[0]
            raise ValueError(f"--budget {spec} raised {type(e).__name__}: {first}{at}") from e
        try:
            return _metric_verdict(value, metric)
        except TypeError as e:
            raise ValueError(str(e)) from e
    return checked


def table(res, rows: int):
    """A rich Table of ``res``'s nodes: name, op, module, precision, own cosine, times
    (µs) and why it is kept; kept nodes first, then the slowest."""
    from rich.table import Table
    t = Table(title=res.summary().splitlines()[0], title_justify="left")
    for col in ("node", "op", "module", "precision", "own cosine", "fp32 µs", "low µs", "kept because"):
        t.add_column(col, overflow="fold")
    order = sorted(res.nodes.values(), key=lambda c: (not c.why, -c.seconds.get("fp32", 0.0)))
    for c in order[:rows]:
        cos = min((v.cosine for v in c.own.values()), default=1.0)
        low = [v for k, v in c.seconds.items() if k != "fp32"]
        t.add_row(c.name, c.op, c.module, c.precision, f"{cos:.6f}",
                  f"{c.seconds['fp32'] * 1e6:.1f}" if "fp32" in c.seconds else "",
                  f"{low[0] * 1e6:.1f}" if low else "", c.why)
    return t


def run_args(args: argparse.Namespace, console, load) -> int:
    """Run ``opencann tune`` from parsed `add_arguments` options: loads the model with
    ``load(spec, batch, seq)`` (the CLI's loader), tunes, prints the table and writes
    --out / --keep-dtype-out / --mixlist-out / --quant-config-out. Returns 0. Raises ValueError (one line) for
    a bad --budget, --candidates or an .onnx / .ocm model."""
    if args.model.lower().endswith((".onnx", ".ocm")):
        raise ValueError(f"{args.model}: tune takes a PyTorch model (zoo name or file.py:factory); "
                         "its per-layer comparison runs eager PyTorch as the reference")
    budget = "msprobe" if args.budget == "msprobe" else _metric(args.budget)
    from .tune import check_candidates, tune
    # every comma-separated name counts: an empty one (fp32,,int8) is refused, not dropped
    cands = tuple(c.strip() for c in args.candidates.split(","))
    check_candidates(cands, f"--candidates {args.candidates}")   # before the model loads
    zm = load(args.model, args.batch, args.seq)
    with console.status(f"tuning {zm.name} (own errors, per-node timing, output check)..."):
        res = tune(zm.model, zm.example_inputs, budget=budget, candidates=cands,
                   time_budget_s=args.time_budget, seed=args.seed, timing=not args.no_timing)
    console.print(table(res, args.rows))
    for line in res.summary().splitlines()[1:]:
        console.print(line, markup=False, highlight=False)
    if args.out:   # the model file first: the search's result whatever an export meets
        from ..runtime.model_file import save
        save(res.compiled, args.out, description=f"tuned: {res.summary().splitlines()[0]}")
    res.export(args.keep_dtype_out, args.mixlist_out, args.quant_config_out)
    for what, path in (("model file", args.out), ("keep_dtype file", args.keep_dtype_out),
                       ("modify_mixlist file", args.mixlist_out), ("quant_config file", args.quant_config_out)):
        if path:
            console.print(f"wrote {what} {path}", markup=False, highlight=False)
    return 0


__all__ = ["add_arguments", "run_args", "table"]
