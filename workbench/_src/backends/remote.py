"""Backends whose steps, seen from a notebook, run in processes it starts.

Two faces of one backend:
  - `ProcessBackend` subclasses (MultiWorkerReplicator, MultiWorkerAsyncReplicator) are the
    in-process face: a strategy and a device map, as every backend. A launched worker, an async
    coordinator, or any process given `cluster=` is one of them.
  - `RemoteReplicator` is the notebook's face of every such backend: constructing a process
    backend with no cluster, outside a launched process, returns one. It holds the backend's
    `LaunchPlan` (which processes to start) and a Launcher (launch/launcher.py) that starts them,
    ships the work and relays the run. No TensorFlow-distributed state lives here: context()
    only records what a cell builds, and train/run go to the processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys

from workbench._src.core import reaper
from workbench._src.core.cells import CELL_FILENAME, execute_source
from workbench._src.core.errors import ConfigurationError
from workbench._src.core.registry import spec
from workbench._src.core.replicator import Replicator
from workbench._src.core.tracebacks import user_facing
from workbench._src.launch import runtime, shipping
from workbench._src.launch.launcher import Launcher, task_order
from workbench._src.launch.placement import Role, names_a_placement, placement_class


class LaunchPlan:
    """What a remote replicator starts, declared by its backend (a dataclass of the backend's
    settings, e.g. multi_worker.MultiWorkerPlan): its members' roles and how each member's
    environment is made from the members' addresses (launch/placement.py `MemberPlan`). Where
    they run is the placement's: the plan's `cluster` field holds the `cluster=` value that
    names one (None: this machine)."""

    num_workers: int
    startup_timeout: float
    heartbeat_timeout: float
    cluster: object | None

    @property
    def num_replicas(self) -> int:
        raise NotImplementedError

    def describe(self) -> dict:
        """The replicator's description (backend options), as its in-process face gives it."""
        raise NotImplementedError

    def roles(self) -> list[Role]:
        """The members of one pool (launch/placement.py Role), the chief's role first."""
        raise NotImplementedError

    def member_env(self, role: str, index: int, addresses: dict[str, list[str]]) -> dict:
        """The environment (TF_CONFIG, the backend's options) of member `role:index`, from the
        addresses of the members placed, by role (launch/placement.py `MemberPlan`)."""
        raise NotImplementedError

    @property
    def launch_timeout(self) -> float:
        """How long the launcher waits for every process to be ready."""
        return self.startup_timeout

    def _described_cluster(self) -> dict:
        """{"cluster": ...} in describe() when the plan is placed by its `cluster=` value."""
        text = placement_class(self.cluster).describe(self.cluster)
        return {"cluster": text} if text else {}

    def before_placement(self) -> None:
        """What must happen on the calling thread before a placement is made on another one."""
        placement_class(self.cluster).prepare(self.cluster)

    # ----- elastic runs (launch/elastic.py): only a plan with `min_workers` changes its count -----
    def with_workers(self, count: int) -> LaunchPlan:
        """This plan with `count` workers."""
        raise NotImplementedError(f"{type(self).__name__} has no elastic worker count")

    def room_to_grow(self, count: int, busy_nodes: set[str]) -> bool:
        """Whether `count` more workers would fit where this plan places them now (on this
        machine they always do)."""
        return placement_class(self.cluster).room_for(self.cluster, count, busy_nodes)

    # Fields that change how long to wait or keep, not which processes run.
    NOT_SHAPE = ("startup_timeout", "heartbeat_timeout", "idle_timeout", "pool", "memory_growth_limit")

    def shape(self) -> tuple:
        """What defines the processes (a warm pool is reused only by a plan of the same shape)."""
        fields = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]
        return (type(self).__name__, *[(k, v) for k, v in fields if k not in self.NOT_SHAPE])


def check_memory_growth_limit(limit) -> None:
    """A ConfigurationError unless `limit` is a fraction > 0 (the growth a warm process may reach
    over its first runs' size before its pool is renewed: launch/memory.py) or None."""
    if limit is None or (isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit > 0):
        return
    raise ConfigurationError(
        f"memory_growth_limit is how much a warm pool's process may grow over its size after the pool's "
        f"first runs before the pool is renewed, as a fraction; received memory_growth_limit={limit!r}. "
        "Fix: memory_growth_limit=0.05 (5%: a renewal every few runs on a parameter server), the "
        "default 0.25, or None to never renew a pool for its memory."
    )


class ProcessBackend(Replicator):
    """Base of the backends that have a launch plan (`Plan`: a LaunchPlan subclass whose fields
    are the constructor's arguments besides `cluster` and the input options)."""

    Plan: type[LaunchPlan]

    def __new__(cls, *args, **kwargs):
        if "min_workers" in kwargs and "min_workers" not in inspect.signature(cls.__init__).parameters:
            raise ConfigurationError(
                f"min_workers (elastic worker counts) applies to synchronous multi-worker runs, whose "
                f"every worker takes a share of each step; {cls.__name__} was given "
                f"min_workers={kwargs['min_workers']!r}. An async-ps run already goes on without a "
                "lost worker. Fix: leave min_workers out, or use wb.MultiWorkerReplicator."
            )
        arguments = inspect.signature(cls.__init__).bind(None, *args, **kwargs).arguments
        arguments.pop("self")
        input_options = arguments.pop("input_options", {})
        cluster = arguments.pop("cluster", None)
        if names_a_placement(cluster):  # the same processes, placed there (a wb.RayCluster)
            return RemoteReplicator(cls.backend, cls.Plan(**arguments, cluster=cluster), **input_options)
        if cluster is None and not runtime.is_launched():
            return RemoteReplicator(cls.backend, cls.Plan(**arguments), **input_options)
        return super().__new__(cls)

    # ----- what a launched process's entry point calls ----------------------------------
    def started_processes(self) -> list[dict]:
        """Processes this one started itself (reported to the launcher; async-ps: its servers)."""
        return []

    def close_launched_process(self) -> None:
        """Called before a launched process exits hard (os._exit skips every finalizer)."""

    def prepare_launched_process(self) -> None:
        """Called before TensorFlow is imported in a launched process (async-ps: starts its
        servers, so their start overlaps this process's import)."""

    def wait_for_own_servers(self) -> None:
        """Waits until the servers prepare_launched_process started listen (none by default)."""

    def release_run_state(self) -> None:
        """Between two runs of a warm pool: drops what the last run built (compiled programs and
        their input iterators, the variables it recorded, Keras's global state) so memory stays
        flat run after run. The strategy, its cluster and the servers are kept: that is the pool.
        Variables on parameter servers are freed there when their last handle here goes."""
        self._forget_setup_runs()  # (their functions hold the model; their gradients its graphs)
        self._programs.clear()
        self._created_variables.clear()
        keras = sys.modules.get("keras")
        if keras is not None:
            keras.backend.clear_session(free_memory=False)  # layer names, graph, kernel caches
        # (Only what runs made: worker_main froze the process's start. On the reaper thread: the
        # last run's iterators can take seconds to destroy, and the next run need not wait.)
        reaper.collect_garbage()


class RemoteReplicator(Replicator):
    """The notebook's replicator for a backend whose steps run in processes it starts.

    Example:
      >>> import workbench as wb
      >>> repl = wb.MultiWorkerReplicator(num_workers=2)
      >>> type(repl).__name__, repl.backend, repl.num_replicas, repl.runs_in_processes
      ('RemoteReplicator', 'multi-worker', 2, True)
    """

    runs_in_processes = True

    def __init__(self, backend: str, plan: LaunchPlan, **input_options):
        super().__init__(**input_options)
        self.backend = spec(backend).name
        self.synchronous = spec(backend).synchronous
        self.plan = plan
        self.launcher = Launcher(backend, plan)

    # ----- what the notebook sees --------------------------------------------------------
    @property
    def num_replicas(self) -> int:
        return self.plan.num_replicas

    @property
    def num_workers(self) -> int:
        return self.plan.num_workers

    @property
    def processes(self) -> list[dict]:
        """Role, index and pid (and node, where there are several) of every process of the last launch."""
        return self.launcher.last_processes

    @property
    def pool_shape(self) -> tuple:
        """What defines this replicator's processes: replicators of one shape share a warm pool."""
        return self.plan.shape()

    def prestart(self) -> bool:
        """Starts this replicator's worker processes in the background, so the first run finds
        them warm (TensorFlow imported, the cluster formed). What choosing a process backend with
        `%replicate --backend` or the panel does. Returns False when a pool of this shape is
        already up or starting, or pools are off (`pool=False`)."""
        return self.launcher.prestart()

    def shutdown(self) -> None:
        """Ends the warm pool of this replicator's processes (now when idle, else after its run).
        The next run starts fresh ones. Also done after `idle_timeout` and at exit."""
        self.launcher.shutdown()

    def describe(self) -> dict:
        return self.plan.describe()

    @property
    def strategy(self):
        raise ConfigurationError(
            f"This {self.backend} replicator runs its steps in worker processes that it starts, so "
            "this process has no strategy to run steps on; step_fn and the primitives run inside "
            "those processes. Fix: train with a %%replicate cell, repl.train(setup=build, steps=N) "
            "or repl.train(step_fn, input_fn, steps=N) (functions travel to the workers), or run "
            "code in every worker with repl.run_on_workers(fn)."
        )

    @contextlib.contextmanager
    def context(self):
        """Variables built inside are plain local ones, recorded: the notebook can inspect the
        model, each process builds its own, and the trained weights come back into these."""
        with self._recording_variables():
            yield self

    # ----- what goes to the processes ----------------------------------------------------
    @user_facing
    def run(self, step_fn, input_fn):
        per_worker = self.run_on_workers(shipping.OneStep(step_fn, input_fn))
        return [out for worker in per_worker for out in worker]

    def run_on_workers(self, fn, *, timeout: float | None = None) -> list:
        results = self.launcher.launch(self._work(shipping.CallWork(fn)), timeout=timeout)
        return [results[task] for task in sorted(results, key=task_order)]

    @user_facing
    def train(self, step_fn=None, input_fn=None, steps=None, *, setup=None, **options):
        self._check_train_arguments(step_fn, input_fn, setup)
        work = shipping.TrainWork(step_fn=step_fn, input_fn=input_fn, setup=setup)
        return self.launcher.train(self, self._work(work), steps, options, local_variables=None)

    @user_facing
    def train_cell(self, source: str, namespace: dict, steps: int, *, filename=None, **options):
        setup, local_variables = self.setup_from_cell(source, namespace, filename)
        work = self._work(shipping.TrainWork(setup=setup))
        return self.launcher.train(self, work, steps, options, local_variables=local_variables)

    def setup_from_cell(self, source: str, namespace: dict, filename: str | None = None):
        """Runs a cell's source here, in this replicator's recording context, so its mistakes show
        at once and the notebook gets its names (and `model`); returns (a CellSetup that rebuilds
        the cell in each process with the notebook's picklable names, the variables made here)."""
        filename = filename or CELL_FILENAME
        namespace.setdefault("repl", self)
        first = len(self._created_variables)
        with self.context():
            execute_source(source, namespace, filename)
        shipped, _skipped = shipping.picklable_namespace(namespace)
        return shipping.CellSetup(source, shipped, filename), self._created_variables[first:]

    def _work(self, work):
        work.replicator_options = {
            "input_replication": self.input_replication,
            "input_split_fn": self.input_split_fn,
        }
        return work

    def __reduce__(self):
        # A replicator inside a function that travels to the processes becomes, there, the
        # process's own replicator (the in-process face of the same backend).
        return (runtime.process_replicator, ())

    def __repr__(self):
        details = ", ".join(f"{k}={v}" for k, v in self.describe().items() if k != "backend")
        return f"RemoteReplicator({self.backend!r}, {details}, steps in worker processes)"
