"""A self-contained HTML page of a layer-by-layer comparison (`compare.CompareResult`):
the table of every layer (first divergence highlighted) and a plot of the error along
the graph, embedded as a base64 PNG. matplotlib draws the plot (the plotting library
the house uses); without it the page has the table only and says so.
"""
from __future__ import annotations

import base64
import html
import io
from typing import Optional

from .compare import METRICS, CompareResult

_COLORS = {"pass": "#e8f5e9", "warn": "#fff8e1", "fail": "#ffebee"}


def error_plot_png(res: CompareResult) -> Optional[bytes]:
    """PNG bytes of relative RMSE and 1 - cosine per layer (log scale), or None when
    matplotlib is not installed or there is nothing to plot."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not res.layers:
        return None
    xs = [r.index for r in res.layers]
    fig, ax = plt.subplots(figsize=(10, 3.2), dpi=100)
    ax.semilogy(xs, [max(r.rel_rmse, 1e-12) for r in res.layers], label="relative RMSE")
    ax.semilogy(xs, [max(1 - r.cosine, 1e-12) for r in res.layers], label="1 - cosine")
    if res.first_divergence is not None:
        ax.axvline(res.first_divergence, color="red", linestyle="--", label="first divergence")
    ax.set_xlabel("layer (execution order)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def to_html(res: CompareResult) -> str:
    """The page as a string."""
    esc = html.escape
    png = error_plot_png(res)
    plot = (f'<img alt="error along the graph" src="data:image/png;base64,'
            f'{base64.b64encode(png).decode()}">' if png else
            "<p><i>(plot skipped: matplotlib is not installed)</i></p>")
    cols = ["#", "node", "op", "FX node", "module", "source", "dtype", "shape", *METRICS, "status"]
    rows = []
    for r in res.layers:
        first = r.index == res.first_divergence
        style = f"background:{_COLORS[r.status]}" + (";outline:2px solid red" if first else "")
        cells = [r.index, r.node, r.op, r.fx_node, r.module, r.source, r.dtype, "x".join(map(str, r.shape))]
        cells += [f"{getattr(r, m):.6g}" for m in METRICS]
        cells.append(r.status + (" (first divergence)" if first else "") + (f"; {r.note}" if r.note else ""))
        rows.append(f'<tr style="{style}"' + (' id="first"' if first else "") + ">"
                    + "".join(f"<td>{esc(str(c))}</td>" for c in cells) + "</tr>")
    summary = "<br>".join(esc(line) for line in res.summary().splitlines())
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>opencann compare: "
            f"{esc(res.model)}</title><style>body{{font-family:sans-serif}}table{{border-collapse:"
            "collapse;font-size:12px}}td,th{{border:1px solid #ccc;padding:2px 6px}}</style></head>"
            f"<body><h2>opencann compare: {esc(res.model)} on {esc(res.device)}</h2><p>{summary}</p>"
            f"{plot}<table><tr>{''.join(f'<th>{esc(c)}</th>' for c in cols)}</tr>"
            + "".join(rows) + "</table></body></html>")


def write_html(res: CompareResult, path: str) -> None:
    """Write `to_html` to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(to_html(res))
