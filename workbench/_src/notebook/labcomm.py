"""The kernel side of the JupyterLab extension: a comm target that tells the sidebar what happens.

`%load_ext workbench` calls `register()`. From then on the kernel keeps a small picture of the
session (the devices, the session's replicator, the recent runs with their step, metrics and
throughput) and pushes it to every open comm of target TARGET as one "snapshot" message:

  kernel -> frontend  {"type": "snapshot", "protocol": 1, "devices": {...}, "replicator": {...}|None,
                       "runs": [run, ...] (newest first), "notify_after_seconds": s,
                       "pools": [pool, ...]}  (this kernel's warm worker pools, launch/pool.py:
                       each pool's describe(): backend, workers, processes, state "busy" | "idle"
                       | "retiring", runs, idle_seconds, idle_since (epoch s) | None,
                       idle_timeout (s) | None, and "placement" for a Ray pool)
                      {"type": "figure", "run_id", "name", "png": base64}     (reply to "figure")
                      {"type": "error", "text"}
                      {"type": "runs", "rows": [...]}   (reply to "runs": the run store, wb.runs();
                      each row's "hparams": {name: value} | None)
                      {"type": "compare", "run_ids", "png": base64, "rows": [...],   (wb.compare_runs)
                       "series": [{"id", "name", "step": [...], "loss": [...] | None,
                       "examples_per_sec": [...]}, ...]}  (compare.series: <= 2,000 points a run,
                       NaN -> null; the interactive chart's data)
                      {"type": "export", "run_id", "filename", "mime", "data": base64}
  frontend -> kernel  {"type": "hello"} (the comm_open), {"type": "refresh"},
                      {"type": "stop", "run_id": id | None}, {"type": "figure", "run_id": id | None},
                      {"type": "runs"}, {"type": "compare", "run_ids": [...]},
                      {"type": "delete", "run_ids": [...]} (answered with "runs"),
                      {"type": "rename", "run_id", "name"}, {"type": "tag", "run_id", "tags": [...]}
                      (wb.rename_run / wb.tag_run; answered with "runs" and a snapshot),
                      {"type": "export", "run_id": id, "what": "csv" | "figure"},
                      {"type": "theme", "dark": bool} (on connecting and on a theme switch),
                      {"type": "shutdown_pools"} (pool.shutdown(): the idle pools end now, a busy
                      one after its run; answered with a snapshot)

Every figure a run shows (steps, steps/s, examples/s, ETA, its metrics) is the run's one snapshot
(core/live.py), the one its dashboard shows in the cell at the same refresh; the final one is
what wb.Run.summary() and the run store say.

Nothing polls: a run's sink pushes when something changes: each new snapshot of the run (at most
2 a second), its start and its end; a warm pool that starts, is taken by a run, goes idle
or ends pushes too (pool.observe calls back from whichever thread changed it). An idle pool's
idle time is counted on in the browser, from the snapshot's idle_seconds and the time since it
arrived (not from idle_since against the browser's clock: a remote kernel's clock may differ).
A frontend message reaches the kernel only when its shell is free: a background run can be
stopped with "stop"; a foreground run keeps the shell busy, so the frontend interrupts the
kernel instead (the run loop turns that into a clean stop) and the run's "foreground" field tells
it which to do. "shutdown_pools" sent during a foreground run waits for that run's end.

Both sides open comms: the kernel one in register(), so a sidebar already open learns at once
that `%load_ext workbench` ran; a frontend connecting later finds that comm with a comm_info
request and opens its own (a comm opened without the target is closed by the kernel, with an
error in its log: the frontend asks first).
Outside a Jupyter kernel (plain IPython, tests' in-process shell) register() does nothing.
"""

from __future__ import annotations

import base64
import threading
from collections import OrderedDict

from workbench._src.core.live import doing_now
from workbench._src.core.run_stats import figures, heal_line, shown_reason
from workbench._src.core.tf_setup import device_summary
from workbench._src.launch import pool as warm_pools  # (no TensorFlow: the registry and its processes)
from workbench._src.notebook import lab_store, session
from workbench._src.notebook.lab_store import jsonable
from workbench._src.plots import theme
from workbench._src.sinks import register_default, runstore
from workbench._src.studies.scaling import study_group

TARGET = "workbench.lab"
PROTOCOL = 1
MAX_RUNS = 24  # recent runs shown (this kernel's, newest first; a scaling study makes two per configuration)
NOTIFY_ENV, DEFAULT_NOTIFY_AFTER = "WORKBENCH_NOTIFY_AFTER", 30.0  # seconds
MAX_COMMS = 8  # comms of reloaded pages are never closed; keep the newest few

_lock = threading.RLock()
_comms: list = []  # open comms, oldest first
_watchers: OrderedDict[str, _RunWatcher] = OrderedDict()  # run id -> watcher, oldest first
_devices: dict | None = None
_replicator: dict | None = None  # the session's replicator, described on the main thread
_registered = False


def register(ipython=None) -> bool:
    """Registers the comm target and watches every run from now on; True when in a kernel.

    Idempotent. `ipython` is the shell `%load_ext` runs in (None: the current one).
    """
    global _registered
    if ipython is None:
        from IPython import get_ipython

        ipython = get_ipython()
    if getattr(ipython, "kernel", None) is None:
        return False  # no Jupyter frontend can talk to this shell
    with _lock:
        if _registered:
            return True
        import comm

        comm.get_comm_manager().register_target(TARGET, _on_open)
        register_default(_watch)
        session.observe(_on_session_change)
        warm_pools.observe(_on_pools_change)
        _describe_session()
        _registered = True
        # A sidebar that was told "not loaded" learns that it now is.
        _add_comm(comm.create_comm(target_name=TARGET, data=snapshot()))
    return True


def snapshot() -> dict:
    """What the sidebar shows, as one JSON-able message."""
    global _devices
    with _lock:
        if _devices is None:
            _devices = _device_info()
        runs = [w.info() for w in reversed(_watchers.values())]
        return {
            "type": "snapshot",
            "protocol": PROTOCOL,
            "devices": _devices,
            "replicator": _replicator,
            "runs": runs,
            "notify_after_seconds": _notify_after(),
            "pools": _pools_info(),
        }


def _notify_after() -> float:
    """Runs at least this long raise a notification when they end unseen (WORKBENCH_NOTIFY_AFTER)."""
    import os

    try:
        return float(os.environ.get(NOTIFY_ENV, DEFAULT_NOTIFY_AFTER))
    except ValueError:
        return DEFAULT_NOTIFY_AFTER


# ----- comms ---------------------------------------------------------------------------------
def _on_open(comm, msg) -> None:
    """A frontend opened a comm (its "hello"): remember it and answer with the snapshot."""
    _add_comm(comm)
    comm.send(snapshot())


def _add_comm(comm) -> None:
    with _lock:
        _comms.append(comm)
        while len(_comms) > MAX_COMMS:
            _comms.pop(0).close()
    comm.on_msg(lambda msg: _on_msg(comm, msg))
    comm.on_close(lambda msg: _drop_comm(comm))


def _drop_comm(comm) -> None:
    with _lock:
        if comm in _comms:
            _comms.remove(comm)


def _push(message: dict | None = None) -> None:
    with _lock:  # one sender at a time, the snapshot taken under the lock: snapshots arrive in order
        message = message or snapshot()
        for comm in list(_comms):
            try:
                comm.send(message)
            except Exception:  # noqa: BLE001 - a dead comm must not break a training run
                _comms.remove(comm)


def _on_msg(comm, msg) -> None:
    data = msg["content"]["data"] or {}
    kind = data.get("type")
    if kind == "stop":
        stopped = _stop(data.get("run_id"))
        _push()
        if not stopped:
            comm.send({"type": "error", "text": "No run of this kernel is running: nothing to stop."})
    elif kind == "figure":
        comm.send(_figure(data.get("run_id")))
    elif kind in ("runs", "compare", "delete", "export", "rename", "tag"):
        comm.send(lab_store.answer(kind, data, forget=_forget_runs))
        if kind in ("delete", "rename", "tag"):
            _push()  # every open sidebar (other notebooks too) hears of it at once
    elif kind == "shutdown_pools":  # the sidebar's Shut down (the panel's button does the same)
        warm_pools.shutdown(reason="Shut down in the sidebar")  # (its change pushes to every sidebar)
        comm.send(snapshot())
    elif kind == "theme":  # the page's theme: figures drawn from now on follow it
        dark = bool(data.get("dark"))
        changed = theme.is_dark() != dark
        theme.set_dark(dark)
        if changed:  # and the finished runs' figures already in cells are drawn again in it
            from workbench._src.sinks.dashboard_view import retheme_finished

            retheme_finished()
    elif kind in ("refresh", "hello"):
        comm.send(snapshot())
    else:
        comm.send({"type": "error", "text": f"workbench: unknown request {kind!r}; received {data!r}."})


def _forget_runs(run_ids: list[str]) -> None:
    with _lock:  # their cards leave the sidebar with the next snapshot
        for run_id in run_ids:
            _watchers.pop(run_id, None)


def _stop(run_id: str | None) -> bool:
    """Asks the run (None: every running run) to stop at its next step boundary."""
    with _lock:
        targets = [w for w in _watchers.values() if w.running and run_id in (None, w.run_id)]
    for watcher in targets:
        watcher.request_stop()
    return bool(targets)


def _figure(run_id: str | None) -> dict:
    """The dashboard PNG of run `run_id`, or of the newest run that has one."""

    with _lock:
        ids = [run_id] if run_id else [w.run_id for w in reversed(_watchers.values()) if not w.running]
    for rid in ids:
        folder = runstore.record_dir(rid)
        path = folder / runstore.FIGURE if folder else None
        if path is not None and path.is_file():
            name = _watchers[rid].name if rid in _watchers else rid
            return {
                "type": "figure",
                "run_id": rid,
                "name": name,
                "png": base64.b64encode(path.read_bytes()).decode("ascii"),
            }
    wanted = f"run {run_id!r}" if run_id else "any finished run of this kernel"
    return {
        "type": "error",
        "text": f"No dashboard figure for {wanted} yet: the figure is written when a run ends "
        "(recorded runs only: `%load_ext workbench` turns the run store on; see wb.runs()).",
    }


# ----- the session and the runs ------------------------------------------------------------
def _on_session_change(repl, choice) -> None:
    _describe_session()
    _push()


def _describe_session() -> None:
    """Describes the session's replicator now (main thread), so pushes from runs need no TF call."""
    global _replicator

    repl = session.current_or_none()
    if repl is None:
        _replicator = None
        return
    info = dict(repl.describe())
    info.update({k: v for k, v in (session.current_choice() or {}).items() if v is not None})
    _replicator = jsonable(info)


def _on_pools_change() -> None:
    _push()


def _pools_info() -> list[dict]:
    """This kernel's live warm pools, as their describe() says (no TensorFlow call, no pool lock
    held while describing)."""
    found = []
    for pool in warm_pools.live_pools():
        try:
            found.append(jsonable(pool.describe()))
        except Exception:  # noqa: BLE001 - a pool ending meanwhile must not break the snapshot
            continue
    return found


def _device_info() -> dict:

    return jsonable(device_summary())


def _watch(run) -> _RunWatcher:
    """The default-sink factory (workbench._src.sinks): one watcher per run that starts."""
    watcher = _RunWatcher(run)
    with _lock:
        _watchers[watcher.run_id] = watcher
        while len(_watchers) > MAX_RUNS:
            _watchers.popitem(last=False)
    return watcher


class _RunWatcher:
    """A run's sink: keeps its latest snapshot (core/live.py) and pushes each one."""

    def __init__(self, run):
        self.run = run  # dropped at the end: a finished run's history is not kept alive here
        self.restarts = run.restarts  # its heals (the list itself: a heal's seconds come later)
        self.run_id, self.name = run.id, run.name
        config = run.config
        self.backend = config.get("backend")
        self.num_replicas = config.get("num_replicas")
        self.num_workers = config.get("num_workers")
        self.target = config.get("steps")  # steps asked for, counted from the run's start
        self.group, self.warmup = study_group(run.name)
        self.status = "created"
        self.reason: str | None = None
        self.breakdown: str | None = None  # run.diagnosis(): where a step's time goes
        self.foreground = True
        self.stop_requested = False
        self.first_step: int | None = None
        self.snapshot: dict = figures({}, running=True)  # until the run's first (no step yet)
        self.started: float | None = None
        self.ended: float | None = None
        self.message: str | None = None  # the run's last "message" event (core/live.doing_now)

    @property
    def step(self) -> int:
        return self.snapshot["steps"]

    @property
    def running(self) -> bool:
        return self.status in ("created", "running")

    def request_stop(self) -> None:
        self.stop_requested = True
        run = self.run
        if run is not None:
            run.stop()

    def send(self, event) -> None:
        if event.kind == "started":
            # Foreground runs train on the kernel's main thread (the shell is busy: only an
            # interrupt reaches them); background runs in their own thread.
            self.foreground = threading.current_thread() is threading.main_thread()
            self.status, self.started = "running", event.time
            self.first_step = event.data.get("first_step", 1)
            self.name = event.data.get("name") or self.name  # (the store may have suffixed it)
            self.group, self.warmup = study_group(self.name)
            self._send_now()
        elif event.kind == "renamed":
            self.name = event.data.get("name") or self.name
            self.group, self.warmup = study_group(self.name)
            self._send_now()
        elif event.kind in ("metrics", "restart", "ended"):
            # The run's snapshot (a new one at most every live.REFRESH_SECONDS; a heal's rewound
            # one; the final one, over the whole run): pushed when it comes, as the dashboard shows it.
            self.snapshot = event.data.get("snapshot") or self.snapshot
            if event.kind == "ended":
                self.status, self.reason = event.data.get("status"), event.data.get("reason")
                self.ended = event.time
                self.run = None
            if event.kind != "metrics" or "snapshot" in event.data:
                self._send_now()
        elif event.kind == "breakdown":
            self.breakdown = event.data.get("text") or None  # the card's line under the figures
        elif event.kind == "message":  # before step 1, what the run is doing: shown at once
            self.message = event.data.get("text") or None
            if not self.snapshot.get("steps"):
                self._send_now()

    def _send_now(self) -> None:
        _push()

    def info(self) -> dict:
        fig = self.snapshot
        metrics = dict(fig.get("metrics") or {})
        return {
            "id": self.run_id,
            "name": self.name,
            "backend": self.backend,
            "num_replicas": self.num_replicas,
            "num_workers": self.num_workers,
            "status": self.status,
            "reason": shown_reason(self.status, self.reason),
            "breakdown": self.breakdown,
            "foreground": self.foreground,
            "stop_requested": self.stop_requested,
            "first_step": self.first_step,
            "step": fig["steps"],
            "target_step": self.target,
            "loss": metrics.get("loss"),
            "metrics": metrics,
            "examples_per_sec": fig["examples_per_sec"],
            "steps_per_sec": fig["steps_per_sec"],
            "median_examples_per_sec": fig["median_examples_per_sec"],
            "eta_seconds": fig["eta_seconds"],
            "snapshot_seq": fig.get("seq"),  # which of the run's snapshots (its dashboard shows it too)
            # What it is doing now before step 1 (starting processes, compiling), as the cell says.
            "doing": doing_now(self.message, fig, self.status) if not fig["steps"] else None,
            "group": self.group,
            "warmup": self.warmup,
            # The last heal in one line (launch/heal.py): "worker 1 lost (...) at step 312: ...".
            "heal": heal_line(self.restarts[-1], self.restarts) if self.restarts else None,
            "started": self.started,
            "ended": self.ended,
        }
