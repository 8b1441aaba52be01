"""wb.Run: one training run's record (history, events, status), its control (stop, wait) and
its lifecycle.

The run owns its lifecycle: `_start()`, then exactly one of `_end(status, reason)` or
`_fail(error)`; nothing else writes `status`. Whoever executes the run (the in-process loop, the
async coordinator, the launcher of worker processes) calls these, so every backend ends a run
the same way: the error carries `.run` with the history up to the failure, and `wait()` returns.

The run loop publishes events; sinks subscribe (`run.subscribe(sink)`) and never reach into the
loop. A sink is a callable taking an Event, or an object with `send(event)`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

_ids = itertools.count(1)


def _new_process_tag() -> str:
    # Random, not the pid: containers (every kernel pid 1) and machines sharing a runs directory
    # repeat pids. 6 hex digits: two kernels starting runs in the same second with the same
    # counter collide with probability 1 in 16 million.
    return secrets.token_hex(3)


_process_tag = _new_process_tag()
if hasattr(os, "register_at_fork"):  # a forked worker must not share its parent's tag

    def _retag_after_fork() -> None:
        global _process_tag
        _process_tag = _new_process_tag()

    os.register_at_fork(after_in_child=_retag_after_fork)

Status = str  # "created" | "running" | "finished" | "stopped" | "non-finite" | "failed"
ENDED_STATUSES = ("finished", "stopped", "non-finite", "failed")


@dataclasses.dataclass(frozen=True)
class Event:
    """Something that happened in a run. kind: started | metrics | checkpoint | message | ended.

    `data` for started: {"name": run name, "config": backend/steps/..., "first_step": n};
    for metrics: {"rows": [ {step, wall_time, examples_per_sec, <metrics>}, ... ]}.
    """

    kind: str
    run_id: str
    time: float
    step: int
    data: dict


class Run:
    """A training run: `history` (DataFrame), `events`, `status`, `stop()`, `wait()`."""

    def __init__(self, config: dict, name: str | None = None):
        number = next(_ids)
        # <time>-<process tag>-<counter>: sorts by time (to the second), unique across processes
        # (the tag) and within one (the counter); the counter stays last, so 'run 3' can be read
        # back from an id.
        self.id = f"{time.strftime('%Y%m%d-%H%M%S')}-{_process_tag}-{number:03d}"
        self.name = name or f"run {number}"
        self.config = dict(config)
        self.status: Status = "created"
        self.stop_reason: str | None = None
        self.error: BaseException | None = None
        self.events: list[Event] = []
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.compile_seconds: float | None = None
        # Processes a launched run started: {"role", "index", "pid"} each (empty in one process).
        self.processes: list[dict] = []
        self._columns: dict[str, list] = {}
        self._rows = 0
        self._sinks: list[Callable[[Event], Any]] = []
        self._stop = threading.Event()
        self._interrupted = False  # the stop came from Ctrl-C / a kernel interrupt
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ----- reading ------------------------------------------------------------------------
    @property
    def history(self):
        """One row per step: step, wall_time (s since start), examples_per_sec, the metrics."""
        import pandas as pd

        with self._lock:
            return pd.DataFrame({k: list(v) for k, v in self._columns.items()})

    @property
    def steps(self) -> int:
        """Steps recorded so far (exact: counted by the loop, not by an optimizer)."""
        return self._rows

    @property
    def running(self) -> bool:
        return self.status == "running"

    @property
    def ended(self) -> bool:
        """True once the run has ended, whatever its status (False while created or running)."""
        return self._done.is_set()

    def summary(self) -> dict:
        """Steps (from the run's start), time, throughput and the last value of each metric.

        steps_per_sec / examples_per_sec: over the last 10 s while the run goes, over the whole
        run once it ended; median_examples_per_sec: the median step's. One definition for every
        view (workbench/_src/core/run_stats.py).
        """
        from workbench._src.core.run_stats import figures, last_metrics

        h = self.history
        out = {"run": self.id, "status": self.status, "steps": self.steps}
        if self.stop_reason:
            out["stop_reason"] = self.stop_reason
        fig = figures(h, running=not self.ended, target_steps=self.config.get("steps"))
        for key in ("wall_time_s", "steps_per_sec", "examples_per_sec", "median_examples_per_sec"):
            if fig[key] is not None:
                out[key] = fig[key]
        out.update(last_metrics(h))
        return out

    # ----- control ------------------------------------------------------------------------
    def stop(self) -> Run:
        """Asks the run to stop at the next step boundary (returns at once; see wait())."""
        self._stop.set()
        return self

    def interrupt(self) -> Run:
        """A stop asked for by Ctrl-C or a kernel interrupt: the run ends "stopped", and its
        stop_reason says it was interrupted."""
        self._interrupted = True
        return self.stop()

    def stopped_reason(self, step: int) -> str:
        """The stop_reason of a run stopped at `step`: 'interrupted at step N' or 'stopped at step N'."""
        return f"{'interrupted' if self._interrupted else 'stopped'} at step {step}"

    def wait(self, timeout: float | None = None) -> Run:
        """Blocks until the run has ended (background runs); re-raises the run's error."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.name} is still running after {timeout} s (step {self.steps}).")
        if self.status == "failed" and self.error is not None:
            raise self.error
        return self

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    # ----- the event stream ---------------------------------------------------------------
    def subscribe(self, sink) -> Run:
        """Adds a sink: a callable(event) or an object with send(event). Past events are replayed."""
        send = sink if callable(sink) else sink.send
        with self._lock:
            past = list(self.events)
            self._sinks.append(send)
        for event in past:
            send(event)
        return self

    def publish(self, kind: str, **data) -> Event:
        event = Event(kind, self.id, time.time(), self.steps, data)
        with self._lock:
            self.events.append(event)
            sinks = list(self._sinks)
        for send in sinks:
            try:
                send(event)
            except Exception as e:  # a broken plot must not kill training
                with self._lock:
                    self._sinks.remove(send)
                self.events.append(
                    Event(
                        "message",
                        self.id,
                        time.time(),
                        self.steps,
                        {"text": f"sink {send!r} removed after error: {e!r}"},
                    )
                )
        return event

    def record_rows(self, rows: list[dict]) -> None:
        with self._lock:
            for row in rows:
                for key in row:
                    if key not in self._columns:  # a metric seen for the first time
                        self._columns[key] = [float("nan")] * self._rows
                for key, column in self._columns.items():
                    column.append(row.get(key, float("nan")))
                self._rows += 1
        self.publish("metrics", rows=rows)

    # ----- lifecycle (called by whatever executes the run) ----------------------------------
    def _start(self) -> None:
        if self.status != "created":
            raise RuntimeError(f"{self.name} was already started (status {self.status!r}).")
        self.status = "running"
        self.started_at = time.time()

    def _end(self, status: Status, reason: str | None = None) -> None:
        """Ends the run once; later calls are ignored (the first ending is the true one)."""
        if status not in ENDED_STATUSES:
            raise ValueError(f"a run ends as one of {ENDED_STATUSES}; received status={status!r}.")
        with self._lock:
            if self._done.is_set() or self.status == "ending":
                return
            self.status = "ending"  # claimed: a second caller returns above
        self.stop_reason = reason
        self.ended_at = time.time()
        self.status = status
        try:
            self.publish("ended", status=status, reason=reason)
        finally:
            self._done.set()

    def _fail(self, error: BaseException) -> None:
        """Ends the run as failed with `error`, which then carries this run (`error.run`)."""
        self.error = error
        if getattr(error, "run", None) is None:
            try:
                error.run = self  # the history up to the failure travels with the error
            except AttributeError:  # a built-in exception that takes no attributes
                pass
        self._end("failed", f"{type(error).__name__}: {error}")

    def _repr_html_(self):
        import html

        from workbench._src.core.run_stats import fmt, shown_reason

        if not self.ended and self._thread is not None:
            # Shown once when the cell ends and never refreshed: no frozen "running, steps 0".
            return (
                f"<b>wb.Run</b> {html.escape(self.name)}: training in the background "
                f"({self.config.get('steps') or 'open-ended'} steps). Live figures: its dashboard (unless "
                "--no-live) and the Replicator sidebar; <code>run.summary()</code> now, "
                "<code>run.wait()</code>, <code>run.stop()</code>."
            )
        s = self.summary()
        reason = shown_reason(s["status"], s.pop("stop_reason", None))  # no "stopped (stopped at ...)"
        if reason:
            s["stop_reason"] = reason
        cells = "".join(
            f"<tr><th style='text-align:left'>{html.escape(k)}</th><td data-key='{html.escape(k)}'>"
            f"{fmt(v) if isinstance(v, float) else html.escape(str(v))}</td></tr>"
            for k, v in s.items()
        )
        return f"<b>wb.Run</b> {html.escape(self.name)}<table class='wb-run-summary'>{cells}</table>"

    def __repr__(self):
        return f"<wb.Run {self.name!r} {self.status} steps={self.steps}>"
