"""Warm pools: the processes of a process backend stay up between runs of the same shape.

A run on worker processes used to pay 10-40 s of start-up every time (spawn, import TensorFlow,
start the servers, form the cluster). A Pool is those processes, kept after a run that ended
cleanly: the next run of the same shape (backend and the plan fields that define the processes,
`LaunchPlan.shape()`) sends its work to them and starts in about a second; each process frees
what the previous run left (backends/remote.py `ProcessBackend.release_run_state`).

The rules, all here:
  - one *idle* pool per interpreter: a run of another shape retires it (the machine's memory
    is the limit, and a notebook trains one thing at a time); busy pools are never touched;
  - a run that failed, timed out or lost a process retires its pool (the cluster is in doubt:
    a worker that saw a collective fail cannot run collectives again); so does a pool found
    with a dead member when the next run takes it; the next run says so in one line;
  - a pool ends with `shutdown()` (repl.shutdown(), the panel's button, the session's
    replicator replaced), after `idle_timeout` seconds unused (a daemon timer: it never holds
    the interpreter), at interpreter exit (atexit), and when this process is killed (each
    member exits on EOF of its stdin pipe, see channel.exit_when_parent_dies).

Where the processes run is `ProcessGroup` (local processes in a private network namespace);
everything above it (shipping, relaying events, faults, the Run) only sees a Pool's `tasks`,
`channel`, `send_work`, `processes` and `alive` (launch/pool_common.py); launch/ray_pool.py makes
them of Ray actors.
"""

from __future__ import annotations

import atexit
import contextlib
import subprocess
import threading
import time

from workbench._src.launch.channel import Channel
from workbench._src.launch.pool_common import PoolCommon
from workbench._src.launch.proc import pid_alive
from workbench._src.launch.processes import ProcessGroup

WORKER_MODULE = "workbench._src.launch.worker_main"

_lock = threading.Lock()
_pools: list[Pool] = []  # live pools, busy or idle
_retired_because: dict = {}  # shape -> why its last pool was retired (said by the next run)
_observers: list = []  # called with no argument after any pool changes state (the sidebar)
_prestarting: dict = {}  # shape -> the thread starting a pool of that shape in the background
_prestart_failed: dict = {}  # shape -> why its background start failed (said by the next run)


class Pool(PoolCommon):
    """The processes of one launch plan, started once and reused while they stay healthy."""

    def __init__(self, backend: str, plan, keep: bool = True):
        super().__init__(backend, plan, keep)
        self.tasks = plan.tasks()  # fixed for the pool's life: ports, TF_CONFIG
        self.group = ProcessGroup(backend)
        self.channel = Channel(self.group)

    # ----- what the launcher uses -------------------------------------------------------------
    def start(self) -> None:
        """Starts every process at once (none waits for another; each connects back on its own)."""
        for task in self.tasks:
            self.group.start(task.role, task.index, WORKER_MODULE, {**self.channel.env(), **task.env})

    @property
    def processes(self) -> list[dict]:
        """Role, index and pid of every process of the pool (a coordinator's servers included)."""
        own = [{"role": c.role, "index": c.index, "pid": c.pid} for c in self.group.children]
        return own + list(self.extra)

    def dead_member(self) -> str:
        """'' when every process of the pool is alive, else which one is not and how it ended."""
        for child in self.group.children:
            # (poll() alone is not enough: a child reaped elsewhere, e.g. by a subreaper's
            # waitpid(-1), reads None for ever; /proc says it is gone)
            if child.popen.poll() is not None or not pid_alive(child.pid):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    # (poll() reads None while another thread waits on it: this waits for the
                    # status, so the line says how it ended, not "still running")
                    child.popen.wait(timeout=2)
                return f"{child.role} {child.index} (pid {child.pid}) {child.exit_description()}"
        for p in self.extra:
            if not pid_alive(p["pid"]):
                return f"{p['role']} {p['index']} (pid {p['pid']}) exited"
        return ""

    # ----- ending ------------------------------------------------------------------------------
    def stop(self) -> None:
        """Asks every process to exit, then stops whatever is left; removes every file."""
        if self._timer is not None:
            self._timer.cancel()
        self.channel.broadcast({"type": "shutdown"})
        deadline = time.monotonic() + 2.0  # a clean exit removes its own temp folder and servers
        while self.group.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        for child in self.group.children:
            child.expected_exit = True
        self.group.stop(grace=1.0)  # MWMS ignores SIGTERM: the SIGKILL after the grace does it
        self.channel.close()

    def describe(self) -> dict:
        """For the panel: backend, shape, processes, state and idle seconds."""
        idle = time.time() - self.idle_since if self.state == "idle" and self.idle_since else 0.0
        workers = len([t for t in self.tasks if t.role == "worker"])
        servers = [p for p in self.extra if p["role"] == "worker"]
        return {
            "backend": self.backend,
            "workers": len(servers) or workers,
            "processes": len(self.processes),
            "state": self.state,
            "runs": self.runs,
            "idle_seconds": idle,
            "idle_since": self.idle_since if self.state == "idle" else None,
            "idle_timeout": self.idle_timeout,
        }


# ----- the registry ------------------------------------------------------------------------------
def checkout(backend: str, plan) -> tuple[Pool, list[str]]:
    """A pool for one run of `plan`: the idle one of the same shape when it is healthy, else a
    new one (not yet started). Returns it, marked busy, and the lines to say in the run."""
    notes: list[str] = []
    retire: list[tuple[Pool, str]] = []
    keep = bool(getattr(plan, "pool", True))
    shape = plan.shape()
    with _lock:
        starting = _prestarting.get(shape)
    if starting is not None:  # chosen a moment ago: its processes are already on their way
        starting.join(timeout=plan.launch_timeout)
    with _lock:
        failed = _prestart_failed.pop(shape, None)
        if failed:
            notes.append(f"the {backend} pool's start in the background failed ({failed}): starting again")
        for pool in [p for p in _pools if p.state == "idle"]:
            if pool.shape != shape or not keep:
                retire.append((pool, "a run of another shape"))
                notes.append(
                    f"retired the warm {pool.backend} pool ({_shape_text(pool)}): this run has another shape"
                )
                continue
            # (a pool started in the background and never used: its queued messages are its
            # start's, the hellos the launcher answers with work; they are not drained)
            problem = pool.drain() if pool.runs else pool.dead_member()
            if problem:
                retire.append((pool, problem))
                notes.append(f"the warm {pool.backend} pool lost {problem} while idle: starting a fresh one")
                continue
            pool.state, pool.idle_since = "busy", None
            if pool._timer is not None:
                pool._timer.cancel()
            taken = pool
            break
        else:
            taken = None
            reason = _retired_because.pop(shape, None)
            if reason and keep:
                notes.append(f"starting a fresh {backend} pool: the last one was retired ({reason})")
    _retire_all(retire)  # (outside the lock: stopping processes takes a moment)
    if taken is None:
        taken = new_pool(backend, plan, keep)  # (outside too: it opens a network namespace)
        with _lock:
            _pools.append(taken)
    _changed()
    return taken, notes


def new_pool(backend: str, plan, keep: bool):
    """A pool of local processes, or of Ray actors when the plan is placed on a Ray cluster."""
    if getattr(plan, "ray", None) is not None:
        from workbench._src.launch.ray_pool import RayPool  # (Ray is imported only then)

        return RayPool(backend, plan, keep=keep)
    return Pool(backend, plan, keep=keep)


def prestart(backend: str, plan) -> bool:
    """Starts a pool for `plan` in the background, so the first run finds its processes up
    (TensorFlow imported, the cluster formed): `%replicate --backend multi-worker` and the panel
    call it when a process backend is chosen. Nothing happens when a pool of that shape is
    live or starting, or when pools are off (`pool=False`). The pool is then an idle pool:
    its idle timer runs, another shape retires it, shutdown() ends it. Returns whether it
    started one."""
    if not getattr(plan, "pool", True):
        return False
    if getattr(plan, "ray", None) is not None:
        plan.ray.connect()  # (here: ray.init sets signal handlers, which only the main thread may)
    shape = plan.shape()
    with _lock:
        if shape in _prestarting or any(p.shape == shape for p in _pools):
            return False
        retire = [(p, "another backend was chosen") for p in _pools if p.state == "idle"]
        thread = threading.Thread(
            target=_start_in_background, args=(backend, plan), name="workbench pool start", daemon=True
        )
        _prestarting[shape] = thread
        _prestart_failed.pop(shape, None)
    _retire_all(retire, remember=False)
    thread.start()
    return True


def _start_in_background(backend: str, plan) -> None:
    shape, pool = plan.shape(), None
    try:
        pool = new_pool(backend, plan, keep=True)
        pool.start()
    except BaseException as error:  # noqa: BLE001 - said by the next run, which starts again
        _prestart_failed[shape] = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        if pool is not None:
            with contextlib.suppress(Exception):
                pool.stop()
            pool = None
    finally:
        with _lock:
            _prestarting.pop(shape, None)
            if pool is not None:
                pool.started_in_background = True
                _pools.append(pool)
                _make_idle(pool)
    _changed()


def checkin(pool: Pool, healthy: bool, reason: str = "") -> None:
    """After a run: a healthy pool that keeps goes idle (its timer starts); any other retires."""
    with _lock:
        if pool.state == "retired":
            return
        retire = not (healthy and pool.keep) or pool.state == "retiring"
        if retire:
            pool.state = "retired"
            if pool in _pools:
                _pools.remove(pool)
            if pool.keep and reason:
                _retired_because[pool.shape] = reason
        else:
            _make_idle(pool)
    if retire:
        pool.stop()
    _changed()


def _make_idle(pool: Pool) -> None:
    """(Under _lock.) The pool waits for the next run; its idle timer starts."""
    pool.state, pool.idle_since = "idle", time.time()
    if pool.idle_timeout:
        pool._timer = threading.Timer(pool.idle_timeout, _idle_expired, args=(pool, pool.idle_since))
        pool._timer.daemon = True  # never holds the interpreter at exit
        pool._timer.name = "workbench pool idle timer"
        pool._timer.start()


def shutdown(shape=None, reason: str = "shut down") -> int:
    """Ends the idle pools (of `shape`, or all); a busy one ends when its run does. Returns how
    many pools were stopped or marked."""
    _finish_background_starts(shape)  # (a pool still starting is ended too, once it is a pool)
    with _lock:
        chosen = [p for p in _pools if shape is None or p.shape == shape]
        retire = []
        for pool in chosen:
            if pool.state == "idle":
                retire.append((pool, reason))
            else:
                pool.state = "retiring"  # checkin retires it after its run
    _retire_all(retire, remember=False)
    _changed()
    return len(chosen)


def _finish_background_starts(shape=None, timeout: float = 60.0) -> None:
    with _lock:
        threads = [t for k, t in _prestarting.items() if shape is None or k == shape]
    for thread in threads:
        thread.join(timeout)


def live_pools() -> list[Pool]:
    with _lock:
        return list(_pools)


def observe(callback) -> None:
    """Calls `callback()` after any pool starts, is taken by a run, goes idle or ends (the
    JupyterLab sidebar's pool list; sinks/labcomm.py). Called from the thread that changed it."""
    with _lock:
        if callback not in _observers:
            _observers.append(callback)


def _changed() -> None:
    for callback in list(_observers):
        with contextlib.suppress(Exception):  # a closed sidebar must not break a run
            callback()


def _retire_all(retire: list[tuple[Pool, str]], remember: bool = True) -> None:
    """Retires and stops pools chosen, under the lock, because they were idle. The lock was let go
    since: a pool another thread's run has taken meanwhile (busy) or retired is left alone, or its
    run would see its processes exit under it."""
    with _lock:
        retire = [(pool, reason) for pool, reason in retire if pool.state == "idle"]
        for pool, reason in retire:
            pool.state = "retired"
            if pool in _pools:
                _pools.remove(pool)
            if remember:
                _retired_because[pool.shape] = reason
    for pool, _ in retire:
        pool.stop()
    if retire:
        _changed()


def _idle_expired(pool: Pool, since: float) -> None:
    with _lock:
        if pool.state != "idle" or pool.idle_since != since:
            return  # taken by a run meanwhile
    _retire_all([(pool, f"idle for {pool.idle_timeout:.0f} s")])


def _shape_text(pool: Pool) -> str:
    return ", ".join(f"{k}={v}" for k, v in pool.shape[1:] if v is not None)


@atexit.register
def _stop_all_at_exit() -> None:
    # Registered after processes.py's own atexit (imported above), so it runs first: the
    # processes exit on a message, cleanly, and the channel's folder goes too.
    _finish_background_starts(timeout=5.0)
    for pool in live_pools():
        with contextlib.suppress(Exception):
            pool.stop()
