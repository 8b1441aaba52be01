"""The seam of the process layer: where a pool's processes run.

A `Placement` starts the processes of one launch plan somewhere (placements/local: local
processes in a private loopback-only network; placements/ray: Ray actors in a placement group)
and hands out what the launcher above it needs: the members (`Member`, grouped in `Members`) and
the link to them (`Link`). Everything above the seam is written once against these protocols:
the pool's rules (launch/pool.py), shipping the work, relaying events into the notebook's Run,
fault reports and stop (launch/watch.py). Nothing above it imports a placement; the backend's
plan picks one from what `cluster=` names (backends/remote.py `LaunchPlan.placement`).

Messages on a link are dicts with a "type": the launcher sends "work", "stop" and "shutdown";
a member says "hello", "heartbeat", "ready", "processes", "event", "result" and "error", and the
link itself adds "disconnected" when a member can no longer be heard.
"""

from __future__ import annotations

import dataclasses
import queue
from typing import Protocol, runtime_checkable


@dataclasses.dataclass
class Task:
    """One process of a launch that runs work: `role:index` names it; env is added to its
    environment (TF_CONFIG, the backend's options)."""

    role: str
    index: int
    env: dict

    @property
    def name(self) -> str:
        return f"{self.role}:{self.index}"


@runtime_checkable
class Member(Protocol):
    """One process of a pool, as the launcher sees it (placements/local: `processes.Child`;
    placements/ray: `RayMember`)."""

    role: str
    index: int
    expected_exit: bool  # its work is delivered (or it was told to go): its exit is no fault

    @property
    def pid(self) -> int: ...

    @property
    def where(self) -> str:
        """Where it runs, for messages ("pid 123", "pid 123 on node 10.0.0.2")."""
        ...

    @property
    def killed(self) -> bool:
        """It ended by a signal or its actor died (the likely culprit when several ended)."""
        ...

    def exit_description(self) -> str:
        """How it ended ("killed by SIGKILL"), or "still running"."""
        ...

    def log_tail(self, lines: int = 15) -> str:
        """The end of its log ("" where the log is not readable from here)."""
        ...

    def cpu_seconds(self) -> float | None:
        """The CPU time it has used; None where it cannot be read (another node): then only
        its heartbeats tell a busy member from a frozen one."""
        ...

    def cpu_wait(self) -> tuple[float, bool] | None:
        """How it waits for a CPU (a busy machine starving it): (seconds its threads waited,
        runnable; whether one is runnable now). None where it cannot be read: then a starved
        member is told from a frozen one by its CPU time alone."""
        ...


@runtime_checkable
class Members(Protocol):
    """The members of one placement (placements/local: `ProcessGroup`; placements/ray:
    `RayMembers`)."""

    children: list  # [Member]

    def unexpected_exits(self) -> list:
        """The members that ended without being told to, and whose end ends the run."""
        ...


@runtime_checkable
class Link(Protocol):
    """The launcher's side of the messages to and from the members that run work
    (placements/local: `channel.Channel`, a Unix socket; placements/ray: `RayChannel`, actor
    calls)."""

    messages: queue.Queue  # (task name, message dict), in the order each member said them

    def send(self, task: str, message: dict) -> bool:
        """Sends to one member; False when it cannot be reached (its end is reported anyway)."""
        ...

    def broadcast(self, message: dict) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class Placement(Protocol):
    """The processes of one launch plan, placed somewhere; a pool (launch/pool.py) holds one
    for as long as it is warm.

    Lifecycle: constructed (the resources are reserved: a network namespace, a placement group
    and its actors), `start()` once (each member connects back on its own and says hello), then
    any number of runs over `channel`, then `stop()`, which leaves nothing behind on any host.
    """

    tasks: list[Task]  # the members that run work, the chief first
    group: Members
    channel: Link
    exit_grace: float  # the `grace` its stop gets at interpreter exit (which must not linger)

    def start(self) -> None:
        """Starts every member at once (none waits for another)."""
        ...

    def processes(self, extra: list[dict]) -> list[dict]:
        """Role, index and pid (and node, where there are several) of every process, with
        `extra`: what a member started itself (async-ps's local servers)."""
        ...

    def dead_member(self, extra: list[dict]) -> str:
        """'' while every member (and `extra` process) is alive, else which one is not and how
        it ended."""
        ...

    def stop(self, grace: float) -> None:
        """Asks every member to leave, waits up to `grace` s, then ends whatever is left."""
        ...

    def where(self) -> str | None:
        """For the panel: where the members run ("Ray (pack): 10.0.0.1"); None for this machine."""
        ...
