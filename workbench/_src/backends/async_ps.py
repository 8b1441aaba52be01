"""MultiWorkerAsyncReplicator: asynchronous workers with parameter servers.

TensorFlow's ParameterServerStrategy + ClusterCoordinator, single-client: one process is the
coordinator. It traces step_fn, schedules chunks of steps on whichever worker is free, and the
workers read and update variables that live on the parameter servers, each at its own pace.

Where the coordinator runs:
  - with a real cluster (`cluster=`), in the process that makes the replicator (as TensorFlow's
    own examples do);
  - with cluster=None, never in the notebook: the notebook's replicator is remote (it has a
    Launcher, launch/launcher.py) and launches one coordinator process, which starts the
    parameter servers and workers as local TensorFlow servers and trains the cell or setup it
    is sent, like a multi-worker launch. Connecting a process to a cluster renames its
    TensorFlow job and fills its log with gRPC errors at shutdown: the kernel stays clean.

What asynchronous training changes, and how the workbench deals with it:
  - no replica steps with another, so the cross-replica primitives (all_sum, broadcast, ...)
    raise an error naming the backends where they work; wrap_optimizer applies each worker's
    own gradient (there is no mean to take);
  - execution is at-least-once: a chunk lost with a dead worker is run again elsewhere. The
    history has exactly `steps` rows (one per scheduled step that returned); a counter of our
    own, a plain variable on a parameter server, counts the steps really executed (Keras's
    optimizer.iterations undercounts here, its increment is not atomic across workers);
  - a dead worker is survivable (the run goes on, the event is in run.events and the history's
    `workers` column); a dead parameter server is not: the run stops within seconds with an
    error that points at the last checkpoint.
"""

from __future__ import annotations

import gc
import json
import time
import weakref

from workbench._src.core.errors import ConfigurationError, WorkerError, check_positive_int
from workbench._src.core.replicator import Replicator
from workbench._src.core.tf_setup import tf
from workbench._src.launch import runtime

SERVER_MODULE = "workbench._src.launch.server_main"
_connected = None  # weakref to the replicator whose cluster this process uses (one at a time)


class MultiWorkerAsyncReplicator(Replicator):
    """Asynchronous data parallelism: workers step independently on parameter-server variables.

    Args:
      num_workers: worker servers (cluster=None: started on this machine, reachable from it only).
      num_ps: parameter servers; variables are spread over them.
      cluster: a real cluster instead: "TF_CONFIG", "slurm", a TF_CONFIG-style dict, or a
        tf.distribute cluster resolver whose spec has "worker" and "ps" jobs. This process
        is the coordinator ("chief").
      startup_timeout: seconds for the local servers to come up.
      heartbeat_timeout: a local coordinator process silent this long is declared frozen.
      threads_per_server: TensorFlow threads in each local server (None: TensorFlow's choice).

    Example (the model is built in the coordinator process from the setup function):
      >>> import workbench as wb
      >>> repl = wb.MultiWorkerAsyncReplicator(num_workers=2, num_ps=1)
      >>> repl.num_replicas, repl.runs_in_processes
      (2, True)
    """

    backend = "async-ps"
    synchronous = False

    def __init__(
        self,
        num_workers: int = 2,
        num_ps: int = 1,
        cluster=None,
        *,
        startup_timeout: float = 120.0,
        heartbeat_timeout: float = 10.0,
        threads_per_server: int | None = None,
        **input_options,
    ):
        super().__init__(**input_options)
        check_positive_int("num_workers", num_workers)
        check_positive_int("num_ps", num_ps)
        self._num_workers, self.num_ps = num_workers, num_ps
        self._cluster_option = cluster
        self.startup_timeout = startup_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.threads_per_server = threads_per_server
        self.coordinator = None
        self.group = None  # the local servers' ProcessGroup (in the coordinator process)
        self.cluster_spec: dict | None = None
        if cluster is None and not runtime.is_launched():
            from workbench._src.launch.launcher import Launcher

            # The coordinator's own start includes the servers': give it their timeout and more.
            self._launcher = Launcher(
                self, startup_timeout=startup_timeout + 60.0, heartbeat_timeout=heartbeat_timeout
            )

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
        return self._num_workers

    @property
    def num_replicas(self) -> int:
        return self._num_workers  # one independent replica per worker

    def describe(self) -> dict:
        return {
            "backend": self.backend,
            "num_replicas": self._num_workers,
            "num_workers": self._num_workers,
            "num_ps": self.num_ps,
            "synchronous": False,
        }

    # ----- the cluster -------------------------------------------------------------------
    def _make_strategy(self):
        global _connected
        t = tf()
        previous = _connected() if _connected is not None else None
        if previous is not None and previous is not self:
            # One process talks to one cluster: connecting rewires TensorFlow's context.
            previous.shutdown(reason="another async-ps replicator connected")
        resolver = self._resolver()
        strategy = t.distribute.ParameterServerStrategy(resolver)
        self.coordinator = t.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            # Our own exact step counter (see the module docstring): a raw variable on a PS.
            self.executed_steps = t.Variable(0, dtype=t.int64, trainable=False, name="workbench_steps")
        _connected = weakref.ref(self)
        return strategy

    def _resolver(self):
        t = tf()
        if self._cluster_option is not None:
            from workbench._src.core.cluster_resolver import cluster_resolver

            resolver = cluster_resolver(self._cluster_option)
            spec = resolver.cluster_spec().as_dict()
            self._num_workers = len(spec.get("worker", []))
            self.num_ps = len(spec.get("ps", []))
            return resolver
        from workbench._src.launch.processes import ProcessGroup, free_ports, port_open

        # Here in a coordinator process the launcher started (in the notebook the replicator is
        # remote and never gets here): its servers are its own children.

        ports = free_ports(self._num_workers + self.num_ps + 1)
        cluster = {
            "worker": [f"127.0.0.1:{p}" for p in ports[: self._num_workers]],
            "ps": [f"127.0.0.1:{p}" for p in ports[self._num_workers : -1]],
            "chief": [f"127.0.0.1:{ports[-1]}"],  # this process, the coordinator
        }
        self.cluster_spec = cluster
        group = ProcessGroup(self.backend, stop_at_exit=False)  # they exit when this process ends
        self.group = group
        env = {"WORKBENCH_CLUSTER": json.dumps(cluster), "CUDA_VISIBLE_DEVICES": ""}
        if self.threads_per_server:
            env["WORKBENCH_WORKER_THREADS"] = str(self.threads_per_server)
        started = time.monotonic()
        try:
            for role in ("ps", "worker"):
                for i in range(len(cluster[role])):
                    group.start(role, i, SERVER_MODULE, env)
            pending = {
                (c.role, c.index): int(cluster[c.role][c.index].rsplit(":", 1)[1]) for c in group.children
            }
            while pending:
                dead = group.unexpected_exits()
                if dead:
                    c = dead[0]
                    raise WorkerError(
                        f"async-ps {c.label} {c.exit_description()} while starting.\n{c.log_tail()}",
                        task=f"{c.role} {c.index}",
                    )
                if time.monotonic() - started > self.startup_timeout:
                    names = ", ".join(f"{r} {i}" for r, i in pending)
                    raise WorkerError(
                        f"async-ps servers {names} did not start within startup_timeout="
                        f"{self.startup_timeout:.0f} s. Fix: a busy machine needs a longer startup_timeout.",
                        task=names,
                    )
                pending = {k: p for k, p in pending.items() if not port_open(p)}
                time.sleep(0.1)
        except BaseException:
            group.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return t.distribute.cluster_resolver.SimpleClusterResolver(
            t.train.ClusterSpec(cluster), rpc_layer="grpc", task_type="chief", task_id=0
        )

    def shutdown(self, reason: str = "shutdown() called") -> None:
        """Stops the local servers; the next use starts a fresh cluster (variables are lost).

        A remote replicator (in the notebook) has nothing running between runs: every run
        launches its own coordinator and servers and stops them when it ends.
        """
        global _connected
        if self._launcher is not None:
            return
        # Drop what refers to the remote functions and variables while the servers still
        # answer, so TensorFlow's clean-up does not flood the log with connection errors.
        # (Not coordinator._cluster.stop(): it waits forever for a dead worker's handler.)
        self._programs.clear()
        self._created_variables.clear()
        self._strategy, self.coordinator = None, None
        gc.collect()
        if self.group is not None:
            self.group.stop(grace=1.0)
            self.group = None
        self._shutdown_reason = reason
        if _connected is not None and _connected() is self:
            _connected = None

    def _close_launched_process(self) -> None:
        self.shutdown(reason="the coordinator process is ending")

    def _started_processes(self) -> list[dict]:
        """The servers this coordinator process started (reported to the launcher)."""
        if self.group is None:
            return []
        return [{"role": c.role, "index": c.index, "pid": c.pid} for c in self.group.children]

    def _check_servers(self, run=None) -> None:
        """Raises for a dead parameter server, or when no worker is left; reports dead workers
        once (the run goes on with the others)."""
        if self.group is None:
            return
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
                f"every async-ps worker has died (all {self._num_workers}); training cannot go on.",
                task="worker",
            )

    # ----- what the launcher asks ---------------------------------------------------------------
    def _launch_plan(self):
        """One coordinator process; it starts the parameter servers and workers itself."""
        from workbench._src.launch.launcher import Task

        options = {
            "num_workers": self._num_workers,
            "num_ps": self.num_ps,
            "startup_timeout": self.startup_timeout,
            "threads_per_server": self.threads_per_server,
        }
        return [
            Task("coordinator", 0, {**runtime.backend_env(self.backend, options), "CUDA_VISIBLE_DEVICES": ""})
        ]

    def _options_for_processes(self) -> dict:
        return {"input_replication": self.input_replication, "input_split_fn": self.input_split_fn}

    def live_workers(self) -> int:
        if self.group is None:
            return self._num_workers
        return len([c for c in self.group.children if c.role == "worker" and c.popen.poll() is None])

    # ----- what does not exist asynchronously ---------------------------------------------
    def _not_async(self, name: str):
        raise ConfigurationError(
            f"repl.{name} combines values across replicas that step together; under async-ps every "
            "worker steps on its own, so there is nothing to combine with. It works on the "
            "synchronous backends: single, mirrored, multi-worker, tpu. Fix: use one of those, or "
            "keep cross-replica code out of step_fn here."
        )

    def all_reduce(self, x, op="sum"):
        self._not_async("all_reduce")

    def all_sum(self, x):
        self._not_async("all_sum")

    def all_gather(self, x, axis=0):
        self._not_async("all_gather")

    def broadcast(self, x, source=0):
        self._not_async("broadcast")

    def map_reduce(self, fn, x, op="sum"):
        self._not_async("map_reduce")

    def map_gather(self, fn, x):
        self._not_async("map_gather")

    # ----- running -----------------------------------------------------------------------
    def _program(self, step_fn, input_fn):
        key = (step_fn, input_fn)
        if key not in self._programs:
            from workbench._src.backends.async_coordinator import AsyncProgram

            self._programs[key] = AsyncProgram(self, step_fn, input_fn)
        return self._programs[key]

    def run(self, step_fn, input_fn):
        """One step on one worker (whichever is free); returns [its outputs]."""
        if self._launcher is not None:
            return self._launcher.run(step_fn, input_fn)
        return [self._program(step_fn, input_fn).run_one()]

    def _executor(self, program):
        from workbench._src.backends.async_coordinator import CoordinatorExecutor

        return CoordinatorExecutor(program)
