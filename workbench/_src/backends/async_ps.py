"""MultiWorkerAsyncReplicator: asynchronous workers with parameter servers.

TensorFlow's ParameterServerStrategy + ClusterCoordinator, single-client: one process is the
coordinator. It traces step_fn, schedules chunks of steps on whichever worker is free, and the
workers read and update variables that live on the parameter servers, each at its own pace.

Where the coordinator runs:
  - with a real cluster (`cluster=`), in the process that makes the replicator (as TensorFlow's
    own examples do);
  - with cluster=None, never in the notebook: there the constructor returns a RemoteReplicator
    (backends/remote.py) whose plan (`AsyncPsPlan`) declares one coordinator process and the
    parameter servers and workers (on one host the coordinator starts them as its own children:
    `Role.started_by`), and the coordinator trains the cell or setup it is sent, like a
    multi-worker launch. Connecting a process to a cluster renames its TensorFlow job and fills
    its log with gRPC errors at shutdown: the kernel stays clean.

What asynchronous training changes, and how the workbench deals with it:
  - no replica steps with another, so the cross-replica primitives (all_sum, broadcast, ...)
    raise an error naming the backends where they work (the spec says synchronous=False);
    wrap_optimizer applies each worker's own gradient (there is no mean to take);
  - execution is at-least-once: a chunk lost with a dead worker is run again elsewhere. The
    history has exactly `steps` rows (one per scheduled step that returned); a counter of our
    own, a plain variable on a parameter server, counts the steps really executed (Keras's
    optimizer.iterations undercounts here, its increment is not atomic across workers);
  - a dead worker is survivable (the run goes on, the event is in run.events and the history's
    `workers` column); a dead parameter server is not: the run stops within seconds with an
    error that points at the last checkpoint.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import weakref

from workbench._src import compat
from workbench._src.backends.async_coordinator import AsyncProgram, CoordinatorExecutor
from workbench._src.backends.join_watchdog import wait_for_peers
from workbench._src.backends.remote import LaunchPlan, ProcessBackend, check_memory_growth_limit
from workbench._src.backends.worker_watch import DEFAULT_WORKER_TIMEOUT
from workbench._src.core import tf_setup
from workbench._src.core.cluster_resolver import cluster_resolver
from workbench._src.core.errors import ConfigurationError, check_positive_int
from workbench._src.core.tf_setup import tf
from workbench._src.core.tracebacks import user_facing
from workbench._src.launch import placement, runtime
from workbench._src.launch.memory import MEMORY_GROWTH_LIMIT
from workbench._src.launch.placement import Role


def _worker_failures_said_by_the_run(record) -> bool:
    """Drops the coordinator's own log lines about a failing worker ("Worker /job:worker/... failed
    with UnavailableError" and its gRPC details, at ERROR): the run says it in one sentence
    (backends/worker_watch.py, async_coordinator.py). WORKBENCH_TF_LOGS=1 keeps them."""
    return not record.pathname.endswith("cluster_coordinator.py")


_connected = None  # weakref to the replicator whose cluster this process uses (one at a time)


@dataclasses.dataclass
class AsyncPsPlan(LaunchPlan):
    """An async-ps run: one coordinator process and its TensorFlow servers (parameter servers and
    workers), which it starts itself on one host."""

    num_workers: int = 2
    num_ps: int = 1
    startup_timeout: float = 120.0
    heartbeat_timeout: float = 10.0
    threads_per_server: int | None = None
    idle_timeout: float | None = 600.0  # a warm pool ends after this long unused (None: never)
    pool: bool = True  # False: fresh processes for every run, stopped at its end (the old path)
    cluster: object | None = None  # the `cluster=` value naming where the pool is placed (None: here)
    # A worker of a cluster this process did not start (a real cluster, a placed pool) that has not
    # answered for this long is lost, and the run goes on without it (backends/worker_watch.py).
    worker_timeout: float | None = DEFAULT_WORKER_TIMEOUT
    memory_growth_limit: float | None = MEMORY_GROWTH_LIMIT  # (launch/memory.py)

    def __post_init__(self):
        check_positive_int("num_workers", self.num_workers)
        check_positive_int("num_ps", self.num_ps)
        check_memory_growth_limit(self.memory_growth_limit)
        if self.worker_timeout is not None and not (
            isinstance(self.worker_timeout, (int, float)) and self.worker_timeout > 0
        ):
            raise ConfigurationError(
                f"worker_timeout is the seconds a silent worker has before it is declared lost; received "
                f"worker_timeout={self.worker_timeout!r}. Fix: worker_timeout=60 (say), or None to wait for "
                "a silent worker forever."
            )

    @property
    def num_replicas(self) -> int:
        return self.num_workers  # one independent replica per worker

    def describe(self) -> dict:
        return {
            "backend": MultiWorkerAsyncReplicator.backend,
            "num_replicas": self.num_workers,
            "num_workers": self.num_workers,
            "num_ps": self.num_ps,
            "synchronous": False,
        } | self._described_cluster()

    @property
    def launch_timeout(self) -> float:
        return self.startup_timeout + 60.0  # the coordinator's own start includes the servers'

    def roles(self) -> list[Role]:
        """The coordinator runs the work; the parameter servers and workers only serve TensorFlow
        servers. On one host the coordinator starts them itself, as its children: it watches
        each one's exit and they share its private network."""
        return [
            Role("coordinator", 1),
            Role("ps", self.num_ps, runs_work=False, started_by="coordinator"),
            # a lost worker server does not end the run: asynchronous training goes on without it
            Role("worker", self.num_workers, runs_work=False, may_die=True, started_by="coordinator"),
        ]

    def member_env(self, role: str, index: int, addresses: dict[str, list[str]]) -> dict:
        """The coordinator's options (with the servers' cluster spec when they are members, not
        its own children); a server's TF_CONFIG and threads."""
        servers_placed = "ps" in addresses
        spec = {
            "chief": addresses["coordinator"],
            "ps": addresses.get("ps"),
            "worker": addresses.get("worker"),
        }
        if role != "coordinator":
            env = {"TF_CONFIG": json.dumps({"cluster": spec, "task": {"type": role, "index": index}})}
            if self.threads_per_server:
                env["WORKBENCH_WORKER_THREADS"] = str(self.threads_per_server)
            return env
        options = {
            "num_workers": self.num_workers,
            "num_ps": self.num_ps,
            "startup_timeout": self.startup_timeout,
            "threads_per_server": self.threads_per_server,
            "worker_timeout": self.worker_timeout,
        }
        if servers_placed:  # (else it starts its own: prepare_launched_process)
            options["cluster"] = {"cluster": spec, "task": {"type": "chief", "index": 0}}
        return {
            **runtime.backend_env(MultiWorkerAsyncReplicator.backend, options),
            "CUDA_VISIBLE_DEVICES": "",
        }


class MultiWorkerAsyncReplicator(ProcessBackend):
    """Asynchronous data parallelism: workers step independently on parameter-server variables.

    Args:
      num_workers: worker servers (cluster=None: started on this machine, reachable from it only).
      num_ps: parameter servers; variables are spread over them.
      cluster: a real cluster instead: "TF_CONFIG", "slurm", a TF_CONFIG-style dict, or a
        tf.distribute cluster resolver whose spec has "worker" and "ps" jobs. This process
        is the coordinator ("chief").
      startup_timeout: seconds for the local servers to come up.
      heartbeat_timeout: a local coordinator process silent this long is declared frozen.
      worker_timeout: with `cluster=` (or a Ray cluster), a worker whose address has not answered
        for this many seconds (its host cut off, its process frozen) is declared lost: the run
        says so and goes on with the others, and the worker rejoins if it answers again; when
        every worker is lost the run fails with WorkerError. None: wait for it forever.
        (Local servers are this process's children, watched by their exit instead.)
      threads_per_server: TensorFlow threads in each local server (None: TensorFlow's choice).
      idle_timeout: seconds a warm pool (coordinator and servers) stays up unused (None: until
        shutdown()).
      pool: keep the coordinator and its servers warm between runs of the same shape (False:
        start and stop them for every run).
      memory_growth_limit: how much a process of a warm pool may grow over its size after the
        pool's first runs before the pool is renewed (TensorFlow keeps some state of every run's
        traced step for a process's life); the new one starts in the background once the pool is
        left unused. 0.05: within 5% at a renewal every few runs. None: never renewed for memory.

    Example (the model is built in the coordinator process from the setup function):
      >>> import workbench as wb
      >>> repl = wb.MultiWorkerAsyncReplicator(num_workers=2, num_ps=1)
      >>> repl.num_replicas, repl.runs_in_processes
      (2, True)
    """

    backend = "async-ps"
    synchronous = False
    Plan = AsyncPsPlan

    def __init__(
        self,
        num_workers: int = 2,
        num_ps: int = 1,
        cluster=None,
        *,
        startup_timeout: float = 120.0,
        heartbeat_timeout: float = 10.0,
        worker_timeout: float | None = DEFAULT_WORKER_TIMEOUT,
        threads_per_server: int | None = None,
        idle_timeout: float | None = 600.0,
        pool: bool = True,
        memory_growth_limit: float | None = MEMORY_GROWTH_LIMIT,
        **input_options,
    ):
        super().__init__(**input_options)
        self.plan = AsyncPsPlan(
            num_workers,
            num_ps,
            startup_timeout,
            heartbeat_timeout,
            threads_per_server,
            idle_timeout,
            pool,
            worker_timeout=worker_timeout,
            memory_growth_limit=memory_growth_limit,
        )
        self._cluster_option = cluster
        self.coordinator = None
        self.servers = None  # the servers this process started as its children (a coordinator on one host)
        self.worker_addresses: list[str] = []  # a cluster's workers (not started by this process)
        # The breakdown's measured time to read every trainable variable from the parameter servers,
        # by the variables' shapes and dtypes (async_breakdown.py): measured once per model on a
        # cluster, not each run of a warm pool, as its probe is a function TensorFlow keeps on the
        # servers for good.
        self.variable_read_seconds: dict[tuple, float] = {}

    @classmethod
    def from_replicas(cls, num_replicas=None, num_workers=None, num_ps=None, **kwargs):
        if num_replicas is not None:
            check_positive_int("num_replicas", num_replicas, fix="num_replicas=2 (one per worker)")
        workers = num_workers or num_replicas or 2
        if num_replicas is not None and num_replicas != workers:
            raise ConfigurationError(
                f"async-ps runs one replica per worker; received replicas={num_replicas} and "
                f"workers={num_workers}. Fix: give --workers {num_replicas} alone."
            )
        return cls(num_workers=workers, num_ps=num_ps or 1, **kwargs)

    @property
    def num_workers(self) -> int:
        return self.plan.num_workers

    @property
    def num_ps(self) -> int:
        return self.plan.num_ps

    @property
    def num_replicas(self) -> int:
        return self.plan.num_replicas

    def describe(self) -> dict:
        return self.plan.describe()

    # ----- the cluster -------------------------------------------------------------------
    def _make_strategy(self):
        global _connected
        t = tf()
        previous = _connected() if _connected is not None else None
        if previous is not None and previous is not self:
            # One process talks to one cluster: connecting rewires TensorFlow's context.
            previous.shutdown(reason="another async-ps replicator connected")
        strategy = t.distribute.ParameterServerStrategy(self._resolver())
        self.coordinator = t.distribute.coordinator.ClusterCoordinator(strategy)
        compat.replace_executor_scope_with_one_that_does_not_wait()  # (one silent worker held all)
        if not tf_setup.tf_logs_wanted():
            logging.getLogger("tensorflow").addFilter(_worker_failures_said_by_the_run)
        with strategy.scope():
            # Our own exact step counter (see the module docstring): a raw variable on a PS.
            self.executed_steps = t.Variable(0, dtype=t.int64, trainable=False, name="workbench_steps")
        _connected = weakref.ref(self)
        return strategy

    def _resolver(self):
        if self._cluster_option is not None:
            resolver = cluster_resolver(self._cluster_option)
            spec = resolver.cluster_spec().as_dict()
            self.plan.num_workers = len(spec.get("worker", []))
            self.plan.num_ps = len(spec.get("ps", []))
            # TensorFlow waits for a server that never starts with no deadline: wait here, where
            # startup_timeout can still raise naming the tasks that never came.
            wait_for_peers(resolver, self.plan.startup_timeout)
            self.worker_addresses = spec.get("worker", [])  # (watched by the run: worker_timeout)
            return resolver
        # Here in a coordinator process the launcher started (in the notebook the replicator is
        # remote and never gets here): its servers are its own children.
        if self.servers is None:
            self.prepare_launched_process()
        self.wait_for_own_servers()
        self.startup_seconds = self.servers.startup_seconds
        t = tf()
        return t.distribute.cluster_resolver.SimpleClusterResolver(
            t.train.ClusterSpec(self.servers.cluster), rpc_layer="grpc", task_type="chief", task_id=0
        )

    def shutdown(self, reason: str = "shutdown() called") -> None:
        """Stops the local servers; the next use starts a fresh cluster (variables are lost)."""
        global _connected
        # Drop what refers to the remote functions and variables while the servers still
        # answer, so TensorFlow's clean-up does not flood the log with connection errors.
        # (Not coordinator._cluster.stop(): it waits forever for a dead worker's handler.)
        self._forget_setup_runs()  # (their functions hold the model; their gradients its graphs)
        self._programs.clear()
        self._created_variables.clear()
        self.variable_read_seconds.clear()  # (another cluster next)
        self._strategy, self.coordinator = None, None
        gc.collect()
        if self.servers is not None:
            self.servers.stop()
            self.servers = None
        self._shutdown_reason = reason
        if _connected is not None and _connected() is self:
            _connected = None

    def prepare_launched_process(self) -> None:
        """Starts the local servers before this process imports TensorFlow (worker_main), so
        their imports run alongside its own; the strategy waits for them to listen."""
        plan = self.plan
        if self._cluster_option is not None:
            return  # a cluster's servers (or a placed pool's server members) run elsewhere
        self.servers = placement.start_own_servers(
            plan.num_workers,
            plan.num_ps,
            threads=plan.threads_per_server,
            startup_timeout=plan.startup_timeout,
        )

    def wait_for_own_servers(self) -> None:
        if self.servers is not None:
            self.servers.wait_until_listening()

    def close_launched_process(self) -> None:
        self.shutdown(reason="the coordinator process is ending")

    def started_processes(self) -> list[dict]:
        """The servers this coordinator process started (reported to the launcher)."""
        return self.servers.processes if self.servers is not None else []

    def live_workers(self) -> int:
        return self.servers.live_workers() if self.servers is not None else self.num_workers

    # ----- running -----------------------------------------------------------------------
    def _program(self, step_fn, input_fn):
        key = (step_fn, input_fn)
        if key not in self._programs:
            self._programs[key] = AsyncProgram(self, step_fn, input_fn)
        return self._programs[key]

    @user_facing
    def run(self, step_fn, input_fn):
        """One step on one worker (whichever is free); returns [its outputs]."""
        return [self._program(step_fn, input_fn).run_one()]

    def _executor(self, program):
        return CoordinatorExecutor(program)
