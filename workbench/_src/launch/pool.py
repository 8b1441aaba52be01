"""Warm pools: the processes of a process backend stay up between runs of the same shape.

A run on worker processes pays 10-40 s of start-up (spawn, import TensorFlow, start the servers,
form the cluster). A Pool is those processes, kept after a run that ended cleanly: the next run
of the same shape (backend and the plan fields that define the processes, `LaunchPlan.shape()`)
sends its work to them and starts in about a second; each process frees what the previous run
left (backends/remote.py `ProcessBackend.release_run_state`).

The rules, all here, the same for every placement (launch/placement.py):
  - one *idle* pool per interpreter: a run of another shape retires it (the machine's memory
    is the limit, and a notebook trains one thing at a time); busy pools are never touched;
  - a run that failed, timed out or lost a process retires its pool (the cluster is in doubt:
    a worker that saw a collective fail cannot run collectives again); so does a pool found
    with a dead member when the next run takes it; the next run says so in one line;
  - a pool whose processes have grown by more than its plan's `memory_growth_limit` since its
    first runs is renewed after a run (launch/memory.py: TensorFlow keeps some state of every
    run's traced step for a process's life). Its successor starts in the background once it
    has been left unused for RENEW_AFTER_IDLE, so a notebook's next run finds it up; a run
    that comes sooner starts it itself, and a script that ends first starts none;
  - a pool ends with `shutdown()` (repl.shutdown(), the panel's button, the session's
    replicator replaced), after `idle_timeout` seconds unused (a daemon timer: it never holds
    the interpreter), at interpreter exit (launch/exit.py), and when this process is killed
    (each local member exits on EOF of its stdin pipe; Ray ends the actors of a dead driver).

The kernel's pools are one object, `POOLS` (a `Pools`); the module's functions are its methods.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time

from workbench._src.core import exit as process_exit
from workbench._src.launch.memory import MEMORY_GROWTH_LIMIT, MemoryGrowth
from workbench._src.launch.placement import place

# How long a pool's members get to leave on "shutdown" before they are ended by force. It bounds
# a shutdown's wait (the panel's button, a shape change); a clean exit removes the member's own
# temp folder and servers, so it should cover one member's exit on a busy machine.
STOP_GRACE = 2.0
# How long interpreter exit waits for a pool still starting in the background: long enough for
# a start that is almost done to become a pool (then it is stopped), short enough for a restart.
EXIT_START_WAIT = 5.0
# How long a pool renewed for its memory waits unused before its successor starts in the
# background. Longer than a loop or a script takes to its next call (a loop's next run starts the
# successor itself, in the foreground; a script that ends starts nothing it will not use),
# shorter than a researcher takes to read a run's result and run the next cell.
RENEW_AFTER_IDLE = 1.0


class Pool:
    """The processes of one launch plan (a Placement), started once and reused while healthy,
    with the bookkeeping the rules read: shape, state, runs, idle time."""

    def __init__(self, backend: str, plan, keep: bool = True):
        self.backend = backend
        self.shape = plan.shape()
        self.keep = keep  # False: one pool per run (pool=False)
        self.idle_timeout = plan.idle_timeout
        self.extra: list[dict] = []  # processes a member started itself (async-ps servers)
        self.lost = ""  # a member a run found unreachable (a node cut off before Ray says so)
        self.runs = 0  # runs started on this pool
        self.state = "busy"  # busy | idle | retiring | retired
        self.idle_since: float | None = None
        self.started_at = time.time()
        self.started_in_background = False  # prestart(): before any run asked for it
        self.timer: threading.Timer | None = None
        self.placement = place(backend, plan)  # local processes, or where plan.cluster says
        # Every process the pool will run, those a member starts itself included (async-ps: the
        # coordinator's servers), as the CLI counts them.
        self.process_count = sum(role.count for role in plan.roles())
        self.memory = MemoryGrowth()  # its processes' sizes (launch/memory.py)
        self.plan = plan  # (a renewal's successor is started from it; its memory_growth_limit)

    # ----- what the launcher uses (the placement's, one name down) -------------------------------
    @property
    def tasks(self):
        return self.placement.tasks

    @property
    def group(self):
        return self.placement.group

    @property
    def channel(self):
        return self.placement.channel

    @property
    def fresh(self) -> bool:
        return self.runs == 0

    def start(self) -> None:
        self.placement.start()

    @property
    def processes(self) -> list[dict]:
        """Role, index and pid of every process of the pool (a coordinator's servers included)."""
        return self.placement.processes(self.extra)

    def dead_member(self) -> str:
        return self.placement.dead_member(self.extra) or self.lost

    def send_work(self, payload: bytes, number: int) -> None:
        """Hands the next run's work to every (already connected) member of a warm pool."""
        for member in self.group.children:
            member.expected_exit = False  # it was set by the last run's results
        for task in self.tasks:
            self.channel.send(task.name, {"type": "work", "payload": payload, "run": number})

    def drain(self) -> str:
        """Reads what the members said while idle (heartbeats); returns a problem, if any."""
        problem = ""
        while True:
            try:
                task, message = self.channel.messages.get_nowait()
            except queue.Empty:
                return self.dead_member() or problem  # (how it ended says more than a closed socket)
            if message.get("type") in ("disconnected", "error"):
                problem = problem or f"{task.replace(':', ' ')} disconnected"

    def memory_growth(self) -> str:
        """'' while every process has grown by at most its plan's memory_growth_limit (after a run)."""
        limit = getattr(self.plan, "memory_growth_limit", MEMORY_GROWTH_LIMIT)
        return self.memory.after_run(self.processes, self.runs, limit)

    def stop(self, grace: float = STOP_GRACE) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.placement.stop(grace)

    def describe(self) -> dict:
        """For the panel and the sidebar: backend, shape, processes, state and idle seconds."""
        idle = time.time() - self.idle_since if self.state == "idle" and self.idle_since else 0.0
        processes = self.processes
        servers = [p for p in self.extra if p["role"] == "worker"]  # async-ps: its worker servers
        workers = len(servers) or len([p for p in processes if p["role"] == "worker"])
        described = {
            "backend": self.backend,
            "workers": workers,
            "processes": len(processes),
            "state": self.state,
            "runs": self.runs,
            "idle_seconds": idle,
            "idle_since": self.idle_since if self.state == "idle" else None,
            "idle_timeout": self.idle_timeout,
        }
        where = self.placement.where()
        if where:
            described["placement"] = where
        return described


class Pools:
    """The kernel's warm pools and the rules between them (one per interpreter: `POOLS`)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pools: list[Pool] = []  # live pools, busy or idle
        self.retired_because: dict = {}  # shape -> why its last pool was retired (said by the next run)
        self.observers: list = []  # called with no argument after any pool changes state (the sidebar)
        self.prestarting: dict = {}  # shape -> the thread starting a pool of that shape in the background
        self.prestart_failed: dict = {}  # shape -> why its background start failed (said by the next run)
        self.renewals: dict = {}  # shape -> the timer that starts a renewed pool's successor

    def checkout(self, backend: str, plan) -> tuple[Pool, list[str]]:
        """A pool for one run of `plan`: the idle one of the same shape when it is healthy, else a
        new one (not yet started). Returns it, marked busy, and the lines to say in the run."""
        notes: list[str] = []
        retire: list[tuple[Pool, str]] = []
        keep = bool(getattr(plan, "pool", True))
        shape = plan.shape()
        with self.lock:
            self._cancel_renewals()  # (this run starts what it needs; another shape's would be retired)
            starting = self.prestarting.get(shape)
        if starting is not None:  # chosen a moment ago: its processes are already on their way
            starting.join(timeout=plan.launch_timeout)
        with self.lock:
            failed = self.prestart_failed.pop(shape, None)
            if failed:
                notes.append(
                    f"the {backend} pool's start in the background failed ({failed}): starting again"
                )
            for pool in [p for p in self.pools if p.state == "idle"]:
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
                    notes.append(
                        f"the warm {pool.backend} pool lost {problem} while idle: starting a fresh one"
                    )
                    continue
                pool.state, pool.idle_since = "busy", None
                if pool.timer is not None:
                    pool.timer.cancel()
                reason = self.retired_because.pop(shape, None)
                if reason and pool.runs == 0:  # (a successor started in the background)
                    notes.append(
                        f"running on a fresh {backend} pool, started in the background: the last one "
                        f"was retired ({reason})"
                    )
                taken = pool
                break
            else:
                taken = None
                reason = self.retired_because.pop(shape, None)
                if reason and keep:
                    notes.append(f"starting a fresh {backend} pool: the last one was retired ({reason})")
        self.retire_all(retire)  # (outside the lock: stopping processes takes a moment)
        if taken is None:
            taken = Pool(backend, plan, keep)  # (outside too: it opens a network namespace)
            with self.lock:
                self.pools.append(taken)
        self.changed()
        return taken, notes

    def prestart(self, backend: str, plan, renewal: threading.Timer | None = None) -> bool:
        """Starts a pool for `plan` in the background, so the first run finds its processes up
        (TensorFlow imported, the cluster formed): `%replicate --backend multi-worker` and the
        panel call it when a process backend is chosen. Nothing happens when a pool of that shape
        is live or starting, or when pools are off (`pool=False`). The pool is then an idle pool:
        its idle timer runs, another shape retires it, shutdown() ends it. Returns whether it
        started one. `renewal`: the timer of a renewed pool's successor calls it, and nothing
        starts if a run, a shutdown or the exit came first."""
        if not getattr(plan, "pool", True):
            return False
        plan.before_placement()  # (here: Ray's connection sets signal handlers, main thread only)
        shape = plan.shape()
        with self.lock:
            if renewal is not None and self.renewals.pop(shape, None) is not renewal:
                return False
            self._cancel_renewals()  # (a backend chosen now comes first; its start retires the rest)
            if shape in self.prestarting or any(p.shape == shape for p in self.pools):
                return False
            retire = [(p, "another backend was chosen") for p in self.pools if p.state == "idle"]
            thread = threading.Thread(
                target=self._start_in_background,
                args=(backend, plan),
                name="workbench pool start",
                daemon=True,
            )
            self.prestarting[shape] = thread
            self.prestart_failed.pop(shape, None)
        self.retire_all(retire, remember=False)
        thread.start()
        return True

    def _start_in_background(self, backend: str, plan) -> None:
        shape, pool = plan.shape(), None
        try:
            pool = Pool(backend, plan, keep=True)
            pool.start()
        except BaseException as error:  # noqa: BLE001 - said by the next run, which starts again
            self.prestart_failed[shape] = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
            if pool is not None:
                with contextlib.suppress(Exception):
                    pool.stop()
                pool = None
        finally:
            with self.lock:
                self.prestarting.pop(shape, None)
                if pool is not None:
                    pool.started_in_background = True
                    self.pools.append(pool)
                    self._make_idle(pool)
        self.changed()

    def checkin(self, pool: Pool, healthy: bool, reason: str = "") -> None:
        """After a run: a healthy pool that keeps goes idle (its timer starts); any other retires,
        as does one whose processes have outgrown its memory_growth_limit since its first runs
        (renewed: its successor starts when it is left unused, `_renew_when_idle`)."""
        grown = pool.memory_growth() if healthy and pool.keep else ""
        if grown:
            healthy, reason = False, grown
        with self.lock:
            if pool.state == "retired":
                return
            retire = not (healthy and pool.keep) or pool.state == "retiring"
            if retire:
                pool.state = "retired"
                if pool in self.pools:
                    self.pools.remove(pool)
                if pool.keep and reason:
                    self.retired_because[pool.shape] = reason
            else:
                self._make_idle(pool)
        if retire:
            pool.stop()
            if grown:
                self._renew_when_idle(pool)
        self.changed()

    def _renew_when_idle(self, pool: Pool) -> None:
        """A pool renewed for its memory: its successor starts in the background once no run has
        come for RENEW_AFTER_IDLE (a run that comes sooner starts its own pool)."""
        timer = threading.Timer(RENEW_AFTER_IDLE, lambda: self.prestart(pool.backend, pool.plan, timer))
        timer.daemon = True  # never holds the interpreter at exit
        timer.name = "workbench pool renewal"
        with self.lock:
            self._cancel_renewals()
            self.renewals[pool.shape] = timer
        timer.start()

    def _cancel_renewals(self, shape=None) -> None:
        """(Under the lock.) Successors not started yet are not started (of `shape`, or all)."""
        for key in [k for k in self.renewals if shape is None or k == shape]:
            self.renewals.pop(key).cancel()

    def _make_idle(self, pool: Pool) -> None:
        """(Under the lock.) The pool waits for the next run; its idle timer starts."""
        pool.state, pool.idle_since = "idle", time.time()
        if pool.idle_timeout:
            pool.timer = threading.Timer(pool.idle_timeout, self._idle_expired, args=(pool, pool.idle_since))
            pool.timer.daemon = True  # never holds the interpreter at exit
            pool.timer.name = "workbench pool idle timer"
            pool.timer.start()

    def _idle_expired(self, pool: Pool, since: float) -> None:
        with self.lock:
            if pool.state != "idle" or pool.idle_since != since:
                return  # taken by a run meanwhile
        self.retire_all([(pool, f"idle for {pool.idle_timeout:.0f} s")])

    def shutdown(self, shape=None, reason: str = "shut down") -> int:
        """Ends the idle pools (of `shape`, or all); a busy one ends when its run does. Returns
        how many pools were stopped or marked."""
        with self.lock:
            self._cancel_renewals(shape)
        self.finish_background_starts(shape)  # (a pool still starting is ended too, once it is one)
        with self.lock:
            chosen = [p for p in self.pools if shape is None or p.shape == shape]
            retire = []
            for pool in chosen:
                if pool.state == "idle":
                    retire.append((pool, reason))
                else:
                    pool.state = "retiring"  # checkin retires it after its run
        self.retire_all(retire, remember=False)
        self.changed()
        return len(chosen)

    def finish_background_starts(self, shape=None, timeout: float = 60.0) -> None:
        with self.lock:
            threads = [t for k, t in self.prestarting.items() if shape is None or k == shape]
        for thread in threads:
            thread.join(timeout)

    def live(self) -> list[Pool]:
        with self.lock:
            return list(self.pools)

    def observe(self, callback) -> None:
        """Calls `callback()` after any pool starts, is taken by a run, goes idle or ends (the
        JupyterLab sidebar's pool list). Called from the thread that changed it."""
        with self.lock:
            if callback not in self.observers:
                self.observers.append(callback)

    def changed(self) -> None:
        for callback in list(self.observers):
            with contextlib.suppress(Exception):  # a closed sidebar must not break a run
                callback()

    def retire_all(self, retire: list[tuple[Pool, str]], remember: bool = True) -> None:
        """Retires and stops pools chosen, under the lock, because they were idle. The lock was
        let go since: a pool another thread's run has taken meanwhile (busy) or retired is left
        alone, or its run would see its processes exit under it."""
        with self.lock:
            retire = [(pool, reason) for pool, reason in retire if pool.state == "idle"]
            for pool, reason in retire:
                pool.state = "retired"
                if pool in self.pools:
                    self.pools.remove(pool)
                if remember:
                    self.retired_because[pool.shape] = reason
        for pool, _ in retire:
            pool.stop()
        if retire:
            self.changed()

    def stop_all_at_exit(self) -> None:
        """Interpreter exit (launch/exit.py, first stage): every pool, busy or idle, is asked to
        leave and then ended, while Ray (for a Ray placement) is still connected."""
        with self.lock:
            self._cancel_renewals()
        self.finish_background_starts(timeout=EXIT_START_WAIT)
        for pool in self.live():
            with contextlib.suppress(Exception):
                pool.stop(grace=pool.placement.exit_grace)


def _shape_text(pool: Pool) -> str:
    return ", ".join(f"{k}={v}" for k, v in pool.shape[1:] if v is not None)


POOLS = Pools()
process_exit.on_exit("pools", POOLS.stop_all_at_exit)

checkout = POOLS.checkout
checkin = POOLS.checkin
prestart = POOLS.prestart
shutdown = POOLS.shutdown
live_pools = POOLS.live
observe = POOLS.observe
_retire_all = POOLS.retire_all  # (tests/test_pools.py decides a retirement by hand)

