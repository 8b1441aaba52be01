"""wb.Run: one training run's record (history, events, status) and its control (stop, wait).

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

Status = str  # "created" | "running" | "finished" | "stopped" | "interrupted" | "non-finite" | "failed"


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
        self._columns: dict[str, list] = {}
        self._rows = 0
        self._sinks: list[Callable[[Event], Any]] = []
        self._stop = threading.Event()
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
        """Steps, time, steady throughput and the last value of each metric."""
        h = self.history
        out = {"run": self.id, "status": self.status, "steps": self.steps}
        if self.stop_reason:
            out["stop_reason"] = self.stop_reason
        if len(h):
            out["wall_time_s"] = round(float(h["wall_time"].iloc[-1]), 3)
            steady = h["examples_per_sec"].dropna()
            if len(steady):
                out["examples_per_sec"] = round(float(steady.median()), 1)
            for col in h.columns:
                if col not in ("step", "wall_time", "examples_per_sec"):
                    out[col] = float(h[col].iloc[-1])
        return out

    # ----- control ------------------------------------------------------------------------
    def stop(self) -> Run:
        """Asks the run to stop at the next step boundary (returns at once; see wait())."""
        self._stop.set()
        return self

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

    def _finish(self, status: Status, reason: str | None = None) -> None:
        self.status = status
        self.stop_reason = reason
        self.ended_at = time.time()
        self.publish("ended", status=status, reason=reason)
        self._done.set()

    def _repr_html_(self):
        s = self.summary()
        cells = "".join(f"<tr><th style='text-align:left'>{k}</th><td>{v}</td></tr>" for k, v in s.items())
        return f"<b>wb.Run</b> {self.name}<table>{cells}</table>"

    def __repr__(self):
        return f"<wb.Run {self.name!r} {self.status} steps={self.steps}>"
