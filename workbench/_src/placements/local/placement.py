"""The local placement: a pool's members as processes of this machine (launch/placement.py).

Every member is `python -m workbench._src.placements.local.worker_main` (forked by the fork
server where it can be), in one private loopback-only network namespace (netns.py), connected
back over an authenticated Unix socket (channel.py).
"""

from __future__ import annotations

import contextlib
import subprocess
import time

from workbench._src.placements.local.channel import Channel
from workbench._src.placements.local.processes import ProcessGroup
from workbench._src.placements.proc import pid_alive

WORKER_MODULE = "workbench._src.placements.local.worker_main"
# After "shutdown", how long a dead member's exit status is waited for, so the line naming it
# says how it ended: a status is there within milliseconds unless the machine is starved.
EXIT_STATUS_WAIT = 2.0
# After the grace for leaving on "shutdown", SIGTERM, then SIGKILL this much later: MWMS ignores
# SIGTERM, so this is how long a member that does not may linger.
KILL_GRACE = 1.0


class LocalPlacement:
    """The members of one launch plan as local processes (a `Placement`)."""

    exit_grace = 2.0  # at exit as at any stop: local members leave in milliseconds

    def __init__(self, backend: str, plan):
        self.tasks = plan.tasks()  # fixed for the pool's life: ports, TF_CONFIG
        self.group = ProcessGroup(backend)
        self.channel = Channel(self.group)

    def start(self) -> None:
        """Starts every process at once (none waits for another; each connects back on its own)."""
        for task in self.tasks:
            self.group.start(task.role, task.index, WORKER_MODULE, {**self.channel.env(), **task.env})

    def processes(self, extra: list[dict]) -> list[dict]:
        own = [{"role": c.role, "index": c.index, "pid": c.pid} for c in self.group.children]
        return own + list(extra)

    def dead_member(self, extra: list[dict]) -> str:
        for child in self.group.children:
            # (poll() alone is not enough: a child reaped elsewhere, e.g. by a subreaper's
            # waitpid(-1), reads None for ever; /proc says it is gone)
            if child.popen.poll() is not None or not pid_alive(child.pid):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    # (poll() reads None while another thread waits on it: this waits for the
                    # status, so the line says how it ended, not "still running")
                    child.popen.wait(timeout=EXIT_STATUS_WAIT)
                return f"{child.role} {child.index} (pid {child.pid}) {child.exit_description()}"
        for p in extra:
            if not pid_alive(p["pid"]):
                return f"{p['role']} {p['index']} (pid {p['pid']}) exited"
        return ""

    def stop(self, grace: float) -> None:
        """Asks every process to exit, then stops whatever is left; removes every file."""
        self.channel.broadcast({"type": "shutdown"})
        deadline = time.monotonic() + grace  # a clean exit removes its own temp folder and servers
        while self.group.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        for child in self.group.children:
            child.expected_exit = True
        self.group.stop(grace=KILL_GRACE)
        self.channel.close()

    def where(self) -> str | None:
        return None
