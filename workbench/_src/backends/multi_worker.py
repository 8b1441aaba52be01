"""MultiWorkerReplicator: synchronous all-reduce across worker processes (MultiWorkerMirroredStrategy).

TF2's multi-worker training is multi-client: every worker process runs the same program and the
collectives meet in the middle. In a worker (one the workbench launched, or any process given
`cluster=`), this is a replicator over MultiWorkerMirroredStrategy like any other backend. In a
notebook with no cluster given, the constructor returns the backend's notebook face, a
RemoteReplicator (backends/remote.py) whose plan (`MultiWorkerPlan`) declares `num_workers`
worker processes and their TF_CONFIG; each builds this same class in-cluster.

How work reaches the workers (see docs/design-decisions.md and launch/shipping.py): a
`%%replicate` cell's source, or functions pickled by value (`repl.train(setup=build)`, or
self-contained step_fn/input_fn). TensorFlow state never travels; the chief's trained weights
come back at the end.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile

from workbench._src.backends.remote import LaunchPlan, ProcessBackend, check_memory_growth_limit
from workbench._src.core.cluster_resolver import cluster_resolver
from workbench._src.core.errors import ConfigurationError, check_positive_int
from workbench._src.core.run import NO_STOP, PREEMPT, STOP
from workbench._src.core.tf_setup import tf
from workbench._src.launch import runtime
from workbench._src.launch.memory import MEMORY_GROWTH_LIMIT
from workbench._src.launch.placement import Role

# TensorFlow's coordination-service heartbeat timeout in a launched run, in heartbeat_timeouts.
# The launcher names a frozen or lost worker after heartbeat_timeout (stretched while the machine
# starves it); TensorFlow's timeout cannot tell starved from frozen, so it must come well after.
# Lower it only if a lost peer could escape the launcher's watch (none known: local members are
# watched by pid, Ray members by Ray and by their heartbeats).
TF_HEARTBEAT_BACKSTOP = 6


@dataclasses.dataclass
class MultiWorkerPlan(LaunchPlan):
    """A multi-worker run: `num_workers` worker processes, worker 0 the chief (where they run is
    the placement's, chosen by `cluster`)."""

    num_workers: int = 2
    devices_per_worker: int | None = None
    startup_timeout: float = 120.0
    heartbeat_timeout: float = 10.0
    threads_per_worker: int | None = None
    idle_timeout: float | None = 600.0  # a warm pool ends after this long unused (None: never)
    pool: bool = True  # False: fresh processes for every run, stopped at its end (the old path)
    cluster: object | None = None  # the `cluster=` value naming where the pool is placed (None: here)
    min_workers: int | None = None  # elastic: a heal may go on with this many workers (launch/elastic.py)
    memory_growth_limit: float | None = MEMORY_GROWTH_LIMIT  # (launch/memory.py)

    # min_workers says how far a run may shrink, not which processes run (a pool of 1 worker is
    # the same whatever the run's floor).
    NOT_SHAPE = (*LaunchPlan.NOT_SHAPE, "min_workers")

    def __post_init__(self):
        check_positive_int("num_workers", self.num_workers)
        check_min_workers(self.min_workers, self.num_workers)
        check_memory_growth_limit(self.memory_growth_limit)
        if self.devices_per_worker is not None:
            check_positive_int("devices_per_worker", self.devices_per_worker)
        self.devices_per_worker = self.devices_per_worker or 1

    @property
    def num_replicas(self) -> int:
        return self.num_workers * self.devices_per_worker

    def with_workers(self, count: int) -> MultiWorkerPlan:
        """This plan with `count` workers (an elastic run shrunk or grown back)."""
        return dataclasses.replace(self, num_workers=count)

    def describe(self) -> dict:
        described = {
            "backend": MultiWorkerReplicator.backend,
            "num_replicas": self.num_replicas,
            "num_workers": self.num_workers,
            "devices_per_worker": self.devices_per_worker,
            "synchronous": True,
        }
        return described | self._described_cluster()

    def roles(self) -> list[Role]:
        # Each worker uses devices_per_worker GPUs where there are GPUs, else one CPU device.
        return [Role("worker", self.num_workers, gpus=self.devices_per_worker)]

    def member_env(self, role: str, index: int, addresses: dict[str, list[str]]) -> dict:
        """Worker `index`'s TF_CONFIG (every worker's address, worker 0 the chief) and options."""
        options = {"devices_per_worker": self.devices_per_worker}
        env = {
            **runtime.backend_env(MultiWorkerReplicator.backend, options),
            "TF_CONFIG": json.dumps(
                {"cluster": {"worker": addresses["worker"]}, "task": {"type": "worker", "index": index}}
            ),
            "WORKBENCH_WORKER_DEVICES": str(self.devices_per_worker),
        }
        if self.threads_per_worker:
            env["WORKBENCH_WORKER_THREADS"] = str(self.threads_per_worker)
        return env


def check_min_workers(min_workers, num_workers: int) -> None:
    """min_workers is None or a count from 1 to num_workers."""
    if min_workers is None:
        return
    check_positive_int("min_workers", min_workers, fix=f"min_workers=1 (up to num_workers={num_workers})")
    if min_workers > num_workers:
        raise ConfigurationError(
            f"min_workers is the fewest workers an elastic run goes on with, so it cannot exceed "
            f"num_workers; received num_workers={num_workers}, min_workers={min_workers}. Fix: "
            f"min_workers={max(1, num_workers // 2)}, or num_workers={min_workers} or more."
        )


class MultiWorkerReplicator(ProcessBackend):
    """Synchronous replicas in several worker processes, all-reducing over TensorFlow's gRPC runtime.

    Args:
      num_workers: worker processes (cluster=None: started on this machine, reachable from it only).
      devices_per_worker: replicas per worker: its GPUs (split evenly by default), else 1 CPU.
      cluster: join a real cluster instead: "TF_CONFIG" (the environment variable), "slurm",
        a TF_CONFIG dict {"cluster": ..., "task": ...}, or a tf.distribute cluster resolver.
        Every process of that cluster runs the same program (e.g. `workbench run FILE.py`).
      startup_timeout: seconds for every worker to start and connect; then a clear error
        (TensorFlow alone waits forever for a peer that never comes). Local workers still
        starting on a busy machine (using or waiting for a CPU) are given longer, up to 4x.
      heartbeat_timeout: a local worker silent this long is declared frozen and the run stopped.
      threads_per_worker: TensorFlow intra/inter-op threads in each local worker (None: TF's).
      idle_timeout: seconds a warm pool of local workers stays up unused (None: until shutdown()).
      pool: keep the local workers warm between runs of the same shape (False: start and stop
        them for every run).
      memory_growth_limit: how much a process of a warm pool may grow over its size after the
        pool's first runs before the pool is renewed (TensorFlow keeps some state of every run's
        traced step for a process's life); the new one starts in the background once the pool is
        left unused. 0.05: within 5% at a renewal every few runs. None: never renewed for memory.
      min_workers: elastic worker counts (with `train(max_restarts=N)`): when the cluster has no
        room for `num_workers` (a node gone, no other with room), the run starts or heals
        with fewer, never below `min_workers`, keeping the global batch (each worker takes a
        larger share), and grows back to `num_workers` at a checkpoint once room returns.
        None: always `num_workers`. Workers on this machine always fit: only a pool placed on
        a cluster of machines (wb.RayCluster) shrinks.

    Example (functions defined in a notebook travel to the workers by value):
      >>> import workbench as wb
      >>> repl = wb.MultiWorkerReplicator(num_workers=2)
      >>> repl.num_replicas, repl.runs_in_processes
      (2, True)
    """

    backend = "multi-worker"
    Plan = MultiWorkerPlan

    def __init__(
        self,
        num_workers: int = 2,
        devices_per_worker: int | None = None,
        cluster=None,
        *,
        startup_timeout: float = 120.0,
        heartbeat_timeout: float = 10.0,
        threads_per_worker: int | None = None,
        idle_timeout: float | None = 600.0,
        pool: bool = True,
        min_workers: int | None = None,
        memory_growth_limit: float | None = MEMORY_GROWTH_LIMIT,
        **input_options,
    ):
        super().__init__(**input_options)
        if min_workers is not None and cluster is not None:
            raise ConfigurationError(
                f"min_workers applies to the workers the workbench starts and heals (cluster=None, "
                f"or a wb.RayCluster); on a cluster given as {cluster!r} its own scheduler restarts "
                "the processes. Fix: leave min_workers out, or place the workers on Ray."
            )
        self.plan = MultiWorkerPlan(
            num_workers, devices_per_worker, startup_timeout, heartbeat_timeout, threads_per_worker,
            idle_timeout, pool, min_workers=min_workers, memory_growth_limit=memory_growth_limit,
        )  # fmt: skip
        self.devices_per_worker = self.plan.devices_per_worker
        self._cluster_option = cluster
        self._resolver_made = None
        if cluster is not None or not runtime.is_launched():
            self._resolver  # noqa: B018 - a wrong cluster= is an error at construction
        self._agree_fn = None
        self._scratch = None  # a non-chief worker's checkpoint folder
        self.preempted_workers: list[int] = []  # who asked, in the last chunk agreement, to save and stop

    @classmethod
    def from_replicas(cls, num_replicas=None, num_workers=None, devices_per_worker=None, **kwargs):
        per_worker = devices_per_worker or 1
        if num_replicas is not None:
            check_positive_int("num_replicas", num_replicas, fix="num_replicas=2 (one per worker on CPUs)")
        if num_workers is None:
            num_workers = (num_replicas // per_worker) if num_replicas else 2
        if num_replicas is not None and num_replicas != num_workers * per_worker:
            raise ConfigurationError(
                f"multi-worker runs num_workers x devices_per_worker replicas; received "
                f"replicas={num_replicas}, workers={num_workers}, devices per worker={per_worker}. "
                f"Fix: give --workers {num_replicas // per_worker or 1} alone, or matching numbers."
            )
        return cls(num_workers=num_workers, devices_per_worker=devices_per_worker, **kwargs)

    # ----- the cluster ------------------------------------------------------------------------
    @property
    def _resolver(self):
        # Made on first use, not in the constructor: it imports TensorFlow, and a launched
        # worker builds this face before its import (worker_main).
        if self._resolver_made is None:
            # A launched worker reads TF_CONFIG, checked as the user's would be.
            option = self._cluster_option
            self._resolver_made = cluster_resolver("TF_CONFIG" if option is None else option)
        return self._resolver_made

    @property
    def num_workers(self) -> int:
        spec = self._resolver.cluster_spec().as_dict()
        return len(spec.get("worker", [])) + len(spec.get("chief", []))

    @property
    def worker_id(self) -> int:
        if self._resolver.task_type == "chief":
            return 0
        has_chief = "chief" in self._resolver.cluster_spec().as_dict()
        return int(self._resolver.task_id) + (1 if has_chief else 0)

    def describe(self) -> dict:
        return {
            "backend": self.backend,
            "num_replicas": self.num_replicas,
            "num_workers": self.num_workers,
            "devices_per_worker": self.devices_per_worker,
            "synchronous": True,
        }

    def _make_strategy(self):
        t = tf()
        options = t.distribute.experimental.CommunicationOptions(
            implementation=t.distribute.experimental.CommunicationImplementation.RING
        )
        if not runtime.is_launched():
            # TensorFlow's join waits forever for a peer that never starts, holding the
            # interpreter; so wait here, where a timeout can still raise, until every peer
            # listens. (Local launches have the launcher's own deadline instead.)
            from workbench._src.backends.join_watchdog import wait_for_peers

            wait_for_peers(self._resolver, self.plan.startup_timeout)
        else:
            # A launched worker's freezes and losses are the launcher's to judge (it tells a
            # starved process from a frozen one, launch/watch.py); TensorFlow's own heartbeat is
            # left as the backstop, long enough that a loaded machine does not trip it.
            from workbench._src.compat import set_coordination_heartbeat_timeout

            set_coordination_heartbeat_timeout(
                self._resolver.cluster_spec(), TF_HEARTBEAT_BACKSTOP * self.plan.heartbeat_timeout
            )
        return t.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=self._resolver, communication_options=options
        )

    def _agree_on_chunk(self, steps: int, stop: int) -> tuple[int, int]:
        if self.num_workers == 1:
            return steps, stop
        t = tf()
        strategy = self.strategy
        if self._agree_fn is None:

            def replica_fn(values):
                # identity places the value on this replica's device (a bare argument has none,
                # and the collective then has no destination).
                return t.distribute.get_replica_context().all_reduce("sum", t.identity(values))

            self._agree_fn = t.function(lambda values: strategy.run(replica_fn, args=(values,)))
        # The chief proposes the chunk length; any worker may ask to stop, or to save and stop
        # for a preemption (run.PREEMPT: the most urgent kind wins).
        # A preempted worker adds 2**worker_id, so the others can name it (exact in float32 up
        # to 24 workers; past that they say only that one was).
        mine = t.constant(
            [
                1.0 if stop else 0.0,
                float(steps) if self.worker_id == 0 else 0.0,
                float(2**self.worker_id) if stop == PREEMPT and self.worker_id < 24 else 0.0,
            ]
        )
        total = strategy.experimental_local_results(self._agree_fn(mine))[0].numpy()
        per_worker = strategy.num_replicas_in_sync / self.num_workers  # each local replica adds once
        preempted = int(round(total[2] / per_worker))
        self.preempted_workers = [i for i in range(min(self.num_workers, 24)) if preempted >> i & 1]
        kind = PREEMPT if preempted or (stop == PREEMPT) else STOP if total[0] > 0 else NO_STOP
        return int(round(total[1] / per_worker)), kind

    def _checkpoint_write_directory(self, directory: str) -> str:
        # Every worker saves (the save is collective) but only the chief's copy is kept: the
        # others write into a scratch folder removed when the process ends (or is closed).
        if self.worker_id != 0:
            if self._scratch is None:
                self._scratch = tempfile.TemporaryDirectory(prefix=f"workbench-ckpt-worker{self.worker_id}-")
            return self._scratch.name
        return directory

    def close_launched_process(self) -> None:
        """Called by worker_main before the process exits hard: removes the scratch folder."""
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None
