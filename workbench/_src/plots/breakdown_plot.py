"""Where a step's time goes, drawn: a stacked bar per worker (HTML, for the live dashboard: no
matplotlib on the training's time) and stacked bars per configuration (matplotlib, for the
scaling figure). The figures come from run.breakdown() / the "breakdown" event (core/breakdown.py).
"""

from __future__ import annotations

import html

PARTS = ("input", "compute", "communication", "other")
# The same hues in the HTML bar and the matplotlib bars (matplotlib's tab10 C1, C0, C3, C7).
COLOURS = {"input": "#ff7f0e", "compute": "#1f77b4", "communication": "#d62728", "other": "#7f7f7f"}


def bar_html(rows: list[dict], text: str = "") -> str:
    """One stacked bar per worker (width: share of its step), a legend with milliseconds per
    step, and the diagnosis sentence. Plain HTML: cheap enough to refresh with the status line."""
    if not rows:
        return ""
    lines = []
    for row in rows:
        total = sum(max(0.0, row.get(p) or 0.0) for p in PARTS) or 1.0
        cells = "".join(
            f"<div title='{p} {1e3 * (row.get(p) or 0.0):.2f} ms' data-part='{p}' style='width:"
            f"{100 * max(0.0, row.get(p) or 0.0) / total:.1f}%;background:{COLOURS[p]}'></div>"
            for p in PARTS
        )
        label = f"worker {row.get('worker', 0)}" if len(rows) > 1 else "step"
        lines.append(
            "<div style='display:flex;align-items:center;gap:6px;margin:1px 0'>"
            f"<span style='width:64px;font-size:90%'>{html.escape(label)}</span>"
            f"<div class='wb-breakdown-bar' style='display:flex;height:12px;flex:1;max-width:420px'>{cells}</div>"
            f"<span style='font-size:90%'>{1e3 * (row.get('step') or 0.0):.2f} ms</span></div>"
        )
    first = rows[0]
    legend = " ".join(
        f"<span style='color:{COLOURS[p]}'>&#9632;</span> {p}"
        + (f" {1e3 * (first.get(p) or 0.0):.2f} ms" if len(rows) == 1 else "")
        for p in PARTS
    )
    sentence = f"<div class='wb-breakdown-text'>{html.escape(text)}</div>" if text else ""
    return (
        f"<div class='wb-breakdown'>{''.join(lines)}<div style='font-size:90%'>{legend}</div>{sentence}</div>"
    )


def draw_stacked(ax, labels: list[str], rows: list[dict], per: str = "ms") -> None:
    """Stacked bars on `ax`, one per label: each part in milliseconds per step (the slowest
    worker's row when a configuration has several)."""
    scale = 1e3 if per == "ms" else 1.0
    bottom = [0.0] * len(rows)
    positions = list(range(len(rows)))
    for part in PARTS:
        heights = [scale * max(0.0, (r or {}).get(part) or 0.0) for r in rows]
        ax.bar(positions, heights, bottom=bottom, color=COLOURS[part], label=part, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(positions, labels)
    ax.set_ylabel(f"{per} per step")
    ax.grid(True, axis="y", alpha=0.3)
