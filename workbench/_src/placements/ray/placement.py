"""The Ray placement (`cluster=wb.RayCluster(...)`): a pool's members as Ray actors, behind the
same `Placement` as local processes (launch/placement.py), so the pool's rules, the launcher,
the run loop, the dashboard, the sidebar and the run store do not know where the processes are.

  1. One placement group with a bundle (`resources_per_worker`) per process: "spread" is Ray's
     STRICT_SPREAD (one process per node), "pack" is PACK. One that cannot be met within
     `startup_timeout` is removed and reported with what the cluster has.
  2. One actor per process (placements/ray/member.py) in its bundle. Each says its node's address,
     its pid and a port free on its node; the backend's plan forms TF_CONFIG from those
     (`plan.ray_layout()`, `plan.tasks_on(addresses)`).
  3. The members that run work (multi-worker's workers, async-ps's coordinator) run
     worker_main.serve as a local member does; async-ps's parameter servers and workers run a
     TensorFlow server. Messages go by actor calls: `deliver` one way, a long `poll` the other,
     one thread per member here (a daemon: it never holds the interpreter).
  4. A member whose actor dies (its process killed, its node gone) is seen by its poll failing;
     a frozen one by its heartbeats stopping. The launcher's fault handling then applies as for
     local processes; an async-ps worker server may die (the run goes on, said once).
  5. stop(): "shutdown" to every member, each removes its temp folder, then every actor is
     killed and the placement group removed. Actors are owned by this process: Ray ends them
     with it too (the kernel killed, the interpreter exiting).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import queue
import shutil
import threading
import time

from workbench._src.core.errors import ConfigurationError, WorkerError
from workbench._src.placements.local.processes import TMP_PREFIX
from workbench._src.placements.proc import pid_alive, process_cpu_seconds, process_start_ticks
from workbench._src.placements.ray.cluster import PLACEMENTS
from workbench._src.placements.ray.local_start import actors_ready  # (says actors k/N)

MEMBER_MODULE = "workbench._src.placements.ray.member"  # named, as worker_main is: it runs over there
# How long one long poll waits for a member's messages: it bounds how late the launcher sees a
# message when none follow, and how often each member is called (the member's orphan watch needs
# one well within ORPHAN_SECONDS).
POLL_SECONDS = 1.0
# A member unpolled this long (or 3 heartbeat timeouts, if longer) has lost its launcher (a node
# cut off, a launcher gone before Ray noticed) and leaves on its own, as a local member leaves on
# EOF. Only time the member could run counts (member.py). It bounds how long a cut-off actor
# lingers; it must stay well above POLL_SECONDS plus a loaded machine's scheduling delay.
ORPHAN_SECONDS = 30.0
# How long a message to one member is waited for (sends are waited for so one member's messages
# keep their order): a dead or frozen member does not hold the launcher longer than this.
SEND_TIMEOUT = 5.0


class RayMember:
    """One actor of the pool, as the launcher sees a local child."""

    def __init__(self, role: str, index: int, actor, where: dict, on_this_node: bool, may_die: bool = False):
        self.role, self.index, self.actor = role, index, actor
        self.pid, self.node, self.port = where["pid"], where["address"], where["port"]
        self.node_id, self.tmp_dir = where["node_id"], where["tmp_dir"]
        self.on_this_node = on_this_node  # the launcher's own Ray node
        # Its CPU time is readable here when it runs on this process's node and this /proc shows
        # it (the same pid started at the same moment: not a namespace's or a reused pid).
        started = where.get("started")
        self._started = started
        self._cpu_readable = on_this_node and started is not None and started == process_start_ticks(self.pid)
        self.may_die = may_die  # an async-ps worker server: the run goes on without it
        self.expected_exit = False
        self.dead = False
        self.death = ""
        self.exited = False  # it left its serve loop (shutdown)

    @property
    def where(self) -> str:
        return f"pid {self.pid} on node {self.node}"

    @property
    def killed(self) -> bool:
        return self.dead

    def exit_description(self) -> str:
        if not self.dead:
            return "still running"
        return f"died: its Ray actor ended ({self.death})" if self.death else "died: its Ray actor ended"

    def log_tail(self, lines: int = 15) -> str:
        return ""  # its output is in Ray's logs on its node (`ray logs`); errors come as messages

    def process_gone(self) -> bool:
        """Its process has ended, as this node's /proc shows (False where it cannot be read)."""
        if not self._cpu_readable:
            return False
        return not pid_alive(self.pid) or process_start_ticks(self.pid) != self._started

    def cpu_seconds(self) -> float | None:
        """Its CPU time, where it can be read (the launcher tells a busy member from a frozen
        one by it, as for a local child); None on another node: only its heartbeats tell."""
        return process_cpu_seconds(self.pid) if self._cpu_readable else None


class RayMembers:
    """The pool's actors, with the process group's questions (launch/watch.py asks them)."""

    def __init__(self, members: list[RayMember]):
        self.children = members

    def unexpected_exits(self) -> list[RayMember]:
        return [m for m in self.children if m.dead and not m.expected_exit and not m.may_die]


class RayChannel:
    """Messages to and from the members by actor calls, queued as Channel queues them."""

    def __init__(self, ray, members: RayMembers, working: set[str], report_to: str):
        self.ray = ray
        self.members = {f"{m.role}:{m.index}": m for m in members.children}
        self.working = working  # the members that run work (a TF server member takes no messages)
        self.messages: queue.Queue = queue.Queue()  # (task, message dict)
        self.report_to = report_to  # the task whose run hears of a lost async-ps worker
        self._closed = False
        for task, member in self.members.items():
            threading.Thread(
                target=self._poll_loop, args=(task, member), name="workbench ray poll", daemon=True
            ).start()

    def _poll_loop(self, task: str, member: RayMember) -> None:
        ray = self.ray
        while not self._closed:
            try:
                if not ray.is_initialized():  # ray.shutdown() by the user: the actors went with it
                    raise SystemExit
                said = ray.get(member.actor.poll.remote(POLL_SECONDS))
            # RayActorError and kin: the actor is gone. SystemExit: ray.shutdown() under a waiting
            # get (Ray raises it in this thread); the members went with the connection.
            except (Exception, SystemExit) as error:  # noqa: BLE001
                if self._closed or member.exited:
                    return
                member.dead, member.death = True, _death_reason(error)
                if member.may_die:
                    text = (
                        f"async-ps worker {member.index} ({member.where}) {member.exit_description()}; "
                        "the coordinator runs its unfinished steps on the other workers"
                    )
                    self.messages.put(
                        (
                            self.report_to,
                            {
                                "type": "event",
                                "kind": "message",
                                "data": {"text": text, "worker_lost": member.index},
                            },
                        )
                    )
                else:
                    self.messages.put((task, {"type": "disconnected"}))
                return
            for message in said:
                if message.get("type") == "exited":
                    member.exited = True
                else:
                    self.messages.put((task, message))

    def send(self, task: str, message: dict, timeout: float = SEND_TIMEOUT) -> bool:
        member = self.members.get(task)
        if member is None or member.dead or not self.ray.is_initialized():
            return False
        try:  # waited for: messages to one member arrive in the order sent
            self.ray.get(member.actor.deliver.remote(message), timeout=timeout)
            return True
        except Exception:  # noqa: BLE001 - a dead or frozen member; its poll says so
            return False

    def broadcast(self, message: dict, timeout: float = SEND_TIMEOUT) -> None:
        for task in self.working:
            self.send(task, message, timeout)

    def close(self) -> None:
        self._closed = True


class RayPlacement:
    """The members of one launch plan as Ray actors on `plan.ray` (a `Placement`)."""

    exit_grace = 0.5  # at exit: the members may be on other nodes, and exit must not linger

    def __init__(self, backend: str, plan):
        self.backend = backend
        self.cluster = plan.ray
        self.ray = ray = self.cluster.connect()
        self.own_node_id = None  # the node this process runs on, if it is one (not Ray Client)
        with contextlib.suppress(Exception):
            self.own_node_id = ray.get_runtime_context().get_node_id()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._remove_placement_group = remove_placement_group
        layout = plan.ray_layout()  # [(role, index)] of every process, the chief first
        bundle = dict(self.cluster.resources_per_worker)
        self.placement_group = placement_group(
            [bundle] * len(layout), strategy=PLACEMENTS[self.cluster.placement]
        )
        actors = []
        try:
            self._wait_for_placement(plan, len(layout), bundle)
            member_class = ray.remote(importlib.import_module(MEMBER_MODULE).Member)
            for i, (role, index) in enumerate(layout):
                actors.append(
                    member_class.options(
                        num_cpus=bundle.get("CPU", 0),
                        num_gpus=bundle.get("GPU", 0),
                        resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                        max_concurrency=4,  # poll, deliver and clean_up while the member works
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=self.placement_group, placement_group_bundle_index=i
                        ),
                        runtime_env=self.cluster.runtime_env,
                    ).remote(role, index, orphan_timeout=max(ORPHAN_SECONDS, 3 * plan.heartbeat_timeout))
                )
            try:
                wheres = actors_ready(ray, [a.where.remote() for a in actors], plan.startup_timeout)
            except ray.exceptions.GetTimeoutError:
                raise WorkerError(
                    f"the {backend} pool's {len(actors)} Ray actors did not start within "
                    f"startup_timeout={plan.startup_timeout:.0f} s. Fix: a busy cluster needs a longer "
                    "startup_timeout; `ray status` shows what it is doing."
                ) from None
        except BaseException:
            for actor in actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            with contextlib.suppress(Exception):
                remove_placement_group(self.placement_group)
            raise
        addresses = {key: f"{w['address']}:{w['port']}" for key, w in zip(layout, wheres)}
        self.tasks = plan.tasks_on(addresses)  # the members that run work (launcher.Task)
        working = {t.name for t in self.tasks}
        self.servers = plan.servers_on(addresses)  # {(role, index): cluster spec} of TF servers
        members = [
            RayMember(
                role,
                index,
                actor,
                where,
                on_this_node=self.own_node_id is not None and where["node_id"] == self.own_node_id,
                may_die=plan.server_may_die(role),
            )
            for (role, index), actor, where in zip(layout, actors, wheres)
        ]
        self.threads = getattr(plan, "threads_per_server", None)
        self.group = RayMembers(members)
        self.channel = RayChannel(ray, self.group, working, report_to=self.tasks[0].name)

    def _wait_for_placement(self, plan, count: int, bundle: dict) -> None:
        """Waits for the placement group (other jobs may hold the resources for a while); one
        that the cluster could not meet even when idle fails at once."""
        ray = self.ray
        never = not self._could_ever_fit(count, bundle)
        if not never:
            try:
                ray.get(self.placement_group.ready(), timeout=plan.startup_timeout)
                return
            except ray.exceptions.GetTimeoutError:
                pass
        nodes = self.cluster.nodes()
        have = ", ".join(f"{n['address']} (CPU {n['cpus']:g}, GPU {n['gpus']:g})" for n in nodes)
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        spread = self.cluster.placement == "spread"
        why = (
            "even idle, its nodes could not hold them"
            if never
            else f"they were not free within startup_timeout={plan.startup_timeout:.0f} s (other jobs hold them)"
        )
        raise ConfigurationError(
            f"The Ray cluster cannot place this {self.backend} pool: {count} processes of {bundle} "
            f"each, placement={self.cluster.placement!r}{' (one per node)' if spread else ''}; {why}. "
            f"It has {len(nodes)} node(s): {have}; free now: {free}. Fix: fewer workers, smaller "
            f"resources_per_worker{', placement=pack' if spread else ''}, or more nodes."
        )

    def _could_ever_fit(self, count: int, bundle: dict) -> bool:
        """Whether the cluster's live nodes, all free, could hold `count` bundles as placed. Only
        the nodes that exist count: nodes an autoscaler would add on demand are not waited for."""
        nodes = [n.get("Resources", {}) for n in self.ray.nodes() if n.get("Alive")]
        fits = [all(node.get(k, 0) >= v for k, v in bundle.items()) for node in nodes]
        if self.cluster.placement == "spread":
            return sum(fits) >= count
        totals = {k: sum(node.get(k, 0) for node in nodes) for k in bundle}
        return all(totals[k] >= v * count for k, v in bundle.items())

    # ----- what the launcher uses -------------------------------------------------------------
    def start(self) -> None:
        """TF servers first (async-ps), then every working member, none waiting for another."""
        members = {(m.role, m.index): m for m in self.group.children}
        for key, cluster in self.servers.items():
            members[key].actor.serve_tf.remote(cluster, self.threads)
        for task in self.tasks:
            members[(task.role, task.index)].actor.start.remote(task.env)

    def processes(self, extra: list[dict]) -> list[dict]:
        """Role, index, node address and pid of every process of the pool."""
        own = [{"role": m.role, "index": m.index, "node": m.node, "pid": m.pid} for m in self.group.children]
        return own + list(extra)

    def dead_member(self, extra: list[dict]) -> str:
        for member in self.group.children:
            if not member.dead and member.process_gone():
                # (on this node a death is read from /proc at once, as for a local child; Ray's
                # report of it reaches the member's poll a moment later)
                member.dead, member.death = True, "its process is gone"
            if member.dead:
                return f"{member.role} {member.index} ({member.where}) {member.exit_description()}"
        return ""

    # ----- ending ------------------------------------------------------------------------------
    def stop(self, grace: float) -> None:
        """Asks every member to leave, removes their temp folders, kills every actor and removes
        the placement group: nothing of the pool is left on any node. `grace`: seconds for the
        members to leave and clean up (shorter at interpreter exit, which must not linger)."""
        ray = self.ray
        if not ray.is_initialized():  # Ray was shut down first: it ended the actors it owned,
            self._remove_folders_on_this_node()  # before they could clean up
            return
        for member in self.group.children:
            member.expected_exit = True
        self.channel.broadcast({"type": "shutdown"}, timeout=grace / 2)  # (a cut-off member cannot answer)
        deadline = time.monotonic() + grace  # a clean exit removes its own temp folder
        working = [m for m in self.group.children if f"{m.role}:{m.index}" in self.channel.working]
        while any(not (m.exited or m.dead) for m in working) and time.monotonic() < deadline:
            time.sleep(0.05)
        cleaning = [m.actor.clean_up.remote() for m in self.group.children if not m.dead]
        cleaning += self._remove_folders_of_the_dead()
        with contextlib.suppress(Exception):
            ray.wait(cleaning, num_returns=len(cleaning), timeout=grace)
        self.channel.close()
        for member in self.group.children:
            with contextlib.suppress(Exception):
                ray.kill(member.actor, no_restart=True)
        self._remove_folders_on_this_node()
        with contextlib.suppress(Exception):
            self._remove_placement_group(self.placement_group)

    def _remove_folders_on_this_node(self) -> None:
        """The temp folders of members on this process's own node that are still there: a member
        killed before its clean-up ran (Ray shut down first by `ray.shutdown()`; a clean-up slower
        than the grace on a busy machine) is cleaned up from here. Members on other nodes clean up
        themselves or by a sibling (`_remove_folders_of_the_dead`)."""
        for member in self.group.children:
            if member.on_this_node and os.path.basename(member.tmp_dir).startswith(TMP_PREFIX):
                shutil.rmtree(member.tmp_dir, ignore_errors=True)

    def _remove_folders_of_the_dead(self) -> list:
        """A member killed by a signal could not remove its temp folder (AutoGraph's files): a
        living member on its node removes it. (None left there: it stays, said nowhere; a node's
        temp folder is cleaned at its reboot.)"""
        calls = []
        for dead in [m for m in self.group.children if m.dead]:
            helper = next((m for m in self.group.children if not m.dead and m.node_id == dead.node_id), None)
            if helper is not None:
                calls.append(helper.actor.remove_left_behind.remote([dead.tmp_dir]))
        return calls

    def where(self) -> str | None:
        nodes = ", ".join(sorted({m.node for m in self.group.children}))
        return f"Ray ({self.cluster.placement}): {nodes}"


def _death_reason(error: BaseException) -> str:
    """A short reason from Ray's error (its first line), e.g. the node that died."""
    if isinstance(error, SystemExit):
        return "this process's Ray connection was shut down (ray.shutdown())"
    text = str(error).strip().splitlines()
    first = next((line for line in text if line.strip()), type(error).__name__)
    return first[:200]
