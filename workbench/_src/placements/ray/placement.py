"""The Ray placement (`cluster=wb.RayCluster(...)`): a pool's members as Ray actors, behind the
same `Placement` as local processes (launch/placement.py), so the pool's rules, the launcher,
the run loop, the dashboard, the sidebar and the run store do not know where the processes are.

  1. One placement group with a bundle (`resources_per_worker`) per process: "spread" is Ray's
     STRICT_SPREAD (one process per node), "pack" is PACK. One that cannot be met within
     `startup_timeout` is removed and reported with what the cluster has.
  2. One actor per member the plan declares (`plan.roles()`, every role: on several hosts no
     member starts another) in its bundle (placements/ray/member.py). Each says its node's
     address, its pid and a port free on its node; the plan's `member_env` forms each member's
     TF_CONFIG from those addresses, as Ray Train's TensorFlow backend does.
  3. The members that run work (multi-worker's workers, async-ps's coordinator) run
     launch/member.py's serve loop as a local member does; async-ps's parameter servers and
     workers run a TensorFlow server. The link (placements/ray/link.py) is Ray's own: what a
     member says comes on its streaming generator, what the launcher says goes by actor calls,
     and one thread here waits on every member at once with `ray.wait`.
  4. A member whose actor dies (its process killed, its node gone) is known from Ray's error on
     its stream or pending call; a frozen one, alive to Ray, by its heartbeats stopping. The
     launcher's fault handling then applies as for local processes; an async-ps worker server
     may die (the run goes on): a new actor in its bundle serves at its address (replace.py). A
     placement that the cluster's live nodes cannot hold (a node lost) is said at once.
  5. stop(): "shutdown" to every member, then every actor is killed and the placement group
     removed, each wait bounded. Each member's temp folder goes with its process, however it
     ends (its cleaner, member.py). Actors are owned by this process: Ray ends them with it too
     (the kernel killed, the interpreter exiting).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import time

from workbench._src.core.errors import CapacityError, ConfigurationError, WorkerError
from workbench._src.launch.placement import Role, Task
from workbench._src.placements.local.processes import TMP_PREFIX
from workbench._src.placements.ray.cluster import PLACEMENTS
from workbench._src.placements.ray.instance_logs import instance_end
from workbench._src.placements.ray.link import RayLink, RayMember, RayMembers, death_reason, node_ended
from workbench._src.placements.ray.local_start import actors_ready  # (says actors k/N)
from workbench._src.placements.ray.replace import ServerReplacer

MEMBER_MODULE = "workbench._src.placements.ray.member"  # named, as worker_main is: it runs over there
# How often the wait for a placement group asks again whether the cluster could ever hold it: a
# node lost meanwhile (the last run's fault) makes it impossible, said at once rather than after
# startup_timeout.
PLACEMENT_RECHECK_SECONDS = 1.0


class RayPlacement:
    """The members of one launch plan as Ray actors on `plan.cluster`, a wb.RayCluster (a `Placement`)."""

    exit_grace = 0.5  # at exit: the members may be on other nodes, and exit must not linger

    def __init__(self, backend: str, plan):
        self.backend = backend
        self.cluster = plan.cluster
        roles = plan.roles()
        bundle = dict(self.cluster.resources_per_worker)
        for role in roles:
            _check_gpus(role, bundle)  # (before anything is reserved)
        self.ray = ray = self.cluster.connect()
        self.own_node_id = None  # the node this process runs on, if it is one (not Ray Client)
        with contextlib.suppress(Exception):
            self.own_node_id = ray.get_runtime_context().get_node_id()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._remove_placement_group = remove_placement_group
        layout = [(role, i) for role in roles for i in range(role.count)]  # every member, the chief first
        self.placement_group = placement_group(
            [bundle] * len(layout), strategy=PLACEMENTS[self.cluster.placement]
        )
        self._bundle, self._layout = bundle, layout
        self._strategy = PlacementGroupSchedulingStrategy
        actors = []
        try:
            self._wait_for_placement(plan, len(layout), bundle)
            self._member_class = ray.remote(importlib.import_module(MEMBER_MODULE).Member)
            actors.extend(self._new_actor(i) for i in range(len(layout)))
            try:
                wheres = actors_ready(ray, [a.where.remote() for a in actors], plan.startup_timeout)
            except ray.exceptions.GetTimeoutError:
                raise WorkerError(
                    f"the {backend} pool's {len(actors)} Ray actors did not start within "
                    f"startup_timeout={plan.startup_timeout:.0f} s. Fix: a busy cluster needs a longer "
                    "startup_timeout; `ray status` shows what it is doing."
                ) from None
            except ray.exceptions.RayActorError as error:  # (Ray's traceback says nothing more)
                raise WorkerError(
                    self._died_at_start(len(actors), error), cause=death_reason(error)
                ) from None
        except BaseException:
            for actor in actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            with contextlib.suppress(Exception):
                remove_placement_group(self.placement_group)
            raise
        addresses = {role.name: [] for role in roles}
        for (role, _), where in zip(layout, wheres):
            addresses[role.name].append(f"{where['address']}:{where['port']}")
        # The members that run work (launcher.Task, with their environment), and those that only
        # serve TensorFlow: their TF_CONFIG's cluster and threads, for their serve_tf call.
        self.tasks, self.servers = [], {}
        for role, index in layout:
            env = {**_device_env(role, bundle), **plan.member_env(role.name, index, addresses)}
            if role.runs_work:
                self.tasks.append(Task(role.name, index, env))
            else:
                threads = env.get("WORKBENCH_WORKER_THREADS")
                self.servers[(role.name, index)] = (json.loads(env["TF_CONFIG"])["cluster"], threads)
        working = {t.name for t in self.tasks}
        members = [
            RayMember(
                role.name,
                index,
                actor,
                where,
                on_this_node=self.own_node_id is not None and where["node_id"] == self.own_node_id,
                may_die=role.may_die,
                bundle=i,
            )
            for i, ((role, index), actor, where) in enumerate(zip(layout, actors, wheres))
        ]
        self.group = RayMembers(members)
        self.channel = RayLink(ray, self.group, working, self.tasks[0].name, self.cluster.local_root)
        # A lost async-ps worker server is replaced in its bundle, at its address (replace.py).
        self.replacer = ServerReplacer(ray, self.channel, self._new_actor, self.servers, plan.startup_timeout)
        self.channel.on_server_lost = self.replacer.lost

    def _died_at_start(self, count: int, error: BaseException) -> str:
        """The error for actors that died before they answered: Ray's reason and, on a local
        instance whose node ended, its own logs' account (read now: its folder goes at shutdown)."""
        text = f"the {self.backend} pool's {count} Ray actors died before they started: {death_reason(error)}"
        root = self.cluster.local_root
        ended = instance_end(root) if root and node_ended(error) else ""
        if ended:
            return f"{text}. The local Ray instance ended ({ended}). Fix: run it again; if it ends again, its cause is the one in parentheses."
        return f"{text}. Fix: `ray status` and the Ray logs of its node say why."

    def _new_actor(self, bundle_index: int):
        """A member actor of the pool in bundle `bundle_index` of its placement group (at the
        pool's start, and for a replacement: Ray keeps a bundle reserved when its actor dies)."""
        role, index = self._layout[bundle_index]
        bundle = self._bundle
        return self._member_class.options(
            num_cpus=bundle.get("CPU", 0),
            num_gpus=bundle.get("GPU", 0),
            resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
            max_concurrency=4,  # its stream or serve call, deliver and clean_up at once
            scheduling_strategy=self._strategy(
                placement_group=self.placement_group, placement_group_bundle_index=bundle_index
            ),
            runtime_env=self.cluster.runtime_env,
        ).remote(role.name, index)

    # ----- for a `cluster=` value, before any pool (launch/placement.py Placement) -------------
    @staticmethod
    def prepare(cluster) -> None:
        cluster.connect()  # (ray.init sets signal handlers, which only the main thread may)

    @staticmethod
    def room_for(cluster, count: int, busy_nodes: set[str]) -> bool:
        from workbench._src.placements.ray.capacity import room_for

        return room_for(cluster, count, busy_nodes)

    @staticmethod
    def describe(cluster) -> str | None:
        return f"ray:{cluster.address or 'local'} ({cluster.placement})"

    def _wait_for_placement(self, plan, count: int, bundle: dict) -> None:
        """Waits for the placement group (other jobs may hold the resources for a while); one
        that the cluster could not meet even when idle fails at once."""
        ray = self.ray
        never = not self._could_ever_fit(count, bundle)
        deadline = time.monotonic() + plan.startup_timeout
        ready = self.placement_group.ready()
        while not never and time.monotonic() < deadline:
            done, _ = ray.wait([ready], timeout=min(PLACEMENT_RECHECK_SECONDS, deadline - time.monotonic()))
            if done:
                return
            never = not self._could_ever_fit(count, bundle)  # (a node lost meanwhile)
        nodes = self.cluster.nodes()
        have = ", ".join(f"{n['address']} (CPU {n['cpus']:g}, GPU {n['gpus']:g})" for n in nodes)
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        spread = self.cluster.placement == "spread"
        why = (
            "even idle, its live nodes could not hold them"
            if never
            else f"they were not free within startup_timeout={plan.startup_timeout:.0f} s (other jobs hold them)"
        )
        raise CapacityError(  # (a ConfigurationError: an elastic run goes on with fewer workers)
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
        """TF servers first (async-ps), then every working member, none waiting for another: the
        link follows each server's pending call and each working member's stream."""
        members = {(m.role, m.index): m for m in self.group.children}
        for key, (cluster, threads) in self.servers.items():
            self.channel.watch(members[key].task, members[key].actor.serve_tf.remote(cluster, threads))
        for task in self.tasks:
            stream = members[(task.role, task.index)].actor.messages.options(num_returns="streaming")
            self.channel.watch(task.name, stream.remote(task.env))

    def processes(self, extra: list[dict]) -> list[dict]:
        """Role, index, node address and pid of every process of the pool."""
        own = [{"role": m.role, "index": m.index, "node": m.node, "pid": m.pid} for m in self.group.children]
        mine = {(p["role"], p["index"]) for p in own}  # (a replaced server is a member: its new pid is here)
        return own + [p for p in extra if (p["role"], p["index"]) not in mine]

    def dead_member(self, extra: list[dict]) -> str:
        for member in self.group.children:
            if not member.dead and member.process_gone():
                # (on this node a death is read from /proc at once, as for a local child; Ray's
                # report of it reaches the member's stream a moment later)
                member.dead, member.death = True, "its process is gone"
            if member.dead:
                return f"{member.role} {member.index} ({member.where}) {member.exit_description()}"
        return ""

    # ----- ending ------------------------------------------------------------------------------
    def stop(self, grace: float) -> None:
        """Asks every member to leave, kills every actor and removes the placement group: nothing
        of the pool is left on any node (a member's temp folder goes with its process, by its
        cleaner). `grace`: seconds for the members to leave (shorter at interpreter exit, which
        must not linger). Every wait here is bounded: a member frozen, or on a node cut off, does
        not answer, and Ray's kill needs no answer."""
        ray = self.ray
        self.replacer.stop()  # (no new server from now on; one being started is ended)
        if not ray.is_initialized():  # Ray was shut down first: it ended the actors it owned,
            self.channel.close()
            self._remove_folders_on_this_node()  # (their cleaners remove the folders too)
            return
        for member in self.group.children:
            member.expected_exit = True
        everyone = [m.task for m in self.group.children]  # (a TF server member leaves its serve call)
        self.channel.tell(everyone, {"type": "shutdown"}, timeout=grace / 2)
        deadline = time.monotonic() + grace  # a clean exit removes its own temp folder
        working = [m for m in self.group.children if m.task in self.channel.working]
        while any(not (m.exited or m.dead) for m in working) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.channel.close()
        for member in self.group.children:  # (as Ray Train's worker group ends its actors)
            with contextlib.suppress(Exception):
                ray.kill(member.actor, no_restart=True)
        self._remove_folders_on_this_node()
        with contextlib.suppress(Exception):
            self._remove_placement_group(self.placement_group)

    def _remove_folders_on_this_node(self) -> None:
        """The temp folders of members on this process's own node that are still there: at once,
        rather than when their cleaners see the actors' end a moment later."""
        for member in self.group.children:
            if member.on_this_node and os.path.basename(member.tmp_dir).startswith(TMP_PREFIX):
                shutil.rmtree(member.tmp_dir, ignore_errors=True)

    def where(self) -> str | None:
        nodes = ", ".join(sorted({m.node for m in self.group.children}))
        return f"Ray ({self.cluster.placement}): {nodes}"


def _check_gpus(role: Role, bundle: dict) -> None:
    """A role of more than one device per member needs GPUs in each member's bundle."""
    if role.gpus > 1 and not bundle.get("GPU"):
        raise ConfigurationError(
            f"{role.gpus} devices per {role.name} need GPUs in each {role.name}'s Ray bundle; "
            f"resources_per_worker={bundle}. Fix: resources_per_worker={{'GPU': N, ...}}, or one "
            f"device per {role.name} (devices_per_worker=1)."
        )


def _device_env(role: Role, bundle: dict) -> dict:
    """Ray makes a bundle's GPUs visible to its actor itself; a member with none, or of a CPU-only
    role, sees none."""
    if role.gpus and bundle.get("GPU"):
        return {}
    return {"CUDA_VISIBLE_DEVICES": ""}
