"""The run figure: every metric and the throughput against step, drawn from a run's events.

Shared by the live dashboard (redrawn a few times a second at most) and the run store (one PNG
per run). Drawing uses matplotlib's Agg canvas directly, never pyplot: it is safe off the main
thread and never opens a window or touches the notebook's inline backend.
"""

from __future__ import annotations

import collections
import io
import math
import threading

from workbench._src.core.run_names import backend_label
from workbench._src.core.run_stats import RESERVED, describe, figures, last_metrics, median_rate
from workbench._src.plots import theme
from workbench._src.plots.live_frame import Blitter, fit_limits

MAX_POINTS = 2000  # drawn per line; longer histories are thinned (the CSV keeps every step)
MAX_METRIC_PANELS = 5
DPI = 96  # the figure shows at its natural size in a notebook: readable fonts
# How the metric panels' y axis is scaled: "auto" is log when the values span more than 100x
# (a loss falling by orders of magnitude), else linear; "log" and "linear" force one.
SCALES = ("auto", "log", "linear")

# Agg and its font cache are shared across threads; one drawing at a time.
_RENDER_LOCK = threading.Lock()
_final_cache: collections.OrderedDict = collections.OrderedDict()


class History:
    """Per-step columns accumulated from 'metrics' events; what sinks keep instead of the Run.

    `add` runs on the training thread, so it only appends; readers take a `snapshot()`.
    """

    def __init__(self):
        self._columns: dict[str, list] = {}
        self._n = 0
        self._lock = threading.Lock()

    def add(self, rows: list[dict]) -> None:
        with self._lock:
            for row in rows:
                for key in row:
                    if key not in self._columns:  # a metric seen for the first time
                        self._columns[key] = [math.nan] * self._n
                for key, column in self._columns.items():
                    column.append(row.get(key, math.nan))
                self._n += 1

    def truncate(self, n: int) -> None:
        """Keeps the first n rows (a healed run rewinds to its checkpoint's step)."""
        with self._lock:
            self._n = max(0, min(n, self._n))
            for column in self._columns.values():
                del column[self._n :]

    def __len__(self) -> int:
        return self._n

    def snapshot(self) -> dict[str, list]:
        """A consistent copy of the columns (list slices: cheap, and safe to read unlocked)."""
        with self._lock:
            return {k: v[: self._n] for k, v in self._columns.items()}


def metric_names(columns: dict) -> list[str]:
    """The metric columns, the loss first (step_fn outputs arrive sorted by name)."""
    names = [c for c in columns if c not in RESERVED]
    return sorted(names, key=lambda n: 0 if n == "loss" else 1 if "loss" in n else 2)


def summarize(columns: dict, running: bool = False, target_steps: int | None = None) -> dict:
    """Steps (counted from the run's start), wall time, the run's figures (workbench._src.core.run_stats:
    steps/s and examples/s over the last window while running, the whole run once ended; the
    median per-step examples/s) and each metric's last value."""
    fig = figures(columns, running=running, target_steps=target_steps)
    out: dict = {"steps": fig["steps"], "steps_recorded": fig["steps"]}  # steps_recorded: older readers
    if not fig["steps"]:
        return out
    # The program's own step number (absolute); histories before global_step had it in step.
    out["last_step"] = int((columns.get("global_step") or columns["step"])[-1])
    for key in ("wall_time_s", "steps_per_sec", "examples_per_sec", "median_examples_per_sec"):
        if fig[key] is not None:
            out[key] = fig[key]
    out.update(last_metrics(columns))
    return out


def title_for(
    config: dict,
    status: str,
    columns: dict,
    name: str = "",
    target: int | None = None,
    numbers: bool = True,
    fig: dict | None = None,
) -> str:
    """'run 3 · mirrored x4 · finished · step 300/300 · 812 steps/s · 103,936 examples/s'.

    The backend is named once: a name that holds it already (the default 'mirrored x4 · nb01 ·
    14:02') is not followed by it again. Steps count from the run's start; `target` is the steps
    the run was asked for. numbers=False leaves out the step and the rates (the live figure:
    drawn less often than the header above it refreshes, it would show older numbers beside
    newer ones). `fig`: the figures to show (the run's snapshot, core/live.py); else computed
    from `columns`.
    """
    label = backend_label(config)
    parts = [name or "run"] + ([] if label in (name or "") else [label]) + [status]
    if not numbers:
        return " \u00b7 ".join(parts)
    if fig is None:
        fig = figures(columns, running=status == "running", target_steps=target)
    if fig["steps"]:
        parts.append(f"step {fig['steps']:,}" + (f"/{target:,}" if target else ""))
    if fig["steps_per_sec"] is not None:
        parts.append(describe(fig))
    return " \u00b7 ".join(parts)


class Plotter:
    """Keeps one figure and redraws it with new data (cheaper than building a figure each time)."""

    def __init__(self):
        self._figure = None
        self._layout: tuple | None = None
        self._lines: dict = {}
        self._marks: list = []  # the heal marks' lines of the last render
        self.built = False  # the last render built the figure (new panels, a new theme)
        self.blitter = Blitter()  # live renders: the static part drawn once (plots/live_frame.py)

    def render(
        self,
        columns: dict,
        title: str,
        smoothing: float | None = None,
        scale: str = "auto",
        marks=(),
        live: bool = False,
    ) -> bytes:
        """PNG bytes of the figure for these columns.

        smoothing: None draws the default smoothed line (`_smooth`); a weight in [0, 1) draws
        TensorBoard's exponential moving average instead (0: the raw values). scale: one of
        SCALES, for the metric panels (examples/s stays linear). marks: steps (from the run's
        start) drawn as dotted vertical lines on every panel: where a healed run resumed.
        live: a frame of a running run's figure: the axes keep their limits while the data fit
        and only the lines are drawn again (plots/live_frame.py); else the limits fit the data
        exactly and everything is drawn.
        """
        _check_view(smoothing, scale)
        with _RENDER_LOCK, theme.context():
            names = metric_names(columns)[:MAX_METRIC_PANELS]
            layout = (*names, theme.key())  # a theme switch builds the figure again, in its colours
            self.built = self._layout != layout  # (a build costs several redraws: live_frame.DrawingBudget)
            if self.built:
                self._build(names)
                self._layout = layout
                self.blitter.forget()
            self._update(columns, names, title, smoothing, scale, live)
            self._mark(marks)
            moving = self._moving()
            if live:
                self.blitter.draw(self._figure, moving, self._static_key(layout, marks))
            else:
                Blitter.release(moving)
                self.blitter.forget()  # (the full drawing below changed the limits it kept)
                self._figure.canvas.draw()
            return self._png()

    def _moving(self) -> list:
        """What changes on every frame: the lines and the examples/s panel's title (its median)."""
        out = []
        for ax, raw, smooth, extra in self._lines.values():
            out += [raw, smooth]
            if extra is not None:
                out += [extra, ax.title]
        return out

    def _static_key(self, layout: tuple, marks) -> tuple:
        """What the static part of a live frame shows: drawn again only when this changes."""
        axes = tuple(
            (ax.get_xlim(), ax.get_ylim(), ax.get_yscale(), ax.get_title() if extra is None else "")
            for ax, _, _, extra in self._lines.values()
        )
        return (layout, self._title.get_text(), self._title.get_fontsize(), tuple(marks), axes)

    def _mark(self, steps) -> None:
        """Dotted vertical lines at `steps` on every panel (the previous render's removed)."""
        for line in self._marks:
            line.remove()
        self._marks = [
            ax.axvline(step, ls=":", lw=1.2, color="0.45")
            for ax, *_ in self._lines.values()
            for step in steps
        ]

    def _build(self, names: list[str]) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        panels = names + ["examples/s"]
        cols = min(3, len(panels))
        rows = math.ceil(len(panels) / cols)
        # At least 9 inches wide: the title (run, backend, status, step, steps/s, examples/s) fits.
        fig = Figure(figsize=(max(9.0, 3.6 * cols), 2.5 * rows + 0.35), dpi=DPI)
        FigureCanvasAgg(fig)
        # Fixed margins instead of tight/constrained layout, which would double every redraw.
        top = 1 - 0.35 / (2.5 * rows + 0.35) - 0.08 / rows
        fig.subplots_adjust(
            left=0.09 / cols * 3 / 1.6, right=0.98, bottom=0.17 / rows, top=top, wspace=0.32, hspace=0.55
        )
        self._lines, self._marks = {}, []  # (a new figure: the old marks went with the old one)
        for i, panel in enumerate(panels):
            ax = fig.add_subplot(rows, cols, i + 1)
            ax.set_title(panel, fontsize=11 if panel == "examples/s" else 12)
            ax.tick_params(labelsize=10)
            ax.xaxis.set_major_locator(MaxNLocator(5, integer=True))
            ax.yaxis.set_major_locator(MaxNLocator(5))
            ax.grid(alpha=0.3)
            ax.set_xlabel("step", fontsize=10, labelpad=1)
            raw = ax.plot([], [], lw=0.8, alpha=0.35, color=f"C{i}")[0]
            smooth = ax.plot([], [], lw=1.6, color=f"C{i}")[0]
            extra = ax.axhline(math.nan, ls="--", lw=1, color="0.4") if panel == "examples/s" else None
            if extra is not None:  # 12,800 on the axis, not "+1.28e4" above it (under the title)
                ax.ticklabel_format(axis="y", useOffset=False, style="plain")
            self._lines[panel] = (ax, raw, smooth, extra)
        self._title = fig.suptitle("", fontsize=12)
        self._figure, self._layout = fig, tuple(names)

    def _update(
        self, columns: dict, names: list[str], title: str, smoothing: float | None, scale: str, live: bool
    ) -> None:
        import numpy as np

        steps = np.asarray(columns.get("step", []), dtype=float)
        steps = steps - steps[0] + 1 if steps.size else steps  # counted from the run's start
        for panel, (ax, raw, smooth, extra) in self._lines.items():
            key = "examples_per_sec" if panel == "examples/s" else panel
            y = whole = np.asarray(columns.get(key, []), dtype=float)
            x, y = _thin(steps, y)
            smoothed = _smooth(y, smoothing)
            if extra is None:
                # Losses falling by orders of magnitude read better on a log scale ("auto"). A loss
                # of exactly 0 (a perfect fit) has no place on it: those points are left out and
                # the title says so, rather than the whole panel falling back to linear.
                finite = y[np.isfinite(y)]
                positive = finite[finite > 0]
                if scale == "auto":
                    log = positive.size > 1 and positive.max() > 100 * positive.min()
                else:
                    log = scale == "log"
                zeros = log and positive.size < finite.size
                if log:
                    y = np.where(y > 0, y, np.nan)
                    smoothed = np.where(smoothed > 0, smoothed, np.nan)
                if ax.get_yscale() != ("log" if log else "linear"):
                    from matplotlib.ticker import LogLocator, MaxNLocator, NullLocator

                    ax.set_yscale("log" if log else "linear")
                    # Few ticks and no minor ones: tick objects are most of a redraw's cost.
                    ax.yaxis.set_major_locator(LogLocator(numticks=5) if log else MaxNLocator(5))
                    ax.yaxis.set_minor_locator(NullLocator())
                note = " (log scale; values <= 0 not drawn)" if zeros else " (log scale)" if log else ""
                ax.set_title(panel + note, fontsize=12 if not zeros else 10)
            else:
                median = median_rate(y)  # (the run's median figure, as every view shows it)
                extra.set_ydata([median, median] if median is not None else [math.nan, math.nan])
                # set_text, not set_title: set_title puts the title back at its default height,
                # and a live frame (plots/live_frame.py) draws it where the last full drawing
                # placed it (clear of the axis' labels).
                ax.title.set_text(
                    f"examples/s (median {median:,.0f}, dashed)" if median is not None else "examples/s"
                )
            raw.set_data(x, y)
            smooth.set_data(x, smoothed)
            if live:  # limits kept while the data fit: most frames redraw the lines alone
                # (from every point, not the thinned ones: which points a thinning keeps changes
                # from frame to frame, and so would limits taken from them)
                fit_limits(ax, x, [whole], log=ax.get_yscale() == "log")
            else:
                ax.set_autoscale_on(True)
                ax.relim()
                ax.autoscale_view()
        self._fit_title(title)

    def _fit_title(self, title: str) -> None:
        """The title in a font small enough to fit the figure's width (a suptitle is centred:
        one wider than the figure was cut at both ends); on two lines at a " · ", in the
        smallest size (the room above the panels holds two lines of it), if 8 pt does not fit."""
        if getattr(self, "_fitted", None) == (title, self._layout):
            return  # (measuring text costs a live frame several ms: the same title fits the same)
        self._fitted = (title, self._layout)
        renderer = self._figure.canvas.get_renderer()
        room = 0.98 * self._figure.bbox.width
        self._title.set_text(title)
        for size in (12, 11, 10, 9, 8):
            self._title.set_fontsize(size)
            if self._title.get_window_extent(renderer).width <= room:
                return
        self._title.set_text(_two_lines(title))
        self._title.set_fontsize(7)

    def _png(self) -> bytes:
        from PIL import Image

        canvas = self._figure.canvas  # (drawn by render)
        width, height = canvas.get_width_height()
        image = Image.frombuffer("RGBA", (width, height), canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
        out = io.BytesIO()
        image.convert("RGB").save(out, format="png", compress_level=1)  # speed over a few KB
        return out.getvalue()


def final_png(
    run_id: str, columns: dict, title: str, smoothing: float | None = None, scale: str = "auto", marks=()
) -> bytes:
    """The end-of-run figure, rendered once and shared by the run store and the dashboard.

    smoothing, scale and marks as in `Plotter.render`; the run store always draws the defaults.
    """

    key = (run_id, len(columns.get("step", [])), title, theme.key(), smoothing, scale, tuple(marks))
    with _RENDER_LOCK:
        if key in _final_cache:
            return _final_cache[key]
    png = render(columns, title, smoothing, scale, marks)
    with _RENDER_LOCK:
        _final_cache[key] = png
        while len(_final_cache) > 4:
            _final_cache.popitem(last=False)
    return png


_shared = Plotter()


def last_render_built() -> bool:
    """Whether the last `render` built its figure anew (a first drawing, a new metric, a theme)."""
    return _shared.built


def _two_lines(title: str) -> str:
    """'a · b · c · d' -> 'a · b\\nc · d', split at the " · " nearest the middle."""
    parts = title.split(" \u00b7 ")
    if len(parts) < 2:
        return title
    lengths = [len(" \u00b7 ".join(parts[:i])) for i in range(1, len(parts))]
    cut = min(range(len(lengths)), key=lambda i: abs(lengths[i] - len(title) / 2)) + 1
    return " \u00b7 ".join(parts[:cut]) + "\n" + " \u00b7 ".join(parts[cut:])


def render(
    columns: dict,
    title: str,
    smoothing: float | None = None,
    scale: str = "auto",
    marks=(),
    live: bool = False,
) -> bytes:
    """PNG of the run figure, drawn on one figure shared by every dashboard and the run store.

    Building a figure costs several redraws; sharing one (under the render lock) pays that
    once per process and set of metric names instead of once per run. live: a running run's
    frame (Plotter.render).
    """
    return _shared.render(columns, title, smoothing, scale, marks, live)


def _check_view(smoothing: float | None, scale: str) -> None:
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(map(repr, SCALES))}; received {scale!r}.")
    if smoothing is not None and not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must be None or a weight in [0, 1); received {smoothing!r}.")


def _thin(x, y):
    """At most MAX_POINTS points, always keeping the last one."""
    if len(x) <= MAX_POINTS:
        return x, y
    idx = thinned_indices(len(x), MAX_POINTS)
    return x[idx], y[idx]


def thinned_indices(n: int, limit: int):
    """At most `limit` evenly spaced indices of `n` points, the first and the last kept (the
    figure's lines, and the compare view's series)."""
    import numpy as np

    if n <= limit:
        return np.arange(n)
    return np.unique(np.append(np.linspace(0, n - 1, limit).astype(int), n - 1))


def _smooth(y, weight: float | None = None):
    """The smoothed line drawn over the raw one.

    weight=None (every figure's default): a centred moving average over ~1/30 of the points
    (NaN-aware); the raw values when short. A weight in [0, 1): TensorBoard's smoothing, an
    exponential moving average debiased at the start (the first points are not pulled towards
    0); 0 gives the raw values. As in TensorBoard, non-finite points stay as they are and do not
    enter the average.
    """
    if weight is not None:
        return _ema(y, weight)
    import numpy as np

    n = len(y)
    half = n // 60
    if half < 1:
        return y
    ok = np.isfinite(y)
    sums = np.concatenate([[0.0], np.cumsum(np.where(ok, y, 0.0))])
    counts = np.concatenate([[0], np.cumsum(ok)])
    i = np.arange(n)
    lo, hi = np.maximum(i - half, 0), np.minimum(i + half, n - 1) + 1
    total, count = sums[hi] - sums[lo], counts[hi] - counts[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def _ema(y, weight: float):
    """TensorBoard's scalar smoothing (its dashboard's `smoothingWeight`), point by point."""
    import numpy as np

    if not 0 <= weight < 1:
        raise ValueError(f"smoothing weight must be in [0, 1); received {weight!r}.")
    out = np.array(y, dtype=float)  # a copy: non-finite points are kept as they are
    last, count = 0.0, 0
    # A plain loop: the figure draws at most MAX_POINTS points, well under a millisecond.
    for i, value in enumerate(out.tolist()):
        if not math.isfinite(value):
            continue
        last = last * weight + (1 - weight) * value
        count += 1
        out[i] = last / (1 - weight**count)
    return out
