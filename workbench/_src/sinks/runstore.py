"""Run history: every run recorded on disk, listed by `wb.runs()`, reloaded by `wb.load_run()`.

Layout, one folder per run under the runs directory (default ./runs; WORKBENCH_RUNS_DIR or
`wb.set_runs_dir()` override it):
  <run id>/config.json     backend, replicas, options, status, times, summary
           history.csv     one row per step (flushed every FLUSH_SECONDS while running)
           events.jsonl    every event but metrics (started, checkpoint, message, ended)
           dashboard.png   the run's figure
           tb/             TensorBoard event files (`tensorboard --logdir runs`)
Reading them back: `workbench._src.store.runhistory` (wb.runs, wb.load_run).
The recorder is a sink registered as a default sink (workbench._src.sinks) by `install()` (which
`%load_ext workbench` and `wb.set_runs_dir` call); the heavy writing happens at the end.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import socket
import threading
import time
from pathlib import Path

from workbench._src.core.default_sinks import register_default, unregister_default
from workbench._src.core.run import Event
from workbench._src.core.tf_setup import tf
from workbench._src.plots import run_plot

ENV_VAR = "WORKBENCH_RUNS_DIR"
DEFAULT_DIR = "runs"
FLUSH_SECONDS = 1.0  # a killed kernel loses at most about this much history (appends: cheap)
CONFIG, HISTORY, EVENTS, FIGURE, TENSORBOARD = (
    "config.json",
    "history.csv",
    "events.jsonl",
    "dashboard.png",
    "tb",
)

_override: Path | None = None
_local = threading.local()  # a per-call directory (the magic's --logdir), seen by the factory
_recorded: dict[str, Path] = {}  # run id -> folder, for runs recorded by this process


def runs_dir() -> Path:
    """Where runs are recorded: set_runs_dir(), else $WORKBENCH_RUNS_DIR, else ./runs."""
    if _override is not None:
        return _override
    return Path(os.environ.get(ENV_VAR) or DEFAULT_DIR)


def set_runs_dir(path: str | os.PathLike | None) -> Path:
    """Records runs under `path` (None: back to $WORKBENCH_RUNS_DIR or ./runs) and turns recording on.

    Example:
      >>> import workbench as wb, tempfile
      >>> with tempfile.TemporaryDirectory() as folder:
      ...     wb.set_runs_dir(folder).is_dir()
      True
      >>> _ = wb.set_runs_dir(None)  # back to $WORKBENCH_RUNS_DIR or ./runs
    """
    global _override
    _override = Path(path) if path is not None else None
    install()
    return runs_dir()


@contextlib.contextmanager
def directory(path: str | os.PathLike | None):
    """Runs started inside (on this thread) are recorded under `path` (None: no change)."""
    previous = getattr(_local, "path", None)
    _local.path = Path(path) if path is not None else previous
    try:
        yield
    finally:
        _local.path = previous


def install() -> None:
    """Records every run from now on (idempotent): the recorder becomes a default sink."""

    register_default(_recorder_factory)


def uninstall() -> None:
    """Stops recording new runs."""

    unregister_default(_recorder_factory)


def record_dir(run_id: str | None) -> Path | None:
    """The folder this process recorded run `run_id` in, or None."""
    return _recorded.get(run_id) if run_id else None


def _recorder_factory(run) -> Recorder:
    base = getattr(_local, "path", None) or runs_dir()
    recorder = Recorder(run.id, run.name, base, config=run.config, tags=getattr(run, "tags", ()))
    run.name = recorder.name  # unique in the store: every other sink shows this name
    return recorder


class Recorder:
    """A sink writing one run's folder. Cheap per event; the figure and TensorBoard at the end.

    The record (config.json) is written at once, with the run's configuration: a run that fails
    before its first step still says what it was (backend, replicas, ...), and its name is
    claimed in the store before another kernel can take it.
    """

    sink_name = "the run store"  # (how a message names it: see Run.publish)

    def __init__(self, run_id: str, name: str, base: Path, config: dict | None = None, tags=()):
        self.run_id = run_id
        self.history = run_plot.History()
        self._flushed = 0
        self._last_flush = time.monotonic()
        with store_lock(Path(base)):
            self.path = _new_folder(Path(base), run_id)
            _recorded[run_id] = self.path
            self.name = unique_name(Path(base), name, exclude=self.path.name)
            self.record: dict = {
                "id": run_id,
                "name": self.name,
                "status": "created",
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": time.time(),
                "tags": list(tags),
                "config": config if config is not None else {},
            }
            self._write_record()

    def send(self, event: Event) -> None:
        if event.kind == "metrics":
            self.history.add(event.data["rows"])
            if time.monotonic() - self._last_flush > FLUSH_SECONDS:
                self._flush_history()  # a crashed kernel still leaves most of the history
            return
        if event.kind == "breakdown":  # (each second or so: the latest is what the record keeps)
            self.record["breakdown"] = {"rows": event.data.get("rows"), "text": event.data.get("text")}
            return
        self._append_event(event)
        if event.kind == "started":
            self.record.update(status="running", started=event.time, config=event.data.get("config", {}))
            self._write_record()
        elif event.kind == "renamed":  # wb.rename_run / tag_run wrote the file; keep it so
            self.record.update(name=event.data.get("name"), tags=list(event.data.get("tags") or []))
        elif event.kind == "checkpoint":
            self.record["last_checkpoint"] = event.data.get("path")
        elif event.kind == "restart":  # a heal: the rows after its step come again
            self.history.truncate(event.data["run_step"])
            if self._flushed > event.data["run_step"]:
                (self.path / HISTORY).unlink(missing_ok=True)
                self._flushed = 0  # the next flush writes the file again from its first row
            self.record.setdefault("restarts", []).append(
                {k: event.data.get(k) for k in ("member", "cause", "step", "lost_at", "run_step")}
            )
            self._write_record()
        elif event.kind == "ended":
            self._finish(event)

    def _finish(self, event: Event) -> None:
        columns = self.history.snapshot()
        self.record.update(
            status=event.data.get("status"),
            stop_reason=event.data.get("reason"),
            ended=event.time,
            summary=run_plot.summarize(columns),
        )
        self._write_history(columns)
        self._write_record()  # the essentials are safe before the slower parts below
        config = self.record.get("config", {})
        title = run_plot.title_for(config, self.record["status"], columns, self.name, config.get("steps"))
        for what, write in (
            ("figure", lambda: self._write_figure(columns, title)),
            ("tensorboard", lambda: _write_tensorboard(self.path / TENSORBOARD, columns)),
        ):
            try:
                write()
            except Exception as e:  # noqa: BLE001 - recorded in config.json, the run is not lost
                self.record[f"{what}_error"] = f"{type(e).__name__}: {e}"
                self._write_record()

    def _write_figure(self, columns: dict, title: str) -> None:
        if columns.get("step"):
            heals = [r["run_step"] for r in self.record.get("restarts", [])]  # marked, as live
            (self.path / FIGURE).write_bytes(run_plot.final_png(self.run_id, columns, title, marks=heals))

    def _append_event(self, event: Event) -> None:
        line = json.dumps(
            {"kind": event.kind, "time": event.time, "step": event.step, **event.data}, default=repr
        )
        with open(self.path / EVENTS, "a") as f:
            f.write(line + "\n")

    def _write_record(self) -> None:
        tmp = self.path / (CONFIG + ".tmp")
        tmp.write_text(json.dumps(self.record, indent=1, default=repr))
        os.replace(tmp, self.path / CONFIG)  # readers never see half a file

    def _flush_history(self) -> None:
        columns = self.history.snapshot()
        n = len(columns.get("step", []))
        names = list(columns)
        with open(self.path / HISTORY, "a", newline="") as f:
            out = csv.writer(f)
            if self._flushed == 0:
                out.writerow(names)
            out.writerows(zip(*(columns[k][self._flushed : n] for k in names)))
        self._flushed, self._last_flush = n, time.monotonic()

    def _write_history(self, columns: dict) -> None:
        names = list(columns)
        tmp = self.path / (HISTORY + ".tmp")
        with open(tmp, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(names or ["step", "wall_time", "examples_per_sec"])
            out.writerows(zip(*(columns[k] for k in names)))
        os.replace(tmp, self.path / HISTORY)


@contextlib.contextmanager
def store_lock(base: Path):
    """Holds the store's lock file (flock) while names are read and claimed: kernels on this
    machine (and on others, where the file system honours flock) never give two runs one name."""
    import fcntl

    base.mkdir(parents=True, exist_ok=True)
    with open(base / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def store_names(base: Path, exclude: str | None = None) -> dict[str, str]:
    """name -> run folder of every recorded run under base (call with store_lock held)."""
    names = {}
    for folder in base.iterdir() if base.is_dir() else []:
        if folder.name == exclude:
            continue
        try:
            name = json.loads((folder / CONFIG).read_text()).get("name")
        except (OSError, ValueError):
            continue
        if name:
            names[name] = folder.name
    return names


def unique_name(base: Path, name: str, exclude: str | None = None) -> str:
    """`name`, or `name (2)`, `name (3)`, ... whichever no other run in the store has."""
    taken = store_names(base, exclude)
    if name not in taken:
        return name
    n = 2
    while f"{name} ({n})" in taken:
        n += 1
    return f"{name} ({n})"


def _new_folder(base: Path, run_id: str) -> Path:
    """base/run_id, or base/run_id-<pid> when another process used the same id (same second)."""
    base.mkdir(parents=True, exist_ok=True)
    for name in (run_id, f"{run_id}-{os.getpid()}", f"{run_id}-{os.getpid()}-{time.monotonic_ns()}"):
        try:
            (base / name).mkdir()
            return base / name
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot make a folder for run {run_id} under {base}")


def _write_tensorboard(path: Path, columns: dict) -> None:
    """Scalars for every metric and examples/s, written as TensorBoard event records directly.

    No tf.summary and no tf.function: a compiled writer made per run traced again for every run,
    and TensorFlow warned about retracing from the 5th run in a kernel on (issue 23); eager
    tf.summary writes cost ~0.7 ms each. An event file is a TFRecord file of `Event` protos.
    """
    if not columns.get("step"):
        return
    import math

    t = tf()
    v1 = t.compat.v1  # Event, Summary, SummaryMetadata: TensorFlow's public names for its protos
    names = run_plot.metric_names(columns) + ["examples_per_sec"]
    steps = [int(v) for v in columns["step"]]  # counted from the run's start, as every view counts
    walls = columns.get("wall_time") or [0.0] * len(steps)
    metadata = v1.SummaryMetadata(plugin_data=v1.SummaryMetadata.PluginData(plugin_name="scalars"))
    path.mkdir(parents=True, exist_ok=True)
    now = time.time()
    file = path / f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.v2"
    with t.io.TFRecordWriter(str(file)) as out:
        out.write(v1.Event(wall_time=now, file_version="brain.Event:2").SerializeToString())
        started = now - float(walls[-1] or 0.0)
        for i, step in enumerate(steps):
            summary = v1.Summary()
            for name in names:
                value = float(columns[name][i]) if name in columns else math.nan
                if not math.isfinite(value):
                    continue
                tensor = t.make_tensor_proto(value, dtype=t.float32)  # a float scalar
                summary.value.add(tag=name, tensor=tensor, metadata=metadata)
            if summary.value:
                event = v1.Event(wall_time=started + float(walls[i] or 0.0), step=step, summary=summary)
                out.write(event.SerializeToString())
