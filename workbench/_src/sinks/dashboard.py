"""The live training dashboard: a sink showing loss/metrics and examples/s against step.

Off the hot path by construction: `send` (called on the training thread) only appends rows and
sets flags; a renderer thread draws at most `max_rate_hz` times a second, and the figure only as
often as keeps its own drawing under `render_budget` of one core. It never clears other
output: in a kernel it shows one widget box (status, tqdm progress bar with ETA, the figure as an
ipywidgets Image, and above it TensorBoard's two reading controls: smoothing and the y scale)
under a display id. Widgets talk over comms, so updates from a background run's thread reach the
frontend. When the run ends, the display is replaced in place by a static PNG drawn with the
smoothing and scale chosen (what nbval, nbclient and a saved notebook keep: a saved widget view
shows "model not found" once its kernel is gone); the choice carries to the next run, and the
sidebar's Compare view reads finished runs interactively. Outside a kernel (a script, a
terminal) it is a console tqdm bar and a one-line summary; the figure is the PNG in the run
store; there are no controls.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from workbench._src.core.live import doing_now, shown
from workbench._src.core.run import Event
from workbench._src.core.run_stats import shown_reason
from workbench._src.plots import breakdown_plot, run_plot
from workbench._src.plots.live_frame import DrawingBudget
from workbench._src.sinks.dashboard_view import (
    DashboardView,
    Frontend,
    _name_from_id,
    _status_html,
    detect_frontend,
    failed_html,
)
from workbench._src.sinks.kernel_status import BusyWhileTheCellRuns

__all__ = ["Dashboard", "detect_frontend", "failed_html"]

# The last smoothing and scale chosen in this kernel: the next run's dashboard starts with them,
# so runs compared one after the other are read the same way.
_choice: dict = {"smoothing": None, "scale": "auto"}

# How long a run's end waits for the dashboard's final figure. Drawing takes well under a second;
# a renderer held longer is stuck on something outside it, and the run does not wait for it.
FINAL_FIGURE_WAIT = 60.0
FIGURE_THREAD = "workbench figure"  # the thread that draws the live figure


def _warn_stuck(thread: threading.Thread) -> None:
    """Says where the renderer is held (its stack), once, so that a stall can be found."""
    import traceback
    import warnings

    from workbench._src.compat import thread_frame

    frame = thread_frame(thread)
    where = "".join(traceback.format_stack(frame)[-8:]) if frame is not None else "(no stack)\n"
    warnings.warn(
        f"the dashboard's final figure was not drawn within {FINAL_FIGURE_WAIT:.0f} s; the run ended "
        f"without waiting for it. The drawing thread was held at:\n{where}",
        RuntimeWarning,
        stacklevel=3,
    )


class Dashboard(DashboardView):
    """A sink: pass it to `repl.train(..., sinks=[wb.ui.dashboard()])`; the magic and panel do.

    Args:
      display: show the widget box now, under a display id (False: the caller embeds `.widget`).
      frontend: "widgets", "console", or "auto" (widgets in a kernel, console elsewhere).
      max_rate_hz: most status/progress refreshes per second.
      render_budget: most fraction of one core's time spent drawing the figure while the run
        goes, over any 10 s (plots/live_frame.DrawingBudget: every snapshot is drawn while
        the figure's drawings stay within it).

    Attributes (read by tests and the bench): renders, render_seconds (CPU), render_times
    (monotonic), render_costs (CPU s each), cpu_seconds (renderer thread, before the end),
    render_threads, png (the last figure), history (rows seen in events), error, smoothing
    (None: the default line; else the EMA weight) and scale ("auto", "log", "linear"), which the
    controls set.
    """

    sink_name = "the live dashboard"

    def __init__(
        self,
        *,
        display: bool = True,
        frontend: Frontend = "auto",
        max_rate_hz: float = 2.0,
        render_budget: float = 0.1,
        progress: bool = True,
    ):
        self.frontend = detect_frontend() if frontend == "auto" else frontend
        if self.frontend not in ("widgets", "console"):
            raise ValueError(f"frontend must be 'auto', 'widgets' or 'console'; received {frontend!r}.")
        self.period = 1.0 / max_rate_hz
        self.render_budget = render_budget
        self.history = run_plot.History()
        self.heals: list[int] = []  # steps where a healed run resumed (launch/heal.py): marked
        self.started = False
        self.status = "waiting"
        self.run_id: str | None = None
        self.name = ""
        self.config: dict = {}
        self.first_step = 1
        self.message: str | None = None
        # The run's snapshot (core/live.py): the header, the bar and the figure show it.
        self.snapshot: dict | None = None
        self.breakdown: dict | None = None  # the last "breakdown" event's data (rows, text)
        self.png: bytes | None = None  # the last figure drawn
        self.renders = 0
        self.render_seconds = 0.0
        self.render_threads: set[str] = set()
        self.render_times: list[float] = []
        self.render_costs: list[float] = []
        # When the figure may be drawn next. It is drawn per snapshot, and snapshots come at least
        # REFRESH_SECONDS (= the period) apart: frames held that far apart too skipped a snapshot
        # whenever one came a little early after the last drawing's start. Half of it: no skips.
        self._budget = DrawingBudget(render_budget, self.period / 2)
        self.cpu_seconds = 0.0  # CPU the renderer thread used while the run went (all refreshes)
        self.error: BaseException | None = None
        self.smoothing: float | None = _choice["smoothing"]
        self.scale: str = _choice["scale"]
        self._progress = progress
        self._ended: dict | None = None
        self._wake = threading.Event()
        # The header and the bar are set from two threads (the run's, at each snapshot; ours, for
        # messages and the end): one at a time, each with the latest snapshot, so never backwards.
        self._view_lock = threading.Lock()
        self._plot_wake = threading.Event()  # a new snapshot or a control: the figure thread draws
        self._thread: threading.Thread | None = None
        self._plot_thread: threading.Thread | None = None
        self._plot_cpu = 0.0  # CPU the figure thread used
        self._next_plot = 0.0
        self._plotted_seq = None  # the snapshot the figure shows
        # A control changed: only the renderer thread draws, so the control asks it to (at once).
        self._redraw_requested = False
        self._bar = None
        self._bar_clock_started = False
        self._handle = None
        self._background = False
        self.widget = None
        if self.frontend == "widgets":
            self._build_widgets()
            if display:
                from IPython.display import display as show

                self._handle = show(self.widget, display_id=True)
                # Showing a widget has JupyterLab ask the kernel for a subshell, whose answer
                # made the kernel's indicator say Idle while the cell trained: Busy again.
                BusyWhileTheCellRuns()

    # ----- the sink: runs on the training thread, so it only records -----------------------
    def send(self, event: Event) -> None:
        if event.kind == "metrics":
            self.history.add(event.data["rows"])
            if "snapshot" in event.data:  # the run's one snapshot (core/live.py): shown now
                self.snapshot = event.data["snapshot"]
                # The header and the bar on this thread, as the sidebar's card is pushed from it
                # (notebook/labcomm.py): handed to a thread of ours, on a loaded machine the
                # header waited for a CPU and the GIL and fell two snapshots behind the card.
                # Cheap (they read the snapshot alone); the figure has its own thread.
                self._show_snapshot()
                self._plot_wake.set()
            return
        if event.kind == "started":
            self.started, self.status, self.run_id = True, "running", event.run_id
            self.config = dict(event.data.get("config") or {})
            self.name = event.data.get("name") or _name_from_id(event.run_id)
            self.first_step = int(event.data.get("first_step", 1))
            self._start_thread()
        elif event.kind in ("message", "checkpoint"):
            self.message = event.data.get("text") or f"checkpoint: {event.data.get('path')}"
            # A launched run says what it does (starting its processes) before it has started:
            # the header shows it at once.
            self._start_thread()
            self._wake.set()
        elif event.kind == "restart":  # a heal: marked on the step axis; its rows come again
            self.history.truncate(event.data["run_step"])
            self.snapshot = event.data.get("snapshot") or self.snapshot
            self.heals.append(event.data["run_step"])
        elif event.kind == "renamed":
            self.name = event.data.get("name") or self.name
        elif event.kind == "breakdown":
            self.breakdown = dict(event.data)
        elif event.kind == "ended":
            self.run_id = self.run_id or event.run_id
            self.name = self.name or event.data.get("name") or _name_from_id(event.run_id)
            self._ended = dict(event.data)
            self.snapshot = event.data.get("snapshot") or self.snapshot
            if self._thread is None:
                self._finish()
            else:
                # The final figure is drawn before the run is reported done, so a foreground
                # cell (and nbclient/nbval) always ends with it.
                self._wake.set()
                self._thread.join(timeout=FINAL_FIGURE_WAIT)
                if self._thread.is_alive():
                    _warn_stuck(self._thread)

    def attach_stop(self, stop: Callable[[], object]) -> None:
        """Shows a Stop button that calls `stop` (for background runs; the kernel is free)."""
        self._background = True
        if self.widget is None:
            return

        def on_click(button):
            button.disabled = True
            button.description = "Stopping..."
            stop()

        self._stop_button.on_click(on_click)
        self._stop_button.layout.display = "" if self._ended is None else "none"

    def close(self) -> None:
        """Removes the widgets (a run that never started); the renderer thread ends by itself."""
        self._ended = self._ended or {"status": "closed"}
        self._wake.set()
        if self.widget is not None:
            if self._handle is not None:
                self._handle.update({"text/plain": ""}, raw=True)
            for w in (self._bar, self.widget):
                if w is not None:
                    w.close()

    @property
    def target(self) -> int | None:
        """Steps the run was asked for (steps count from the run's own start everywhere)."""
        steps = self.config.get("steps")
        return int(steps) if steps is not None else None

    # ----- the renderer threads --------------------------------------------------------------
    # Two threads: one shows each snapshot in the header and the bar as it comes; the other
    # draws the figure from the latest snapshot when it is free (a frame that a newer snapshot
    # made stale is never drawn). On one thread a drawing held the header back by two snapshots.
    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="workbench dashboard", daemon=True)
            self._thread.start()
            if self.frontend == "widgets":
                self._plot_thread = threading.Thread(target=self._plot_loop, name=FIGURE_THREAD, daemon=True)
                self._plot_thread.start()

    def _loop(self) -> None:
        try:
            while self._ended is None:
                self._wake.wait(self.period)  # each snapshot, or max_rate_hz refreshes at most
                self._wake.clear()  # the end and the close set _ended before waking: seen below
                if self._ended is not None:
                    break
                self._refresh(final=False)
                self.cpu_seconds = time.thread_time() + self._plot_cpu
        except Exception as e:  # noqa: BLE001 - a broken plot must not touch training
            self.error = e
        finally:
            self._stop_plot_thread()
            self._finish()

    def _plot_loop(self) -> None:
        try:
            while self._ended is None:
                self._plot_wake.wait(self.period)  # a new snapshot, a control, or the period
                self._plot_wake.clear()
                # Within its CPU budget: new snapshots meanwhile are not drawn one by one; the
                # drawing after the wait shows the latest (a control's change comes at once).
                while self._ended is None and not self._redraw_requested:
                    wait = self._next_plot - time.monotonic()
                    if wait <= 0:
                        break
                    self._plot_wake.wait(wait)
                    self._plot_wake.clear()
                if self._ended is not None:
                    break
                forced, self._redraw_requested = self._redraw_requested, False
                self._draw_figure(forced)
                self._plot_cpu = time.thread_time()
        except Exception as e:  # noqa: BLE001 - a broken plot must not touch training
            self.error = e

    def _stop_plot_thread(self) -> None:
        thread = self._plot_thread
        if thread is not None and thread is not threading.current_thread():
            self._plot_wake.set()
            thread.join(timeout=FINAL_FIGURE_WAIT)

    def _finish(self) -> None:
        try:
            self.status = (self._ended or {}).get("status", "ended")
            self._refresh(final=True)  # (with the choice made by then)
        except Exception as e:  # noqa: BLE001
            self.error = e

    def _on_control(self, change=None) -> None:
        """A control changed (in the kernel's thread): the renderer thread redraws at once.

        After the end nothing is drawn: the cell's output is a plain PNG (_show_final) and the
        choice carries to the next run. A foreground run holds the kernel, so its changes arrive
        when the cell ends."""
        value = self._smoothing_slider.value
        self.smoothing = None if value == "auto" else float(value)
        self.scale = self._scale_buttons.value
        _choice.update(smoothing=self.smoothing, scale=self.scale)
        self._redraw_requested = True
        self._plot_wake.set()  # (a renderer that has ended is not woken: nothing is drawn)

    def _show_snapshot(self) -> None:
        try:
            self._refresh(final=False)
        except Exception as e:  # noqa: BLE001 - a broken view must not touch training
            self.error = e

    def _refresh(self, final: bool) -> None:
        """The header and the bar, from the latest snapshot (every refresh reads `self.snapshot`
        once: the numbers beside each other are one snapshot's); at the end, the final figure."""
        with self._view_lock:
            self._refresh_views(final)

    def _refresh_views(self, final: bool) -> None:
        if self.status == "closed":
            self._bar.close() if self._bar is not None else None
            return
        if not self.started and not final:  # a launched run's processes starting: what it says
            if self.frontend == "widgets":
                self._header.value = (
                    f"<div data-snapshot='0'>{_status_html('starting the run', self.message, None)}</div>"
                )
            return
        snapshot = self.snapshot
        if snapshot is not None and not final:  # the snapshot alone: no pass over the history
            columns, fig = {}, snapshot
            last = {k: math.nan if v is None else v for k, v in snapshot.get("metrics", {}).items()}
            summary, names = {"steps": snapshot["steps"], **last}, run_plot.metric_names(last)
        else:
            columns, fig = shown(self.history.snapshot(), snapshot, self.status, final, self.target)
            summary, names = run_plot.summarize(columns), run_plot.metric_names(columns)
        self._update_bar(summary, fig, names, final)
        title = run_plot.title_for(self.config, self.status, columns, self.name, self.target, fig=fig)
        if self.frontend == "widgets":
            reason = shown_reason(self.status, (self._ended or {}).get("reason"))
            # Before step 1, what the run is doing (importing, starting processes, compiling);
            # later the last thing it said (a lost worker, a checkpoint), under the numbers.
            message = doing_now(self.message, fig, self.status)
            # data-snapshot: which of the run's snapshots the header shows (the sidebar's cards say too)
            self._header.value = (
                f"<div data-snapshot='{fig.get('seq', 0)}'>{_status_html(title, message, reason)}</div>"
            )
            if self.breakdown:  # where a step's time goes: a stacked bar per worker, a sentence
                self._breakdown_bar.value = breakdown_plot.bar_html(
                    self.breakdown["rows"], self.breakdown.get("text", "")
                )
        if final:
            has_steps = bool(columns.get("step"))
            self.png = (
                run_plot.final_png(self.run_id or "?", columns, title, self.smoothing, self.scale, self.heals)
                if has_steps
                else None
            )
            self._show_final(summary, title)

    def _draw_figure(self, forced: bool) -> None:
        """The figure of the latest snapshot (on the figure thread), within its CPU budget."""
        snapshot = self.snapshot
        columns, fig = shown(self.history.snapshot(), snapshot, self.status, False, self.target)
        if len(columns.get("step", ())) <= 1 or (
            snapshot is not None and snapshot.get("seq") == self._plotted_seq and not forced
        ):
            return  # (nothing new to draw)
        now = time.monotonic()
        t0 = time.thread_time()  # CPU taken from training, not time spent waiting for the GIL
        live_title = run_plot.title_for(self.config, self.status, columns, self.name, numbers=False)
        # the header above carries the numbers
        self.png = run_plot.render(columns, live_title, self.smoothing, self.scale, self.heals, live=True)
        self._image.value = self.png
        self._image.layout.display = ""  # hidden until there is a picture: no broken-image icon
        # The figure says which snapshot it shows and how far it goes (the header's may be newer).
        self._plotted_seq = (snapshot or {}).get("seq")
        self._figure_step.value = (
            f"<span data-figure-snapshot='{self._plotted_seq or 0}'>figure: steps 1-{len(columns['step']):,}</span>"
        )
        self._controls.layout.display = ""
        cost = time.thread_time() - t0
        self.renders += 1
        self.render_seconds += cost
        self.render_threads.add(threading.current_thread().name)
        self.render_times.append(now)
        self.render_costs.append(cost)
        self._budget.spent(now, cost, counted=not run_plot.last_render_built())
        self._next_plot = self._budget.next_time()
