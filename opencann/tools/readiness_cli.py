"""The ``opencann readiness`` command's arguments (`add_arguments`) and its terminal
rendering of a `ReadinessReport` with rich (`print_report`: tables per section, the
verdict in colour), apart from `opencann.tools.readiness` so that building the CLI parser
does not import the op library; the check itself runs in ``opencann.cli.cmd_readiness``,
which loads the model as the other model commands do."""
from __future__ import annotations

import argparse

from .argtypes import output_file, positive_int
from .atc import concrete_input_shape

PRECISION_CHOICES = ("fp16", "bf16")
_VERDICT_STYLE = {"ready": "bold green", "ready with host ops": "bold yellow", "not ready": "bold red"}
_STATUS_STYLE = {"pass": "green", "warn": "yellow", "fail": "red"}


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``readiness`` options to ``ap`` (a parser or a CLI subparser)."""
    ap.add_argument("model", help="zoo name (resnet50, minilm, bert-base, gpt2), file.py:factory, "
                    "an .onnx file or an .ocm model file (opencann atc)")
    ap.add_argument("--device", default="vnpu:ascend910b",
                    help="vnpu:<preset> (ascend910, ascend910b, ascend310) or vnpu:<spec.json|.toml>")
    ap.add_argument("--precision", choices=PRECISION_CHOICES, default="fp16",
                    help="target precision: fp16 (compared under force_fp16) or bf16 "
                    "(allow_mix_precision_bf16)")
    ap.add_argument("--context", type=positive_int,
                    help="LLMs: context in tokens for the KV cache (default: the model's positions)")
    ap.add_argument("--batch", type=positive_int,
                    help="sequences / images per call (default 1; an .onnx / .ocm file: its own)")
    ap.add_argument("--seq", type=positive_int, default=128,
                    help="sequence length of a zoo transformer's sample inputs")
    ap.add_argument("--input-shape", "--input_shape", dest="input_shape", metavar="SHAPES",
                    type=concrete_input_shape, help='an .onnx file\'s symbolic dims, ATC\'s form "x:1,3,224,224;y:1,128"')
    ap.add_argument("--no-accuracy", action="store_true",
                    help="skip the layer-by-layer accuracy check (it runs the model twice)")
    ap.add_argument("--html", type=output_file, help="write a self-contained HTML report here")
    ap.add_argument("--json", type=output_file, help="write the report as JSON here")
    ap.add_argument("--top", type=positive_int, default=10, help="op types listed by time")
    return ap


def print_report(rep, console, top: int = 10) -> None:
    """Print ``rep`` (`ReadinessReport`) on the rich ``console``: verdict, op support,
    formats and TransData, memory, latency (the ``top`` op types), accuracy, next steps."""
    from rich.markup import escape as e
    console.rule(f"[bold]NPU readiness: {e(rep.model)} on {e(rep.device)}, {rep.precision}")
    console.print(f"verdict: [{_VERDICT_STYLE[rep.verdict]}]{rep.verdict}[/]"
                  + (f" ({e('; '.join(rep.reasons))})" if rep.reasons else ""))
    console.rule("op support (after constant folding)")
    _print_support(rep, console)
    console.rule("formats and TransData")
    if rep.estimate is None:
        console.print(f"not estimated: {e(rep.skipped.get('estimate', '?'))}")
    else:
        td = rep.trans_data()
        console.print("kernels per output format: " + ", ".join(f"{k} {v}" for k, v in rep.formats().items()))
        console.print(f"TransData: {td['count']} kernels, {td['time_us']:.1f} us "
                      f"({100 * td['share']:.0f}% of the estimated time), {td['hbm_bytes'] / 1e6:.2f} MB of HBM traffic")
    console.rule("memory (HBM)")
    for line in rep.memory_lines():
        console.print(f"[red]{e(line)}[/]" if "NOT fit" in line else e(line))
    console.rule("estimated latency")
    _print_latency(rep, console, top)
    console.rule(f"accuracy at {rep.precision} ({rep.precision_mode}) against fp32")
    _print_accuracy(rep, console, top)
    console.rule("next steps")
    for i, step in enumerate(rep.next_steps, 1):
        console.print(f"{i}. {e(step)}")


def _print_support(rep, console) -> None:
    from rich.markup import escape as e
    from rich.table import Table
    s = rep.support
    if s is None:
        console.print(f"not audited: {e(rep.skipped.get('support', '?'))}")
        return
    console.print(f"{s.counts()['converted']} ops on the device, {sum(f.count for f in rep.host_ops())} "
                  f"on the host; {s.folded} removed by constant folding ({e(s.capture)})")
    issues = rep.blockers() + rep.host_ops()
    if issues:
        t = Table()
        for col in ("kind", "op", "count", "source lines", "modules"):
            t.add_column(col, overflow="fold")
        for f in issues:
            t.add_row(f.kind.replace("_", " "), e(f.op), str(f.count), e("; ".join(f.sources[:3])),
                      e(", ".join(f.modules[:2])))
        console.print(t)


def _print_latency(rep, console, top: int) -> None:
    from rich.markup import escape as e
    from rich.table import Table
    if rep.estimate is None:
        console.print(f"not estimated: {e(rep.skipped.get('estimate', '?'))}")
        return
    total = rep.estimate.total_time_us
    cls = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in
                    sorted(rep.time_by_class().items(), key=lambda kv: -kv[1]) if v) if total else ""
    console.print(f"total {total / 1e3:.3f} ms for one forward of the sample inputs at batch "
                  f"{rep.estimate.batch} ({rep.estimate.dtype}); time by op class: {cls}")
    t = Table()
    for col, just in (("op", "left"), ("kernels", "right"), ("time us", "right"), ("%", "right"),
                      ("bottleneck", "left")):
        t.add_column(col, justify=just)
    for oc in rep.op_classes()[:top]:
        t.add_row(e(oc.op), str(oc.count), f"{oc.time_us:.2f}",
                  f"{100 * oc.time_us / total:.1f}" if total else "-", oc.bound)
    console.print(t)


def _print_accuracy(rep, console, top: int) -> None:
    from rich.markup import escape as e
    from rich.table import Table

    from .readiness import accuracy_counts
    acc = rep.accuracy
    if acc is None:
        console.print(f"not checked: {e(rep.skipped.get('accuracy', '?'))}")
        return
    console.print(f"outputs [{_STATUS_STYLE[acc.status]}]{acc.status}[/]; " + e(accuracy_counts(acc)))
    bad = rep.failing_layers() + rep.failing_layers("warn")
    if bad:
        t = Table()
        for col in ("node", "op", "module", "source", "cosine", "rel RMSE", "status", "note"):
            t.add_column(col, overflow="fold")
        for r in bad[:top]:
            t.add_row(e(r.node), e(r.op), e(r.module), e(r.source), f"{r.cosine:.6f}",
                      f"{r.rel_rmse:.3g}", f"[{_STATUS_STYLE[r.status]}]{r.status}[/]", e(r.note))
        console.print(t)


__all__ = ["PRECISION_CHOICES", "add_arguments", "print_report"]
