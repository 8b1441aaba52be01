"""The seam of the process layer: where a pool's processes run.

A `Placement` starts the processes of one launch plan somewhere (placements/local: local
processes in a private loopback-only network; placements/ray: Ray actors in a placement group)
and hands out what the launcher above it needs: the members (`Member`, grouped in `Members`) and
the link to them (`Link`). Everything above the seam is written once against these protocols:
the pool's rules (launch/pool.py), shipping the work, relaying events into the notebook's Run,
fault reports and stop (launch/watch.py).

A backend's plan says *what* runs, never where (`MemberPlan`, as Ray Train's TensorFlow backend
does): the members it needs (`Role`s: workers; a coordinator and parameter servers) and one
function that builds each member's environment (TF_CONFIG, the backend's options) from the
members' addresses. A placement obtains the addresses its own way (free loopback ports in the
pool's private network; each actor's node address and a port it reserved) and calls it.

Which placement a plan gets is chosen here, from what `cluster=` names (`PLACEMENTS`): nothing
above the seam and no backend imports one.

Messages on a link are dicts with a "type": the launcher sends "work", "stop" and "shutdown";
a member says "hello", "heartbeat", "ready", "processes", "event", "result" and "error", and the
link itself adds "disconnected" when a member can no longer be heard.
"""

from __future__ import annotations

import dataclasses
import importlib
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


@dataclasses.dataclass(frozen=True)
class Role:
    """One kind of member a backend's plan needs, `count` of them (indices 0 .. count-1).

    Attributes:
      name: the member's role ("worker", "coordinator", "ps"); with its index it names the member.
      count: how many.
      runs_work: it runs the serve loop (launch/member.py) and is handed each run's work; False:
        it only serves a TensorFlow server (async-ps's parameter servers and workers).
      may_die: its end does not end the run (async-ps's worker servers: the others go on).
      gpus: the GPUs each member uses where the placement has GPUs; where it has none, a member
        runs one CPU device, so more than 1 cannot be placed there. 0: CPU only.
      started_by: on one host, these members are not placed: the member of this role starts them
        as its own children (async-ps's coordinator starts its servers, so it watches each one's
        exit and shares its private network); a placement over several hosts places them as
        members like any other.
    """

    name: str
    count: int
    runs_work: bool = True
    may_die: bool = False
    gpus: int = 0
    started_by: str | None = None


@runtime_checkable
class MemberPlan(Protocol):
    """What a backend's launch plan tells a placement (backends/remote.py `LaunchPlan`)."""

    cluster: object | None  # the `cluster=` value naming the placement (None: this machine)
    startup_timeout: float

    def roles(self) -> list[Role]:
        """The members, the chief's role first."""
        ...

    def member_env(self, role: str, index: int, addresses: dict[str, list[str]]) -> dict:
        """The environment of member `role:index` (TF_CONFIG, the backend's options), given the
        addresses ("host:port", by index) of every member the placement placed, by role: the
        roles `started_by` another are missing where that member starts them itself."""
        ...


@runtime_checkable
class Member(Protocol):
    """One process of a pool, as the launcher sees it (placements/local: `processes.Child`;
    placements/ray: `RayMember`)."""

    role: str
    index: int
    expected_exit: bool  # its work is delivered (or it was told to go): its exit is no fault
    # The processes it started itself (async-ps's servers on one host), told by its "processes"
    # message: while it starts, its progress is theirs too (cpu_seconds(with_own=True)).
    own_pids: list

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

    def stacks(self) -> str:
        """Its Python threads' stacks now, in faulthandler's form, asked of the process itself
        (it answers even while a call holds its interpreter); "" where it cannot be asked."""
        ...

    def cpu_seconds(self, with_own: bool = False) -> float | None:
        """The CPU time it has used (with_own: and its own processes); None where it cannot be
        read (another node): then only its heartbeats tell a busy member from a frozen one."""
        ...

    def cpu_wait(self, with_own: bool = False) -> tuple[float, bool] | None:
        """How it waits for a CPU (a busy machine starving it): (seconds its threads waited,
        runnable; whether one is runnable now); with_own: its own processes' added. None where
        it cannot be read: then a starved member is told from a frozen one by its CPU time
        alone."""
        ...

    def stopped(self) -> bool:
        """Whether it is stopped now (SIGSTOP, a debugger's stop), where its state can be read
        (this machine); False where it cannot."""
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
    (placements/local: `channel.Channel`, a Unix socket; placements/ray: `RayLink`, actor
    calls)."""

    messages: queue.Queue  # (task name, message dict), in the order each member said them

    def send(self, task: str, message: dict) -> bool:
        """Sends to one member; False when it cannot be reached (its end is reported anyway)."""
        ...

    def broadcast(self, message: dict) -> None: ...

    def unread(self, task: str) -> bool:
        """Whether `task` has said something this side has not read yet (its messages wait in
        the transport while the launcher's own reader is held up); False where it cannot tell."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Placement(Protocol):
    """The processes of one launch plan, placed somewhere; a pool (launch/pool.py) holds one
    for as long as it is warm.

    Lifecycle: constructed from (backend name, a `MemberPlan`): the resources are reserved (a
    network namespace, a placement group and its actors) and every member's address is known,
    so `tasks` hold their environments; then `start()` once (each member connects back on its
    own and says hello), then any number of runs over `channel`, then `stop()`, which leaves
    nothing behind on any host. The static methods answer for a `cluster=` value before any
    pool is placed on it.
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

    @staticmethod
    def prepare(cluster) -> None:
        """What must happen on the calling thread before a pool is placed on another one
        (connecting to Ray: ray.init sets signal handlers, which only the main thread may)."""
        ...

    @staticmethod
    def room_for(cluster, count: int, busy_nodes: set[str]) -> bool:
        """Whether `count` more members would fit now beside the running ones (`busy_nodes`:
        their node ids). The probe of an elastic run (launch/elastic.py); nothing is reserved."""
        ...

    @staticmethod
    def describe(cluster) -> str | None:
        """The `cluster=` value in a replicator's description ("ray:local (pack)"); None for
        this machine."""
        ...


# ----- which placement: chosen from what `cluster=` names ----------------------------------------
# By "module:Class" names, as core/registry.py names the backends: placements/ sits above launch/
# (it imports the member loop and the start progress), so launch/ names them and imports one only
# when a pool is placed. A value of `cluster=` names a placement when its class is a key here.
PLACEMENTS = {
    "workbench._src.placements.ray.cluster:RayCluster": "workbench._src.placements.ray.placement:RayPlacement",
}
LOCAL_PLACEMENT = "workbench._src.placements.local.placement:LocalPlacement"  # cluster=None


def names_a_placement(cluster) -> bool:
    """Whether a `cluster=` value names a placement of the workbench's own (a wb.RayCluster), as
    opposed to a real cluster a process joins (TF_CONFIG, Slurm) or None (this machine)."""
    return cluster is not None and _class_name(cluster) in PLACEMENTS


def placement_class(cluster):
    """The Placement class for a plan whose `cluster` is this value (None: local processes)."""
    name = LOCAL_PLACEMENT if cluster is None else PLACEMENTS[_class_name(cluster)]
    module, attribute = name.split(":")
    return getattr(importlib.import_module(module), attribute)


def place(backend: str, plan: MemberPlan) -> Placement:
    """The members of `plan`, placed (reserved, not started) where its `cluster` says."""
    return placement_class(plan.cluster)(backend, plan)


def _class_name(value) -> str:
    return f"{type(value).__module__}:{type(value).__qualname__}"


# ----- what a launched process may start itself (`Role.started_by`) --------------------------------
# Set by the entry point of a placement whose members start their own children on one host
# (placements/local/worker_main.py: local TensorFlow servers, in the member's private network).
_own_servers = None


def offer_own_servers(factory) -> None:
    """In a launched process: `factory(num_workers, num_ps, *, threads, startup_timeout)` starts
    the TensorFlow servers this member starts itself (placements/local/servers.py LocalServers)."""
    global _own_servers
    _own_servers = factory


def start_own_servers(num_workers: int, num_ps: int, *, threads, startup_timeout: float):
    """The servers this launched process starts as its own children (async-ps's coordinator on
    one host); an error where its placement places them as members instead."""
    if _own_servers is None:
        raise RuntimeError(
            "this process was asked to start its own TensorFlow servers, but its placement starts "
            "no servers for a member (it places them as members of the pool); received no factory "
            "from placements/local/worker_main.py. Fix: give the member the servers' addresses."
        )
    return _own_servers(num_workers, num_ps, threads=threads, startup_timeout=startup_timeout)
