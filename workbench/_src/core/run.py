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
import os
import secrets
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from workbench._src.core import live
from workbench._src.core.run_names import backend_label, default_name, short_source  # noqa: F401
from workbench._src.core.run_stats import figures, fmt, last_metrics, shown_reason
from workbench._src.core.tracebacks import plain, readable, shown_text

_source_override: str | None = None  # set by `workbench run FILE.py` (set_source)
_live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> Run of this process


def live_run(run_id: str):
    """The wb.Run of this process with that id, while something still holds it (else None)."""
    return _live.get(run_id)


def new_run_id(now: float | None = None) -> str:
    """'20261124-140233-a1b2c3': the start time (sorts by time) and 6 random hex digits.

    Random per run, not a pid or a per-process counter: containers give every kernel pid 1,
    machines sharing a runs directory repeat pids, and counters restart in every kernel (issue
    23 saw "run 3" twice). Two runs started in the same second collide with probability 1 in 16
    million; the store makes a second folder if they do (runstore._new_folder).
    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"{stamp}-{secrets.token_hex(3)}"


def set_source(path: str | os.PathLike | None) -> None:
    """Names the script runs come from (`workbench run FILE.py` calls it; None: detect again)."""
    global _source_override
    _source_override = os.fspath(path) if path is not None else None


def run_source() -> str | None:
    """Where runs of this process come from: the notebook's path, else the script's file.

    A Jupyter kernel learns its notebook from the server: JPY_SESSION_NAME in its environment
    (jupyter_server sets it to the notebook's path) or `__session__` in the user namespace
    (ipykernel copies it there). None when neither a notebook nor a script can be told.
    """
    if _source_override:
        return _source_override
    session = os.environ.get("JPY_SESSION_NAME")
    if not session:
        try:
            from IPython import get_ipython

            shell = get_ipython() if "IPython" in sys.modules else None
        except Exception:  # noqa: BLE001 - IPython broken or absent: no notebook to name
            shell = None
        if shell is not None:
            session = shell.user_ns.get("__session__")
    if session:
        return str(session)
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path and not os.path.basename(path).startswith(("ipykernel_launcher", "pytest", "__main__")):
        return path
    return None


Status = str  # "created" | "running" | "finished" | "stopped" | "preempted" | "non-finite" | "failed"
ENDED_STATUSES = ("finished", "stopped", "preempted", "non-finite", "failed")
# A stop request's kind, agreed between the processes of a run (the most urgent wins).
NO_STOP, STOP, PREEMPT = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Event:
    """Something that happened in a run. kind: started | metrics | checkpoint | message |
    breakdown | renamed | restart | ended.

    `data` for started: {"name": run name, "config": backend/steps/..., "first_step": n};
    for metrics: {"rows": [ {step (from the run's start), wall_time, examples_per_sec,
    global_step (the program's), examples (this step's global batch), <metrics>}, ... ]};
    for breakdown: {"rows": [ {worker, input, compute, communication, other, step, steps}, ...
    ], "text": the diagnosis sentence} (seconds per step; core/breakdown.py);
    for renamed: {"name", "tags"}; for restart (a heal, launch/heal.py): {"member", "cause",
    "step" (the checkpoint's global step), "run_step" (the run's step the history was rewound
    to: rows after it are dropped and come again), "lost_at", "seconds"}.
    """

    kind: str
    run_id: str
    time: float
    step: int
    data: dict


def _rebased(row: dict, step: int) -> dict:
    """The row with `step` counted from the run's start and the program's step as `global_step`
    (columns: step, wall_time, examples_per_sec, global_step, then the rest)."""
    head = {"step": step}
    for key in ("wall_time", "examples_per_sec"):
        if key in row:
            head[key] = row[key]
    head["global_step"] = row["step"]
    head.update((k, v) for k, v in row.items() if k not in head and k != "step")
    return head


class Run:
    """A training run: `history` (DataFrame), `events`, `status`, `stop()`, `wait()`.

    Identity: `id` (unique across kernels and machines sharing a store, sorted by time), `name`
    (readable; the run store makes it unique there, see runstore.claim_name), `tags`, and
    `config` (backend, replicas, ..., `source`: the notebook or script, `hparams`).
    """

    def __init__(self, config: dict, name: str | None = None, tags=(), hparams: dict | None = None):
        created = time.time()
        self.id = new_run_id(created)
        self.config = dict(config)
        self.config.setdefault("source", run_source())
        if hparams:
            self.config["hparams"] = dict(hparams)
        self.name = name or default_name(self.config, self.config.get("source"), created)
        self.tags: list[str] = list(dict.fromkeys(str(t) for t in tags or ()))
        self.created_at = created
        _live[self.id] = self
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
        self._live = live.Keeper()  # the one snapshot every live view shows (run.snapshot)
        self._breakdown: dict[int, dict] = {}  # worker -> its latest breakdown row (breakdown.py)
        self._sinks: list[Callable[[Event], Any]] = []
        self._stop = threading.Event()
        self._interrupted = False  # the stop came from Ctrl-C / a kernel interrupt
        self._preempted: str | None = None  # why the run is being preempted (e.g. "SIGTERM")
        # One dict per heal of a run with max_restarts: member, cause, step, seconds.
        self.restarts: list[dict] = []
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

    def breakdown(self):
        """Where a step's time goes, one row per worker (one in process): `input` (waiting for
        input_fn), `compute`, `communication` (collectives or parameter-server traffic, waiting
        for peers included), `other` (host and Python overhead), in seconds per step adding up to
        `step` (measured), from a sample of `steps`; empty with breakdown=False. A DataFrame."""
        from workbench._src.core import breakdown

        return breakdown.frame(self._breakdown_rows(), self.config.get("backend"))

    def diagnosis(self) -> str:
        """breakdown() in one sentence: what dominates a step and the likely fix."""
        from workbench._src.core import breakdown

        return breakdown.rows_diagnosis(self._breakdown_rows(), self.config.get("backend"))

    def record_breakdown(self, row: dict) -> None:
        """Keeps a worker's latest breakdown row; publishes "breakdown" (all rows, the sentence)."""
        self._breakdown[int(row.get("worker", 0))] = dict(row)  # (one assignment: atomic)
        self.publish("breakdown", rows=self._breakdown_rows(), text=self.diagnosis())

    def _breakdown_rows(self) -> list[dict]:
        return [dict(r) for _, r in sorted(dict(self._breakdown).items())]

    @property
    def snapshot(self) -> dict | None:
        """What every live view shows now: steps, rates, ETA, last metrics (core/live.py)."""
        return self._live.current

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

        h = self.history
        out = {"run": self.id, "status": self.status, "steps": self.steps}
        if self.stop_reason:
            out["stop_reason"] = self.stop_reason
        fig = figures(h, running=not self.ended, target_steps=self.config.get("steps"))
        for key in ("wall_time_s", "steps_per_sec", "examples_per_sec", "median_examples_per_sec"):
            if fig[key] is not None:
                out[key] = fig[key]
        out.update(last_metrics(h))
        if self._breakdown:
            out["breakdown"] = self.diagnosis()
        if getattr(self, "startup", None):  # a launched run: seconds per phase of its start
            out["startup"] = dict(self.startup)
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

    def preempt(self, cause: str = "SIGTERM") -> Run:
        """A preemption (SIGTERM from a scheduler or cluster manager): the run saves at the next
        step boundary and ends "preempted"; run again with the same steps, it finishes the run
        it began (core/resume.py)."""
        self._preempted = cause
        return self.stop()

    @property
    def stop_kind(self) -> int:
        """NO_STOP, STOP or PREEMPT: what the run was asked to do at its next step boundary."""
        if self._preempted:
            return PREEMPT
        return STOP if self._stop.is_set() else NO_STOP

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
                        {
                            "text": f"{_sink_name(send)} stopped receiving this run's events after an "
                            f"error ({type(e).__name__}: {e}); training goes on without it"
                        },
                    )
                )
        return event

    def record_rows(self, rows: list[dict]) -> None:
        """Appends rows; `step` counts from this run's start (1, 2, ...) whatever the program's
        own count, which is kept as `global_step` (a second run of a model: step 1.., global 301..)."""
        with self._lock:
            for i, row in enumerate(rows):
                if "global_step" not in row and "step" in row:  # (a relayed row is rebased already)
                    row = rows[i] = _rebased(row, self._rows + 1)
                batch = row.get("examples")
                if batch is not None and batch == batch and "global_batch" not in self.config:
                    self.config["global_batch"] = int(batch)  # known from the first step on
                for key in row:
                    if key not in self._columns:  # a metric seen for the first time
                        self._columns[key] = [float("nan")] * self._rows
                for key, column in self._columns.items():
                    column.append(row.get(key, float("nan")))
                self._rows += 1
            fresh = self._live.add(rows, self.config.get("steps"))
        self.publish("metrics", rows=rows, **({"snapshot": fresh} if fresh else {}))

    def _rewind(self, global_step: int | None) -> int:
        """Keeps the rows up to `global_step` (a healed run goes on from its checkpoint's step:
        the rows after it are trained again, not kept twice; None: no checkpoint, none kept).
        By each row's global step, not by position: a row relayed late or twice cannot shift
        what is kept. Returns how many rows are left. Sinks learn it from the "restart" event."""
        with self._lock:
            globals_ = self._columns.get("global_step", [])
            kept = [i for i, g in enumerate(globals_) if global_step is not None and g <= global_step]
            for name, column in self._columns.items():
                self._columns[name] = [column[i] for i in kept]
            self._rows = len(kept)
            self._live.rewind(self._columns, self.config.get("steps"))  # ("restart" carries it)
            return self._rows

    def rename(self, name: str) -> None:
        """Sets the name shown everywhere (wb.rename_run also renames it in the run store)."""
        self.name = str(name)
        self.publish("renamed", name=self.name, tags=list(self.tags))

    # ----- lifecycle (called by whatever executes the run) ----------------------------------
    def _start(self) -> None:
        if self.status != "created":
            raise RuntimeError(f"{self.name} was already started (status {self.status!r}).")
        self.status = "running"
        self.started_at = time.time()

    def _end(self, status: Status, reason: str | None = None, details: str | None = None) -> None:
        """Ends the run once; later calls are ignored (the first ending is the true one)."""
        if status not in ENDED_STATUSES:
            raise ValueError(f"a run ends as one of {ENDED_STATUSES}; received status={status!r}.")
        with self._lock:
            if self._done.is_set() or self.status == "ending":
                return
            self.status = "ending"  # claimed: a second caller returns above
        self.stop_reason = reason
        self.ended_at = time.time()
        with self._lock:  # every view ends with the figures over the whole run
            final = self._live.end(self._columns, self.config.get("steps"))
        self.status = status
        try:
            extra = {"details": details} if details else {}
            self.publish("ended", status=status, reason=reason, name=self.name, snapshot=final, **extra)
        finally:
            self._done.set()

    def _fail(self, error: BaseException) -> None:
        """Ends the run as failed with `error`, which then carries this run (`error.run`).

        What is kept (and re-raised) is the error's cause, with the researcher's frames only
        (core/tracebacks.py): the reason every view shows starts with the cause's own sentence.
        """
        error = self.error = readable(error)
        if getattr(error, "run", None) is None:
            try:
                error.run = self  # the history up to the failure travels with the error
            except AttributeError:  # a built-in exception that takes no attributes
                pass
        reason = plain(f"{type(error).__name__}: {error}")
        self._end("failed", reason, details=shown_text(error)[-20000:])

    @property
    def _ipython_display_(self):
        """IPython's display hook, there only while the run trains in the background: its output
        then becomes its summary when it ends (core/run_display.py). Any other run is a plain
        result (an AttributeError here is how IPython hears "no such hook")."""
        if self.status in ENDED_STATUSES or self._thread is None:
            raise AttributeError("_ipython_display_")
        from workbench._src.core.run_display import display_run

        return lambda: display_run(self)

    def _repr_html_(self):
        import html

        if self.status not in ENDED_STATUSES and self._thread is not None:
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


def _sink_name(send) -> str:
    """How a message names a sink: its `sink_name` (e.g. "the run store"), else its class or
    function name, never a bound method's repr."""
    owner = getattr(send, "__self__", None)
    named = getattr(owner if owner is not None else send, "sink_name", None)
    if named:
        return named
    if owner is not None:
        return f"the {type(owner).__name__} sink"
    return f"the sink {getattr(send, '__qualname__', None) or type(send).__name__}"
