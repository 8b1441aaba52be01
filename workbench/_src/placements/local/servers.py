"""The local TensorFlow servers of an async-ps run: parameter servers and workers.

Started by the async-ps coordinator process (never by the notebook) as its own children, in its
private network: `python -m workbench._src.placements.local.server_main`, one per task of the cluster
spec. The coordinator watches them once per chunk: a dead parameter server ends the run, a dead
worker is reported once and the run goes on with the others.
"""

from __future__ import annotations

import json
import time

from workbench._src.core.errors import WorkerError
from workbench._src.placements.local.processes import ProcessGroup, free_ports, port_open

SERVER_MODULE = "workbench._src.placements.local.server_main"


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
        while pending:
            dead = self.group.unexpected_exits()
            if dead:
                c = dead[0]
                raise WorkerError(
                    f"async-ps {c.label} {c.exit_description()} while starting.\n{c.log_tail()}",
                    task=f"{c.role} {c.index}",
                )
            if time.monotonic() - started > startup_timeout:
                names = ", ".join(f"{r} {i}" for r, i in pending)
                raise WorkerError(
                    f"async-ps servers {names} did not start within startup_timeout="
                    f"{startup_timeout:.0f} s. Fix: a busy machine needs a longer startup_timeout.",
                    task=names,
                )
            pending = {k: p for k, p in pending.items() if not port_open(p)}
            time.sleep(0.1)

    @property
    def processes(self) -> list[dict]:
        return [{"role": c.role, "index": c.index, "pid": c.pid} for c in self.group.children]

    def live_workers(self) -> int:
        return len([c for c in self.group.children if c.role == "worker" and c.popen.poll() is None])

    def check(self, run=None) -> None:
        """Raises for a dead parameter server, or when no worker is left; reports dead workers
        once (the run goes on with the others)."""
        for child in self.group.unexpected_exits():
            child.expected_exit = True  # reported once
            if child.role == "ps":
                raise WorkerError(
                    f"parameter server {child.index} (pid {child.pid}) {child.exit_description()}: the "
                    "variables it held are gone, so asynchronous training cannot go on.",
                    task=f"ps {child.index}",
                )
            if run is not None:
                alive = self.live_workers()
                run.publish(
                    "message",
                    text=f"worker {child.index} (pid {child.pid}) {child.exit_description()} at step "
                    f"{run.steps}; {alive} worker(s) left"
                    + (": the coordinator runs its unfinished steps on them" if alive else ""),
                    worker_lost=child.index,
                )
        if self.live_workers() == 0:
            raise WorkerError(
                f"every async-ps worker has died (all {self.num_workers}); training cannot go on.",
                task="worker",
            )

    def stop(self) -> None:
        self.group.stop(grace=1.0)
