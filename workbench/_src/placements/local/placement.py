"""The local placement: a pool's members as processes of this machine (launch/placement.py).

Every member is `python -m workbench._src.placements.local.worker_main` (forked by the fork
server where it can be), in one private loopback-only network namespace (netns.py), connected
back over an authenticated Unix socket (channel.py). The plan's members get free loopback ports
(free in the private network too, which holds nothing else), and the plan's `member_env` makes
each one's TF_CONFIG from them. Members a role `started_by` another are that member's children
(async-ps's servers: worker_main offers it placements/local/servers.py), not placed here.
"""

from __future__ import annotations

import contextlib
import subprocess
import time

from workbench._src.core.errors import ConfigurationError
from workbench._src.core.owned_folders import pid_alive
from workbench._src.core.tf_setup import physical_gpu_count
from workbench._src.launch.placement import Role, Task
from workbench._src.placements.local.channel import Channel
from workbench._src.placements.local.processes import ProcessGroup
from workbench._src.placements.ports import free_ports

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
        roles = [role for role in plan.roles() if role.started_by is None]
        ports = iter(free_ports(sum(role.count for role in roles)))
        addresses = {role.name: [f"127.0.0.1:{next(ports)}" for _ in range(role.count)] for role in roles}
        # Fixed for the pool's life: ports, TF_CONFIG. (Every member placed here runs work: a
        # role that only serves TensorFlow is started by its coordinator on one host.)
        self.tasks = [
            Task(role.name, i, {**_device_env(role, i), **plan.member_env(role.name, i, addresses)})
            for role in roles
            for i in range(role.count)
        ]
        self.group = ProcessGroup(backend)
        self.channel = Channel(self.group)

    # ----- for a `cluster=` value, before any pool (launch/placement.py Placement) -------------
    @staticmethod
    def prepare(cluster) -> None:
        """Nothing to connect to: local processes are placed from any thread."""

    @staticmethod
    def room_for(cluster, count: int, busy_nodes: set[str]) -> bool:
        return True  # (processes of this machine always fit: its memory is the pool rules' limit)

    @staticmethod
    def describe(cluster) -> str | None:
        return None

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


def _device_env(role: Role, index: int) -> dict:
    """Which of this machine's GPUs member `role:index` sees: `role.gpus` of them, split by
    index; none for a CPU-only role or a machine without GPUs (one CPU device each)."""
    if not role.gpus:
        return {"CUDA_VISIBLE_DEVICES": ""}
    gpus = physical_gpu_count()  # (no TensorFlow import in the launcher on a machine without)
    if gpus:
        if gpus < role.count * role.gpus:
            raise ConfigurationError(
                f"{role.count} {role.name}s x {role.gpus} GPU(s) need {role.count * role.gpus} GPUs; "
                f"this machine has {gpus}. Fix: fewer {role.name}s or fewer devices per {role.name}."
            )
        first = index * role.gpus
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(first + j) for j in range(role.gpus))}
    if role.gpus != 1:
        raise ConfigurationError(
            f"{role.gpus} devices per {role.name} need GPUs, and this machine has none: without them "
            f"each {role.name} runs one CPU replica. Fix: one device per {role.name} "
            f"(devices_per_worker=1) and more {role.name}s."
        )
    return {"CUDA_VISIBLE_DEVICES": ""}
