"""What the live dashboard shows (sinks/dashboard.py receives the events and decides when to
draw): the widget box (status line, progress bar, Stop button, TensorBoard's smoothing and
y-scale controls, the figure), the console bar outside a kernel, and what a run leaves in its
cell when it ends (a plain PNG, or a failed run's one-line reason with its details behind a
toggle).
"""

from __future__ import annotations

import base64
import sys
from typing import Literal

from workbench._src.core.live import before_the_run
from workbench._src.core.run_stats import fmt, fmt_duration, shown_reason
from workbench._src.plots import run_plot
from workbench._src.sinks import runstore

Frontend = Literal["auto", "widgets", "console"]
# tqdm without its own rate and ETA (the postfix carries the run's figures instead).
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
# The smoothing slider's stops: "auto" (the figure's default smoothed line) then TensorBoard's
# exponential moving average weights 0 (raw) .. 0.99.
SMOOTHING_WEIGHTS = [round(i / 100, 2) for i in range(100)]


def detect_frontend() -> str:
    """'widgets' inside a Jupyter kernel with ipywidgets installed, else 'console'."""
    try:
        from IPython import get_ipython
    except ImportError:
        return "console"
    shell = get_ipython()
    # The same test tqdm.autonotebook uses: only a kernel has a frontend that renders widgets.
    if shell is None or "IPKernelApp" not in getattr(shell, "config", {}):
        return "console"
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return "console"
    return "widgets"


class DashboardView:
    """The dashboard's widgets and bars (a base of sinks/dashboard.py's Dashboard, whose state
    they read: frontend, status, config, smoothing, scale, png, the renderer's wake-up)."""

    def _update_bar(self, summary: dict, fig: dict, metrics: list[str], final: bool) -> None:
        if not self._progress:
            return
        if self._bar is None and self.frontend == "console" and self.target is not None:
            from tqdm.std import tqdm

            self._bar = tqdm(
                total=self.config.get("steps"),
                desc=self.name or "training",
                unit="step",
                file=sys.stderr,
                bar_format=BAR_FORMAT,
                mininterval=0,  # every snapshot shown (they come <= 2 a second): no bar behind
                miniters=1,
            )
        if self._bar is None:
            return
        if (
            self.frontend == "widgets"
            and self._bar.total != self.config.get("steps")
            and self.target is not None
        ):
            self._bar.reset(total=self.config.get("steps"))
        done = summary.get("steps", 0)  # counted from the run's start, as every view counts them
        if done > self._bar.n:
            # The run's figures (workbench._src.core.run_stats), not tqdm's own rate and ETA: the bar
            # then says what the sidebar, the status bar and the summary say.
            postfix = {k: f"{summary[k]:.4g}" for k in metrics[:2]}
            postfix["steps/s"] = fmt(fig["steps_per_sec"])
            if self.target is not None and not final:
                postfix["ETA"] = fmt_duration(fig["eta_seconds"])
            self._bar.set_postfix(postfix, refresh=False)
            if not self._bar_clock_started:
                # The first chunk includes compiling: start tqdm's clock after it, so that the
                # rate and the ETA are those of training, not of tracing.
                self._bar_clock_started = True
                self._bar.reset(total=self.config.get("steps"))
                self._bar.n = self._bar.last_print_n = done
                self._bar.refresh()
            else:
                self._bar.update(done - self._bar.n)
        if final:
            self._bar.close()

    def _show_final(self, summary: dict, title: str) -> None:
        self._final_title = title  # (a theme switch draws the figure again: retheme)
        reason = shown_reason(self.status, (self._ended or {}).get("reason"))
        text = title + (f" ({reason})" if reason else "")
        if self.frontend == "console":
            where = runstore.record_dir(self.run_id)
            print(text + (f"; figure: {where}/{runstore.FIGURE}" if where else ""), flush=True)
            return
        if self.png is not None:
            self._image.value = self.png
            self._image.layout.display = ""
            self._controls.layout.display = ""
        self._stop_button.layout.display = "none"
        if self._handle is not None:
            bundle = self._final_bundle(text, reason)
            self._handle.update(bundle, raw=True)
            if not self._background:
                # A foreground cell is still running, so the replacement surely reached the
                # frontend: free the comms. A background run's may not have (the cell ended).
                self._bar.close() if self._bar is not None else None
                self.widget.close()

    def _final_bundle(self, text: str, reason: str | None) -> dict:
        if self.status == "failed":  # the reason first, in one line; the traceback behind a toggle
            bundle = {
                "text/html": failed_html(self.name, reason, (self._ended or {}).get("details"), self.png)
            }
        elif self.png is not None:
            # A plain PNG (drawn with the smoothing and scale chosen while it ran), not the
            # widget: a widget view saved in a notebook shows "model not found" once its
            # kernel is gone, and nbval, nbconvert and GitHub show the PNG anyway.
            bundle = {"image/png": base64.b64encode(self.png).decode("ascii")}
        else:
            bundle = {}
        bundle["text/plain"] = text
        self._shown_final = (text, reason)
        if self not in _finished:  # (re-themed when the page's theme changes: retheme_finished)
            _finished.append(self)
            del _finished[:-MAX_RETHEMED]
        return bundle

    def retheme(self) -> None:
        """Draws this finished run's figure again in the page's theme and replaces the cell's
        (the figure is a PNG: drawn light, it stayed white on a dark page)."""
        shown_final = getattr(self, "_shown_final", None)
        columns = self.history.snapshot()
        if self._handle is None or self.png is None or shown_final is None or not columns.get("step"):
            return
        self.png = run_plot.final_png(
            self.run_id or "?", columns, self._final_title, self.smoothing, self.scale, self.heals
        )
        self._handle.update(self._final_bundle(*shown_final), raw=True)

    def _build_widgets(self) -> None:
        import ipywidgets as w

        self._header = w.HTML(_status_html(before_the_run(), None, None))
        # Hidden until the first figure: an empty Image shows the browser's broken-image icon.
        self._image = w.Image(format="png", layout=w.Layout(max_width="100%", display="none"))
        self._stop_button = w.Button(
            description="Stop",
            icon="stop",
            button_style="danger",
            # A fixed width that does not shrink: beside the progress bar "auto" became "S...".
            layout=w.Layout(width="96px", min_width="96px", flex="0 0 auto", display="none"),
        )
        row = [self._stop_button]
        if self._progress:
            from tqdm.notebook import tqdm

            self._bar = tqdm(
                total=None, unit="step", display=False, bar_format=BAR_FORMAT, mininterval=0, miniters=1
            )
            row.insert(0, self._bar.container)
        self._build_controls()
        # The controls above the figure, which stays the box's last child (the panel's tests and
        # any code reading the figure from `.widget` find it there).
        self._breakdown_bar = w.HTML()  # filled by the run's "breakdown" events
        self.widget = w.VBox([self._header, w.HBox(row), self._breakdown_bar, self._controls, self._image])

    def _build_controls(self) -> None:
        """TensorBoard's smoothing slider and a y-scale toggle, above the figure."""
        import ipywidgets as w

        if self.smoothing not in SMOOTHING_WEIGHTS:
            self.smoothing = None  # the slider shows what is drawn: only its stops
        self._smoothing_slider = w.SelectionSlider(
            options=[("auto", "auto")] + [(f"{x:.2f}", x) for x in SMOOTHING_WEIGHTS],
            value="auto" if self.smoothing is None else self.smoothing,
            description="smoothing",
            tooltip=(
                "auto: a centred moving average over ~1/30 of the run; "
                "0-0.99: TensorBoard's exponential moving average weight (0: raw values)"
            ),
            continuous_update=False,  # one redraw when the slider is let go, not one per pixel
            layout=w.Layout(width="320px"),
        )
        self._scale_buttons = w.ToggleButtons(
            options=list(run_plot.SCALES),
            value=self.scale,
            description="y scale",
            tooltips=[
                "log when a metric spans more than 100x, else linear",
                "log (values <= 0 are not drawn)",
                "linear",
            ],
            style={"button_width": "64px"},  # (56 px cut "linear" to "lin…")
        )
        self._smoothing_slider.observe(self._on_control, names="value")
        self._scale_buttons.observe(self._on_control, names="value")
        # Hidden with the figure until it is drawn.
        self._figure_step = w.HTML()  # how far the figure goes (drawn less often than the header)
        self._figure_step.add_class("wb-figure-step")
        self._controls = w.HBox(
            [self._smoothing_slider, self._scale_buttons, self._figure_step],
            layout=w.Layout(display="none", flex_flow="row wrap"),
        )


def _name_from_id(run_id: str) -> str:
    """'20261122-113235-003' -> 'run 3' (what wb.Run names it by default)."""
    tail = run_id.rsplit("-", 1)[-1]
    return f"run {int(tail)}" if tail.isdigit() else f"run {run_id}"


def failed_html(name: str, reason: str | None, details: str | None, png: bytes | None) -> str:
    """A failed run in its cell: 'name failed: ValueError: ...' in one line, then a "details"
    toggle with the traceback, then the figure of the steps it did take (if any)."""
    import html

    first = (reason or "failed").strip().splitlines()[0] if (reason or "").strip() else "failed"
    if len(first) > 300:
        first = first[:300] + "\u2026"
    out = (
        "<div class='wb-run-failed' style='border-left:3px solid var(--jp-error-color1,#c62828);"
        "padding:2px 8px'>"
        f"<b>{html.escape(name or 'run')} failed:</b> <code class='wb-error-line'>{html.escape(first)}</code>"
    )
    if details or (reason and reason.strip() != first):
        out += (
            "<details class='wb-error-details'><summary>details</summary>"
            f"<pre style='white-space:pre-wrap;font-size:85%'>{html.escape(details or reason or '')}</pre></details>"
        )
    if png is not None:
        out += f"<img src='data:image/png;base64,{base64.b64encode(png).decode('ascii')}'/>"
    return out + "</div>"


# The finished dashboards of this kernel whose figure a theme switch draws again (the newest).
MAX_RETHEMED = 20
_finished: list = []


def retheme_finished() -> int:
    """The page's theme changed: every finished run's figure shown in a cell is drawn again in
    it (the live ones follow by themselves: plots/run_plot.py builds a figure per theme).
    Returns how many were redrawn."""
    count = 0
    for view in list(dict.fromkeys(_finished)):
        try:
            view.retheme()
            count += 1
        except Exception:  # noqa: BLE001 - a closed display must not break the others
            continue
    return count


def _status_html(title: str, message: str | None, reason: str | None) -> str:
    import html

    out = f"<b>{html.escape(title)}</b>"
    if reason:
        out += f"<br><span style='color:#a33'>{html.escape(reason)}</span>"
    if message:
        out += f"<br><small>{html.escape(message)}</small>"
    return out
