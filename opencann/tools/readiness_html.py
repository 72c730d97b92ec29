"""A self-contained HTML page of an NPU readiness report (`readiness.ReadinessReport`): the
verdict, then one section per part (``id`` = ``support``, ``formats``, ``memory``,
``latency``, ``accuracy``, ``next-steps``), inline CSS and, when matplotlib is installed
and layers were compared, the accuracy plot of `compare_html.error_plot_png` as a base64
PNG: no external assets, so the file can be mailed or attached to a ticket.
"""
from __future__ import annotations

import base64
import html
from typing import Iterable, List

from .compare_html import error_plot_png
from .estimate import MiB
from .readiness import accuracy_counts

_VERDICT_COLOR = {"ready": "#2e7d32", "ready with host ops": "#f9a825", "not ready": "#c62828"}
_STATUS_COLOR = {"pass": "#e8f5e9", "warn": "#fff8e1", "fail": "#ffebee"}
_CSS = ("body{font-family:sans-serif;max-width:1100px;margin:auto}table{border-collapse:collapse;"
        "font-size:12px;margin:6px 0}td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}"
        "h2{border-bottom:1px solid #ddd}.verdict{font-size:20px;font-weight:bold}")


def _table(cols: Iterable[str], rows: Iterable[Iterable], styles: Iterable[str] = ()) -> str:
    esc = html.escape
    styles = list(styles)
    body = "".join(
        (f'<tr style="{styles[i]}">' if i < len(styles) and styles[i] else "<tr>")
        + "".join(f"<td>{esc(str(c))}</td>" for c in row) + "</tr>" for i, row in enumerate(rows))
    return "<table><tr>" + "".join(f"<th>{esc(c)}</th>" for c in cols) + "</tr>" + body + "</table>"


def _section(sid: str, title: str, parts: List[str]) -> str:
    return f'<h2 id="{sid}">{html.escape(title)}</h2>' + "".join(parts)


def _p(text: str) -> str:
    return f"<p>{html.escape(text)}</p>"


def to_html(rep) -> str:
    """The page of ``rep`` as a string."""
    esc = html.escape
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>opencann readiness: "
           f"{esc(rep.model)}</title><style>{_CSS}</style></head><body>",
           f"<h1>NPU readiness: {esc(rep.model)} on {esc(rep.device)}, {esc(rep.precision)}</h1>",
           f'<p class="verdict" id="verdict" style="color:{_VERDICT_COLOR[rep.verdict]}">'
           f"{esc(rep.verdict)}</p>"]
    if rep.reasons:
        out.append("<ul>" + "".join(f"<li>{esc(r)}</li>" for r in rep.reasons) + "</ul>")
    out.append(_section("support", "Op support (after constant folding)", _support(rep)))
    out.append(_section("formats", "Formats and TransData", _formats(rep)))
    out.append(_section("memory", "Memory (HBM)", _memory(rep)))
    out.append(_section("latency", "Estimated latency", _latency(rep)))
    out.append(_section("accuracy", f"Accuracy at {rep.precision} ({rep.precision_mode}) against fp32",
                        _accuracy(rep)))
    out.append(_section("next-steps", "Next steps",
                        ["<ol>" + "".join(f"<li>{esc(x)}</li>" for x in rep.next_steps) + "</ol>"]))
    out.append("</body></html>")
    return "".join(out)


def _support(rep) -> List[str]:
    s = rep.support
    if s is None:
        return [_p(f"not audited: {rep.skipped.get('support', '?')}")]
    part = [_p(f"{s.counts()['converted']} ops on the device, {sum(f.count for f in rep.host_ops())} "
               f"on the host; {s.folded} removed by constant folding ({s.capture})")]
    issues = rep.blockers() + rep.host_ops()
    if issues:
        part.append(_table(("kind", "op", "count", "source lines", "modules", "detail"),
                           [(f.kind.replace("_", " "), f.op, f.count, "; ".join(f.sources),
                             ", ".join(f.modules[:4]), f.detail or f.message) for f in issues]))
    return part


def _formats(rep) -> List[str]:
    if rep.estimate is None:
        return [_p(f"not estimated: {rep.skipped.get('estimate', '?')}")]
    td = rep.trans_data()
    return [_table(("output format", "kernels"), rep.formats().items()),
            _p(f"TransData: {td['count']} kernels, {td['time_us']:.1f} µs "
               f"({100 * td['share']:.0f}% of the estimated time), {td['hbm_bytes'] / 1e6:.2f} MB "
               "of HBM traffic")]


def _memory(rep) -> List[str]:
    m = rep.memory
    part = [_p(line) for line in rep.memory_lines()]
    if m is not None:
        rows = [("weights", m.weights), ("peak activations", m.activations)]
        rows += [("KV cache", m.kv_cache)] if rep.kv is not None else []
        rows += [("total", m.total), ("HBM", m.hbm)]
        part.insert(0, _table(("part", "MiB"), [(k, f"{v / MiB:.3f}") for k, v in rows]))
    return part


def _latency(rep) -> List[str]:
    est = rep.estimate
    if est is None:
        return [_p(f"not estimated: {rep.skipped.get('estimate', '?')}")]
    total = est.total_time_us
    return [_p(f"total {total / 1e3:.3f} ms for one forward of the sample inputs at batch "
               f"{est.batch} ({est.dtype}); time by op class: "
               + ", ".join(f"{k} {v:.1f} µs" for k, v in rep.time_by_class().items())),
            _table(("op", "kernels", "time µs", "%", "bottleneck"),
                   [(o.op, o.count, f"{o.time_us:.2f}", f"{100 * o.time_us / total:.1f}"
                     if total else "-", o.bound) for o in rep.op_classes()])] + \
        [_p(f"note: {n}") for n in est.notes if not n.startswith("fusion comparison")]


def _accuracy(rep) -> List[str]:
    acc = rep.accuracy
    if acc is None:
        return [_p(f"not checked: {rep.skipped.get('accuracy', '?')}")]
    part = [_p(f"outputs {acc.status}; {accuracy_counts(acc)}"),
            _table(("output", "dtype", "cosine", "rel RMSE", "max abs", "status", "note"),
                   [(o.node, o.dtype, f"{o.cosine:.6f}", f"{o.rel_rmse:.3g}", f"{o.max_abs:.3g}",
                     o.status, o.note) for o in acc.outputs],
                   [f"background:{_STATUS_COLOR[o.status]}" for o in acc.outputs])]
    bad = rep.failing_layers() + rep.failing_layers("warn")
    if bad:
        part.append(_table(("node", "op", "module", "source", "cosine", "rel RMSE", "status", "note"),
                           [(r.node, r.op, r.module, r.source, f"{r.cosine:.6f}",
                             f"{r.rel_rmse:.3g}", r.status, r.note) for r in bad],
                           [f"background:{_STATUS_COLOR[r.status]}" for r in bad]))
    png = error_plot_png(acc)
    if png:
        part.append('<img alt="error along the graph" src="data:image/png;base64,'
                    f'{base64.b64encode(png).decode()}">')
    return part


def write_html(rep, path: str) -> None:
    """Write `to_html` of ``rep`` to ``path`` (UTF-8)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(to_html(rep))


__all__ = ["to_html", "write_html"]
