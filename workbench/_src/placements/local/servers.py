"""The local TensorFlow servers of an async-ps run: parameter servers and workers.

Started by the async-ps coordinator process (never by the notebook) as its own children, in its
private network: `python -m workbench._src.placements.local.server_main`, one per task of the cluster
spec. The coordinator watches them once per chunk: a dead parameter server ends the run; a dead
worker is reported once, the run goes on with the others, and a new server is started at the
dead one's address. TensorFlow's ClusterCoordinator waits for a lost worker to come back at its
address (cluster_coordinator.WorkerPreemptionHandler: `update_server_def` once it answers), then
rebuilds that worker's iterators and schedules on it again, so the replacement needs nothing from
the run: it rejoins as the worker it replaces.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from dataclasses import dataclass

from workbench._src.core.errors import WorkerError
from workbench._src.launch.start_progress import StartDeadline
from workbench._src.placements.local.processes import ProcessGroup, port_open
from workbench._src.placements.ports import free_ports

SERVER_MODULE = "workbench._src.placements.local.server_main"
# A worker that keeps dying (a crash in an op it runs, the machine's memory) is not replaced more
# than this many times in one run: past it the run goes on without it, and says so.
REPLACEMENTS_PER_WORKER = 3


@dataclass
class Replacement:
    """A worker server started in place of a lost one, from its loss until it answers."""

    index: int
    lost_pid: int
    cause: str  # how the lost one ended ("killed by SIGKILL")
    lost_step: int  # the run's step when the loss was seen
    lost_at: float  # time.monotonic() then
    child: object  # processes.Child of the new server
    seconds: float | None = None  # from the loss to the new server answering


class LocalServers:
    """num_ps parameter servers and num_workers worker servers on 127.0.0.1, plus the chief's
    address (the coordinator, this process) in `cluster`."""

    def __init__(self, num_workers: int, num_ps: int, *, threads: int | None, startup_timeout: float):
        self.num_workers = num_workers
        ports = free_ports(num_workers + num_ps + 1)
        self.cluster = {
            "worker": [f"127.0.0.1:{p}" for p in ports[:num_workers]],
            "ps": [f"127.0.0.1:{p}" for p in ports[num_workers:-1]],
            "chief": [f"127.0.0.1:{ports[-1]}"],  # this process, the coordinator
        }
        self.group = ProcessGroup("async-ps", stop_at_exit=False)  # they exit when this process ends
        env = {"WORKBENCH_CLUSTER": json.dumps(self.cluster), "CUDA_VISIBLE_DEVICES": ""}
        if threads:
            env["WORKBENCH_WORKER_THREADS"] = str(threads)
        self.env = env  # (a replacement server starts with the same)
        self.replacing: dict[int, Replacement] = {}  # worker index -> its replacement, until it answers
        self._replaced: dict[int, int] = {}  # worker index -> replacements made in the current run
        self._run_id = None  # the run those counts are for
        self.started = time.monotonic()
        self.startup_timeout = startup_timeout
        self.startup_seconds: float | None = None  # until listening
        try:
            for role in ("ps", "worker"):
                for i in range(len(self.cluster[role])):
                    self.group.start(role, i, SERVER_MODULE, env)
        except BaseException:
            self.group.stop()
            raise

    def wait_until_listening(self) -> None:
        """Returns once every server listens (at once the second time); stops them all and
        raises when one dies or the startup timeout passes."""
        if self.startup_seconds is not None:
            return
        try:
            self._wait_until_listening(self.started, self.startup_timeout)
        except BaseException:
            self.group.stop()
            raise
        self.startup_seconds = time.monotonic() - self.started

    def _wait_until_listening(self, started: float, startup_timeout: float) -> None:
        pending = {
            (c.role, c.index): int(self.cluster[c.role][c.index].rsplit(":", 1)[1])
            for c in self.group.children
        }
        # (Past startup_timeout, servers still starting on a busy machine are given longer.)
        deadline = StartDeadline(startup_timeout, started=started)
        while pending:
            dead = self.group.unexpected_exits()
            if dead:
                c = dead[0]
                raise WorkerError(
                    f"async-ps {c.label} {c.exit_description()} while starting.\n{c.log_tail()}",
                    task=f"{c.role} {c.index}",
                )
            now = time.monotonic()
            starting = [c for c in self.group.children if (c.role, c.index) in pending]
            if deadline.passed(now, starting):
                names = ", ".join(f"{r} {i}" for r, i in pending)
                raise WorkerError(
                    f"async-ps servers {names} did not start within {deadline.describe(now)}. "
                    "Fix: a busy machine needs a longer startup_timeout.",
                    task=names,
                )
            pending = {k: p for k, p in pending.items() if not port_open(p)}
            time.sleep(0.1)

    @property
    def processes(self) -> list[dict]:
        return [{"role": c.role, "index": c.index, "pid": c.pid} for c in self.group.children]

    def live_workers(self) -> int:
        """Worker servers alive and answering (a replacement counts once it answers)."""
        starting = {r.child.pid for r in self.replacing.values()}
        return len(
            [
                c
                for c in self.group.children
                if c.role == "worker" and c.popen.poll() is None and c.pid not in starting
            ]
        )

    def check(self, run=None) -> list[Replacement]:
        """Raises for a dead parameter server, or when no worker is left nor coming; reports dead
        workers once and starts their replacements (the run goes on with the others). Returns the
        replacements that answered since the last call (each once)."""
        if run is not None and run.id != self._run_id:
            self._run_id, self._replaced = run.id, {}
        for child in self.group.unexpected_exits():
            child.expected_exit = True  # reported once
            if child.role == "ps":
                raise WorkerError(
                    f"parameter server {child.index} (pid {child.pid}) {child.exit_description()}: the "
                    "variables it held are gone, so asynchronous training cannot go on.",
                    task=f"ps {child.index}",
                )
            self._worker_lost(child, run)
        answered = self._replacements_answered(run)
        if self.live_workers() == 0 and not self.replacing:
            raise WorkerError(
                f"every async-ps worker has died (all {self.num_workers}) and none could be replaced; "
                "training cannot go on. Fix: look for what ends the worker processes (their memory, "
                "an op that crashes) and run again, from the last checkpoint if you saved one.",
                task="worker",
            )
        return answered

    def _worker_lost(self, child, run) -> None:
        index, step = child.index, (run.steps if run is not None else 0)
        self.replacing.pop(index, None)  # (a replacement that died before it answered: lost too)
        made = self._replaced.get(index, 0)
        replace = made < REPLACEMENTS_PER_WORKER
        if replace:
            self._replaced[index] = made + 1
            new = self.group.start("worker", index, SERVER_MODULE, self.env)
            self.replacing[index] = Replacement(
                index, child.pid, child.exit_description(), step, time.monotonic(), new
            )
        if run is None:
            return
        alive = self.live_workers()
        address = self.cluster["worker"][index]
        # Its log's end says why it ended: printed when it exited by itself (not by a signal),
        # and when it keeps dying.
        tail = child.log_tail(3) or "empty"
        why = "" if child.killed else f" (its log's end: {tail})"
        then = (
            f"a new worker {index} starts at {address}"
            if replace
            else f"it is not replaced again: lost {made + 1} times in this run, something ends it"
            + (f" (its log's end: {tail})" if child.killed else "")
        )
        run.publish(
            "message",
            text=f"worker {index} (pid {child.pid}) {child.exit_description()}{why} at step {step}; {alive} "
            f"worker(s) left"
            + (": the coordinator runs its unfinished steps on them" if alive else "")
            + f"; {then}",
            worker_lost=index,
        )

    def _replacements_answered(self, run) -> list[Replacement]:
        """The replacements listening now; one not listening within startup_timeout is stopped."""
        answered = []
        for index, replacement in list(self.replacing.items()):
            new = replacement.child
            if new.popen.poll() is not None:
                continue  # (unexpected_exits reports it as a loss of its own)
            port = int(self.cluster["worker"][index].rsplit(":", 1)[1])
            if self.group.port_open(port):
                replacement.seconds = time.monotonic() - replacement.lost_at
                del self.replacing[index]
                answered.append(replacement)
            elif time.monotonic() - replacement.lost_at > self.startup_timeout:
                del self.replacing[index]
                new.expected_exit = True
                _end(new)
                if run is not None:
                    run.publish(
                        "message",
                        text=f"the new worker {index} (pid {new.pid}) did not answer within startup_timeout="
                        f"{self.startup_timeout:.0f} s: stopped; the run goes on with {self.live_workers()} "
                        "worker(s)",
                    )
        return answered

    def stop(self) -> None:
        self.group.stop(grace=1.0)


def _end(child) -> None:
    """Stops one server that never answered (SIGKILL: it serves nothing yet) and reaps it."""
    child.send_signal(signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.popen.wait(timeout=5)
