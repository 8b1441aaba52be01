"""The Replicator: one TF-Replicator-style face over a tf.distribute strategy.

A backend only says which strategy to build and which devices each replica owns; everything a
user touches (context, wrap_optimizer, primitives, run, train) is here, so every backend behaves
the same and one conformance suite tests them all. Steps run in this process; a backend whose
steps run in processes the notebook starts has its notebook face in backends/remote.py.

What a backend may override (called by this class only, never by the run loop):
  _make_strategy()                  the tf.distribute strategy (required)
  _logical_devices(primary)         the devices of one replica (model parallelism)
  _program(step_fn, input_fn)       the compiled pair (async-ps: traced on its coordinator)
  _executor(program)                what runs its chunks (run_loop.Executor)
  _agree_on_chunk(steps, stop)      one chunk length and stop decision for every process
  _checkpoint_write_directory(dir)  where this process writes checkpoints
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Literal

from workbench._src import compat
from workbench._src.core import cells, primitives, reaper, run_loop
from workbench._src.core.checkpoints import Saver, named_items, restore_latest
from workbench._src.core.errors import ConfigurationError, ReplicaContextError
from workbench._src.core.inputs import InputReplication
from workbench._src.core.optimizer import ReplicatedOptimizer
from workbench._src.core.program import Program
from workbench._src.core.registry import names, spec
from workbench._src.core.run_options import options_from
from workbench._src.core.tf_setup import tf
from workbench._src.core.tracebacks import user_facing


class Replicator:
    """Runs a step_fn on several replicas. Subclasses pick the devices and the strategy.

    Example:
      >>> import workbench as wb, tensorflow as tf, keras
      >>> repl = wb.replicator("mirrored", num_replicas=2)
      >>> with repl.context():
      ...     w = tf.Variable(1.0)
      >>> def input_fn(ctx):
      ...     return tf.data.Dataset.from_tensors(tf.ones([4])).repeat()
      >>> def step_fn(x):
      ...     return {"total": repl.all_sum(tf.reduce_sum(x) * w)}
      >>> [float(o["total"]) for o in repl.run(step_fn, input_fn)]
      [4.0, 4.0]
    """

    backend: str = "?"
    synchronous: bool = True

    def __init__(
        self,
        input_replication: InputReplication = InputReplication.PER_WORKER,
        input_split_fn: Callable | None = None,
    ):
        self.input_replication = input_replication
        self.input_split_fn = input_split_fn
        self._strategy = None
        self._programs: dict = {}
        self._created_variables: list = []
        self._in_context = False  # context() is re-entrant: variables are recorded once
        self._setup_runs: list[_SetupRun] = []  # forgotten once ended, at the next setup= run

    # ----- what a backend provides -------------------------------------------------------
    @classmethod
    def from_replicas(cls, num_replicas: int | None = None, **kwargs):
        """`wb.replicator(name, num_replicas=...)`: a backend whose replica count is not the
        user's to choose refuses one; backends that take it override this."""
        if num_replicas is not None:
            raise ConfigurationError(
                f"The {cls.backend!r} backend chooses its own replica count; received "
                f"num_replicas={num_replicas}. Fix: leave num_replicas out."
            )
        return cls(**kwargs)

    def _make_strategy(self):
        raise NotImplementedError

    def _logical_devices(self, primary_device: str) -> list[str]:
        """The devices of the replica whose first device is `primary_device`."""
        return [primary_device]

    @property
    def num_workers(self) -> int:
        return 1

    @property
    def worker_id(self) -> int:
        return 0

    def describe(self) -> dict:
        """Backend name, replica count and devices, for summaries, run records and the UI."""
        return {"backend": self.backend, "num_replicas": self.num_replicas}

    def _agree_on_chunk(self, steps: int, stop: bool) -> tuple[int, bool]:
        """The chunk length and stop decision all processes of the run use (one process: its own)."""
        return steps, stop

    def _checkpoint_write_directory(self, directory: str) -> str:
        """Where this process writes checkpoints (multi-worker: non-chief workers write aside)."""
        return directory

    # ----- the public face ---------------------------------------------------------------
    runs_in_processes = False  # True for the notebook face of a process backend (remote.py)

    @property
    def spec(self):
        """This backend's declaration (capabilities; core/registry.py)."""
        return spec(self.backend)

    @property
    def strategy(self):
        """The underlying tf.distribute.Strategy (for code that wants TensorFlow's own API)."""
        if self._strategy is None:
            self._strategy = self._make_strategy()
        return self._strategy

    @property
    def num_replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def replica_id(self):
        """This replica's index, as an int32 tensor; only inside step_fn."""
        return primitives.replica_context(self.strategy, "replica_id").replica_id_in_sync_group

    @contextlib.contextmanager
    def context(self):
        """Variables created inside are replicated (one synchronised copy per replica).

        Build the model and the optimizer here. The replicator also remembers the variables, so
        `train(checkpoint_dir=...)` can save them without being told what the model is.
        """
        with self.strategy.scope(), self._recording_variables():
            yield self

    @contextlib.contextmanager
    def _recording_variables(self):
        """Remembers the variables created inside in `_created_variables`, once each: re-entering
        (e.g. a setup function that opens repl.context() again) records nothing twice."""
        if self._in_context:
            yield
            return
        created = self._created_variables

        def record(next_creator, **kwargs):
            v = next_creator(**kwargs)
            created.append(v)
            return v

        self._in_context = True
        try:
            with tf().variable_creator_scope(record):
                yield
        finally:
            self._in_context = False

    def wrap_optimizer(self, optimizer) -> ReplicatedOptimizer:
        """Makes `optimizer` average gradients across replicas (TF-Replicator's convention).

        Write step_fn's loss as on one device (mean over its own batch); an N-replica step then
        equals a one-device step on the N batches together. Several wrapped optimizers can be
        used in one step_fn (e.g. generator and discriminator).
        """
        return ReplicatedOptimizer(optimizer, self)

    # primitives: see workbench/_src/core/primitives.py for their exact definitions
    def all_reduce(self, x, op: Literal["sum", "mean", "max", "min"] = "sum"):
        """Every replica gets op over all replicas' x (nested structures accepted)."""
        return primitives.all_reduce(self._synchronous_strategy("all_reduce"), x, op)

    def all_sum(self, x):
        """Every replica gets the sum over replicas of x."""
        return primitives.all_reduce(self._synchronous_strategy("all_sum"), x, "sum", name="all_sum")

    def all_gather(self, x, axis: int = 0):
        """Every replica gets all replicas' x concatenated along `axis`, in replica order."""
        return primitives.all_gather(self._synchronous_strategy("all_gather"), x, axis)

    def broadcast(self, x, source: int = 0):
        """Every replica gets replica `source`'s x."""
        return primitives.broadcast(self._synchronous_strategy("broadcast"), x, source)

    def map_reduce(self, fn: Callable, x, op: Literal["sum", "mean", "max", "min"] = "sum"):
        """Replica r applies fn to shard r of x (cut along axis 0); results reduced with op."""
        return primitives.map_reduce(self._synchronous_strategy("map_reduce"), fn, x, op)

    def map_gather(self, fn: Callable, x):
        """Replica r applies fn to shard r of x (cut along axis 0); results concatenated."""
        return primitives.map_gather(self._synchronous_strategy("map_gather"), fn, x)

    def _synchronous_strategy(self, primitive: str):
        if not self.synchronous:
            raise ConfigurationError(
                f"repl.{primitive} combines values across replicas that step together; under "
                f"{self.backend} every worker steps on its own, so there is nothing to combine with. "
                f"It works on the synchronous backends: {', '.join(names(synchronous=True))}. Fix: "
                "use one of those, or keep cross-replica code out of step_fn here."
            )
        return self.strategy

    @contextlib.contextmanager
    def logical_device(self, index: int):
        """Places the ops inside on this replica's `index`-th device (model parallelism)."""
        t = tf()
        ctx = primitives.replica_context(self.strategy, "logical_device")
        primary = _replica_primary_device(ctx)
        devices = self._logical_devices(primary)
        if not 0 <= index < len(devices):
            raise ConfigurationError(
                f"logical_device({index}) asked for, but each replica of this {self.backend} "
                f"replicator has {len(devices)} device(s): {devices}. Fix: create the replicator "
                f"with num_gpus_per_replica={index + 1} (or more)."
            )
        with t.device(devices[index]):
            yield devices[index]

    @user_facing
    def run(self, step_fn: Callable, input_fn: Callable):
        """Runs one step of step_fn on every replica; returns the list of per-replica outputs.

        Compiled once per (step_fn, input_fn) pair and cached: calling it in a loop neither
        retraces nor restarts the input pipeline.
        """
        return self._program(step_fn, input_fn).run_one()

    @user_facing
    def train(
        self,
        step_fn: Callable | None = None,
        input_fn: Callable | None = None,
        steps: int | None = None,
        *,
        setup: Callable | None = None,
        **options,
    ):
        """Trains for `steps` steps in the owned run loop; returns a `wb.Run`.

        Args:
          step_fn, input_fn: one replica's step and its input (see the class docstring).
          steps: steps to run.
          setup: instead of step_fn/input_fn: setup(repl) builds the model and optimizer (it
            runs inside repl.context()) and returns (step_fn, input_fn). For backends whose
            steps run in other processes it travels there (pickled by value) and runs in each.
          **options: see `workbench._src.core.run_options.RunOptions` (steps_per_execution, reduce,
            checkpoint_dir, checkpoint, checkpoint_every, resume, on_nonfinite, warmup,
            background, sinks, name).
        """
        self._check_train_arguments(step_fn, input_fn, setup)
        first_variable = len(self._created_variables)
        if setup is not None:
            self._forget_ended_setup_runs()
            earlier = {id(v) for v in self._created_variables}  # (the list holds them: ids stay theirs)
            gradients = compat.custom_gradient_names()
            with self.context():
                step_fn, input_fn = cells.functions_from_setup(setup(self))
        opts = options_from(steps, options)
        program = self._program(step_fn, input_fn)
        saver = None
        if opts.checkpoint_dir:
            if opts.checkpoint is None:
                # The default layout lists the variables made in repl.context(): a wrapped
                # optimizer makes its slots while the step is first traced, so trace it now, or
                # they would be missing from the list (a resumed Adam would start from zero moments).
                program.trace()
            # What this setup built, not what earlier setups of this replicator built too.
            own = self._created_variables[first_variable:] if setup is not None else None
            saver = Saver(
                program,
                opts.checkpoint_dir,
                named_items(self, opts.checkpoint, variables=own),
                resume=opts.resume,
                write_directory=self._checkpoint_write_directory(opts.checkpoint_dir),
            )
        if setup is None:
            return run_loop.train(self, program, self._executor(program), saver, opts)
        record = _SetupRun((step_fn, input_fn), self._created_variables, earlier, gradients)
        self._setup_runs.append(record)
        try:
            run = run_loop.train(self, program, self._executor(program), saver, opts)
        except BaseException:  # (failed, or interrupted in the foreground: it has ended)
            record.ended()
            raise
        run.subscribe(record.on_event)  # (past events replayed: an end meanwhile is not missed)
        return run

    def _forget_ended_setup_runs(self) -> None:
        """Drops the programs and variables of earlier `setup=` runs that have ended. Their
        functions were made for them, so no later call can name their programs again; kept, every
        such run's traced graphs, input iterator and weights stayed with the replicator for good
        (20-40 MiB a run for a digits MLP on mirrored x2). Forgotten when the next one starts, not
        when it ends: until then its variables are still read (a worker process sends them back
        to the notebook; `repl._created_variables` holds them for checkpoints). A run still
        going keeps its own."""
        ended = [record for record in self._setup_runs if record.own is not None]
        if not ended:
            return
        self._setup_runs = [record for record in self._setup_runs if record.own is None]
        gone = set().union(*(record.own for record in ended))
        programs = [self._programs.pop(record.key, None) for record in ended]
        # (in place: repl.context() appends to this very list object)
        self._created_variables[:] = [v for v in self._created_variables if id(v) not in gone]
        reaper.discard_programs([program for program in programs if program is not None])
        # The gradient functions its traces registered for good hold its graphs (compat.py).
        compat.forget_custom_gradients(set().union(*(record.gradients for record in ended)))

    def _forget_setup_runs(self) -> None:
        """Between two runs of a warm pool (release_run_state): every setup= run has ended."""
        for record in self._setup_runs:
            record.ended()
        self._forget_ended_setup_runs()

    def _check_train_arguments(self, step_fn, input_fn, setup) -> None:
        if setup is None and (step_fn is None or input_fn is None):
            raise ConfigurationError(
                "train needs step_fn and input_fn, or setup=build where build(repl) returns them; "
                f"received step_fn={step_fn!r}, input_fn={input_fn!r}, setup=None."
            )

    @user_facing
    def train_cell(self, source: str, namespace: dict, steps: int, *, filename: str | None = None, **options):
        """Runs a `%%replicate` cell's source (or a `workbench run` file) inside repl.context()
        with `repl` bound to this replicator, then trains the step_fn and input_fn it defines.

        For a replicator whose steps run in other processes, the cell runs here first (its
        mistakes show at once and the notebook gets `model`), then in every process; the
        trained weights come back into the variables the cell made here.
        """
        step_fn, input_fn = cells.build_cell(self, source, namespace, filename or cells.CELL_FILENAME)
        return self.train(step_fn, input_fn, steps, **options)

    def run_on_workers(self, fn: Callable, *, timeout: float | None = None) -> list:
        """Runs fn(repl) in every worker process (here: once, in this process); returns the
        results in worker order. For process backends fn is pickled by value (cloudpickle)."""
        return [fn(self)]

    def _executor(self, program):
        """What runs the chunks of `program` in this process (the run loop's executor)."""
        return run_loop.InProcessExecutor(program, agree=self._agree_on_chunk)

    def __reduce__(self):
        raise TypeError(
            f"A {type(self).__name__} cannot be sent to another process; only replicators whose "
            "steps run in worker processes (multi-worker, async-ps) travel with functions."
        )

    def restore(self, checkpoint_dir, checkpoint=None) -> int:
        """Loads the latest checkpoint that `train(checkpoint_dir=...)` wrote; returns its step.

        Build the model (and, to go on training, the optimizer) in `repl.context()` as the run
        that saved it did, on this or any backend (e.g. wb.NonReplicator() to evaluate on one
        device), then call restore. `checkpoint`: what that run was told to save, if it was given
        one (a tf.train.Checkpoint or a dict of trackables); default: the variables created in
        repl.context(), matched in creation order.
        """

        return restore_latest(self, checkpoint_dir, checkpoint)

    # ----- internals ---------------------------------------------------------------------
    def _program(self, step_fn, input_fn):
        key = (step_fn, input_fn)
        if key not in self._programs:
            self._programs[key] = Program(self, step_fn, input_fn)
        return self._programs[key]

    def __repr__(self):
        details = ", ".join(f"{k}={v}" for k, v in self.describe().items() if k != "backend")
        return f"{type(self).__name__}({details})"


class _SetupRun:
    """One `train(setup=...)` run of a replicator: its program's key and, once it has ended, the
    ids of the variables it made (its setup's, and the optimizer slots its first trace made:
    those in the replicator's list then that were not there before it) and the names of the
    gradient functions its traces registered (compat.custom_gradient_names)."""

    def __init__(self, key: tuple, variables: list, earlier: set[int], gradients: set[str]):
        self.key, self._variables, self._earlier, self._gradients = key, variables, earlier, gradients
        self.own: set[int] | None = None  # known when the run has ended
        self.gradients: set[str] = set()

    def on_event(self, event) -> None:
        if event.kind == "ended":
            self.ended()

    def ended(self) -> None:
        if self.own is None:
            self.own = {id(v) for v in self._variables} - self._earlier
            self.gradients = compat.custom_gradient_names() - self._gradients
            self._variables = self._gradients = None


def _replica_primary_device(ctx) -> str:
    devices = getattr(ctx, "devices", None)
    if not devices:
        raise ReplicaContextError("logical_device() needs a replica context with known devices.")
    first = devices[0]
    return first[0] if isinstance(first, (list, tuple)) else first
