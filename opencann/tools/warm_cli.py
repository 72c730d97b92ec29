"""The ``opencann warm`` command's arguments and runner (`add_arguments`, `run_args`):
`opencann.tools.numba_warm.warm` with a rich progress bar (rich is already a dependency
of the command line) and a summary line."""
from __future__ import annotations

import argparse
import json

from .argtypes import positive_int


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``warm`` options to ``ap`` (a parser or a CLI subparser)."""
    ap.add_argument("--processes", type=positive_int, metavar="N",
                    help="worker processes compiling at once (default: the CPUs this process "
                    "may use, at most one per kernel function)")
    ap.add_argument("--only", nargs="+", metavar="NAME",
                    help="compile only the kernels whose module.function contains one of "
                    "these, e.g. --only decode_attention gemv")
    ap.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    return ap


def _short(sig: str, n: int = 70) -> str:
    return sig if len(sig) <= n else sig[:n - 3] + "..."


def run_args(args: argparse.Namespace, console) -> int:
    """Run `warm` from parsed `add_arguments` options, printing progress (on a terminal)
    and ``compiled N, already cached N, skipped N of N kernel signatures in S s`` (``, N
    not done`` after a worker failed), or JSON, to ``console`` (a rich Console). Returns
    0, or 1 when a worker process failed (each failure one line). Raises OSError (cache
    directory not writable) and ValueError (``--only`` matches nothing): the CLI prints
    them as one error line (exit 2)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from .numba_warm import warm
    columns = (TextColumn("compiling kernels"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("{task.description}"))
    with Progress(*columns, console=console, transient=True,
                  disable=args.json or not console.is_terminal) as bar:
        task = bar.add_task("", total=None)

        def progress(done: int, total: int, function: str) -> None:
            bar.update(task, completed=done, total=total, description=function.rsplit(".", 1)[-1])
        r = warm(processes=args.processes, only=args.only, progress=progress)
    if args.json:
        print(json.dumps(r.to_dict(), indent=2))
    else:
        left = r.total - r.compiled - r.cached - len(r.skipped)
        console.print(f"compiled {r.compiled}, already cached {r.cached}, skipped {len(r.skipped)}"
                      + (f", {left} not done" if left else "")
                      + f" of {r.total} kernel signatures in {r.seconds:.1f} s ({r.cache_dir})",
                      markup=False, highlight=False)
        for s in r.skipped:
            console.print(f"  skipped {s.function} {_short(s.signature)}: {s.reason}",
                          markup=False, highlight=False)
        for f in r.failed:
            console.print(f"  failed: {f}", markup=False, highlight=False)
    return 0 if r.ok else 1
