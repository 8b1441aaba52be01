"""`wb.compare_runs`: two or more runs side by side, their loss and throughput curves overlaid in
one figure, and their figures (workbench._src.core.run_stats) in one DataFrame.

The JupyterLab sidebar's "Compare" sends the picked run ids to the kernel, which calls this.
"""

from __future__ import annotations

import io
import math
from typing import NamedTuple

from workbench._src.core.errors import ConfigurationError
from workbench._src.core.run import Run
from workbench._src.core.run_names import backend_label
from workbench._src.core.run_stats import figures, last_metrics
from workbench._src.plots import theme
from workbench._src.plots.run_plot import _smooth, thinned_indices
from workbench._src.store.runhistory import load_run

TABLE_COLUMNS = [
    "id",
    "name",
    "backend",
    "num_replicas",
    "status",
    "steps",
    "wall_time_s",
    "steps_per_sec",
    "examples_per_sec",
    "median_examples_per_sec",
]
# How a column is labelled where the table is shown (the DataFrame keeps its names: callers
# index it). The median is the compiled calls' speed alone, without the loop's overhead.
LABELS = {"median_examples_per_sec": "median compiled step examples/s"}
# Points per run and curve in the JupyterLab compare view's series (compare reply): enough for a
# chart a few hundred pixels wide, small enough for one comm message.
MAX_POINTS = 2000


class Comparison(NamedTuple):
    """What compare_runs returns: `fig, table = wb.compare_runs([...])`."""

    figure: object  # matplotlib.figure.Figure
    table: object  # pandas.DataFrame, one row per run

    def png(self) -> bytes:
        out = io.BytesIO()
        self.figure.savefig(out, format="png", dpi=self.figure.dpi)
        return out.getvalue()

    def _repr_html_(self) -> str:
        import base64

        data = base64.b64encode(self.png()).decode("ascii")
        table = self.table.rename(columns=LABELS).to_html(index=False)
        return f"<img src='data:image/png;base64,{data}'/><br>{table}"


def compare_runs(runs, directory=None) -> Comparison:
    """Overlays the loss and throughput of two or more runs; returns (figure, DataFrame).

    Args:
      runs: run ids (as in wb.runs()), wb.Run objects, or positions in wb.runs() (-1: latest).
      directory: the runs directory for ids and positions (default: wb.runs()'s).

    Returns:
      `Comparison(figure, table)`: a matplotlib Figure (loss and examples/s against the step
      counted from each run's start) and a DataFrame with one row per run: steps, wall time,
      steps/s and examples/s over the whole run, the median step's examples/s, last metrics.

    Example:
      >>> import workbench as wb
      >>> fig, table = wb.compare_runs([-2, -1])   # doctest: +SKIP
      >>> table[["name", "backend", "steps_per_sec", "loss"]]   # doctest: +SKIP
    """
    import pandas as pd

    loaded = load_runs(runs, directory)
    if len(loaded) < 2:
        raise ConfigurationError(
            f"compare_runs needs two or more runs; received {len(loaded)} ({[r.id for r in loaded]!r}). "
            "Fix: pass ids from wb.runs(), e.g. wb.compare_runs(wb.runs()['id'].tail(2))."
        )
    table = pd.DataFrame([_row(r) for r in loaded])
    first = [c for c in TABLE_COLUMNS if c in table.columns]
    table = table[first + [c for c in table.columns if c not in first]]
    return Comparison(_figure(loaded), table)


def load_runs(runs, directory=None) -> list:
    """The runs compare_runs takes (ids, wb.Run objects, positions), loaded: compare_runs and
    series() both take the result, so the JupyterLab compare view reads each history once."""
    if isinstance(runs, (str, int)) or not hasattr(runs, "__iter__"):
        runs = [runs]
    return [_load(r, directory) for r in runs]


def series(runs, max_points: int = MAX_POINTS) -> list[dict]:
    """Each run's loss and examples/s per step, for the JupyterLab compare view's chart.

    `runs`: what load_runs returns. Per run: id, name (the store's), step (counted from the
    run's start, as in the figure), loss (None without a loss column) and examples_per_sec,
    at most `max_points` evenly spaced points (first and last kept); NaN/Inf -> None (JSON).
    """
    out = []
    for run in runs:
        h = run.history
        keep = thinned_indices(len(h), max_points)
        out.append(
            {
                "id": run.id,
                "name": run.name,
                "step": [int(i) + 1 for i in keep],
                "loss": _column(h, "loss", keep),
                "examples_per_sec": _column(h, "examples_per_sec", keep),
            }
        )
    return out


def _column(history, name: str, keep) -> list | None:
    if name not in history:
        return None
    return [_finite_or_none(v) for v in history[name].to_numpy(dtype=float)[keep]]


class _Loaded(NamedTuple):
    id: str
    name: str
    status: str
    config: dict
    history: object


def _load(run, directory) -> _Loaded:

    if isinstance(run, Run):
        return _Loaded(run.id, run.name, run.status, dict(run.config), run.history)
    if hasattr(run, "history") and hasattr(run, "config"):  # a RunRecord
        return _Loaded(run.id, run.name, run.status, dict(run.config), run.history)
    if hasattr(run, "item") and not isinstance(run, str):
        run = run.item()  # numpy scalars from a DataFrame column
    rec = load_run(run, directory)
    return _Loaded(rec.id, rec.name, rec.status, dict(rec.config), rec.history)


def _row(run: _Loaded) -> dict:

    fig = figures(run.history, running=run.status == "running")
    return {
        "id": run.id,
        "name": run.name,
        "backend": run.config.get("backend"),
        "num_replicas": run.config.get("num_replicas"),
        "status": run.status,
        **{k: fig[k] for k in TABLE_COLUMNS[5:]},
        **last_metrics(run.history),
    }


def _figure(runs: list[_Loaded]):
    """Loss (log scale when it spans decades) and smoothed examples/s, one colour per run, in the
    JupyterLab theme's colours (dark figures on a dark theme); legends use the runs' names."""

    with theme.context():
        return _draw(runs)


def _draw(runs: list[_Loaded]):
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.4), dpi=80)
    FigureCanvasAgg(fig)
    ax_loss, ax_eps = fig.subplots(1, 2)
    spans = []
    for i, run in enumerate(runs):
        h = run.history
        if not len(h):
            continue
        step = np.arange(1, len(h) + 1)  # counted from each run's start
        what = backend_label(run.config)  # (named once: a default name holds it already)
        label = run.name if what in run.name else f"{run.name} ({what})"
        if "loss" in h:
            loss = h["loss"].to_numpy(dtype=float)
            # Smoothed only: the raw per-step noise of several runs would hide each other.
            ax_loss.plot(step, _smooth(loss), lw=1.8, color=f"C{i}", label=label)
            finite = loss[np.isfinite(loss)]
            if finite.size:
                spans.append((finite.min(), finite.max()))
        eps = h["examples_per_sec"].to_numpy(dtype=float)
        ax_eps.plot(step, _smooth(eps), lw=1.8, color=f"C{i}", label=label)
    if spans and min(s[0] for s in spans) > 0 and max(s[1] for s in spans) > 100 * min(s[0] for s in spans):
        ax_loss.set_yscale("log")
    ax_loss.set_title("loss", fontsize=13)
    ax_eps.set_title("examples/s per step (smoothed)", fontsize=13)
    for ax in (ax_loss, ax_eps):
        ax.set_xlabel("step (from each run's start)", fontsize=11)
        ax.tick_params(labelsize=10)
        ax.grid(alpha=0.3)
    handles, labels = ax_eps.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=min(4, len(labels)), fontsize=11, frameon=False)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.14, top=0.8, wspace=0.22)
    return fig


def _finite_or_none(value):
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def table_rows(table) -> list[dict]:
    """The DataFrame as JSON-able rows (NaN -> None), for the sidebar."""
    rows = []
    for record in table.to_dict("records"):
        rows.append({k: (_finite_or_none(v) if isinstance(v, float) else v) for k, v in record.items()})
    return rows
