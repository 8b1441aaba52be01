"""The Replicator: one TF-Replicator-style face over a tf.distribute strategy.

A backend only says which strategy to build and which devices each replica owns; everything a
user touches (context, wrap_optimizer, primitives, run, train) is here, so every backend behaves
the same and one conformance suite tests them all.

A replicator is one of two kinds. In-process, it has a strategy and its steps run here. Remote
(a local multi-worker or async-ps cluster seen from the notebook), it has a `_launcher` instead
(launch/launcher.py): its steps run in processes the launcher starts, where the same backend
class is in-process; here, context() only records what the cell builds and train/run go to the
launcher. This file is the one place that tells the two apart.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Literal

from workbench._src.core import primitives
from workbench._src.core.errors import ConfigurationError, ReplicaContextError
from workbench._src.core.inputs import InputReplication
from workbench._src.core.optimizer import ReplicatedOptimizer
from workbench._src.core.tf_setup import tf


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
        self._launcher = None  # set by process backends seen from outside their cluster

    # ----- what a backend provides -------------------------------------------------------
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
    @property
    def runs_in_processes(self) -> bool:
        """True when steps run in worker processes this replicator starts, not in this process."""
        return self._launcher is not None

    @property
    def strategy(self):
        """The underlying tf.distribute.Strategy (for code that wants TensorFlow's own API)."""
        if self._launcher is not None:
            raise self._launcher.no_strategy_error()
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
        For a replicator whose steps run in other processes, the variables are built here as
        plain local ones (the notebook can inspect the model; each process builds its own, and
        the trained weights come back into these when training ends).
        """
        if self._launcher is not None:
            with self._recording_variables():
                yield self
            return
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
        return primitives.all_reduce(self.strategy, x, op)

    def all_sum(self, x):
        """Every replica gets the sum over replicas of x."""
        return primitives.all_reduce(self.strategy, x, "sum", name="all_sum")

    def all_gather(self, x, axis: int = 0):
        """Every replica gets all replicas' x concatenated along `axis`, in replica order."""
        return primitives.all_gather(self.strategy, x, axis)

    def broadcast(self, x, source: int = 0):
        """Every replica gets replica `source`'s x."""
        return primitives.broadcast(self.strategy, x, source)

    def map_reduce(self, fn: Callable, x, op: Literal["sum", "mean", "max", "min"] = "sum"):
        """Replica r applies fn to shard r of x (cut along axis 0); results reduced with op."""
        return primitives.map_reduce(self.strategy, fn, x, op)

    def map_gather(self, fn: Callable, x):
        """Replica r applies fn to shard r of x (cut along axis 0); results concatenated."""
        return primitives.map_gather(self.strategy, fn, x)

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

    def run(self, step_fn: Callable, input_fn: Callable):
        """Runs one step of step_fn on every replica; returns the list of per-replica outputs.

        Compiled once per (step_fn, input_fn) pair and cached: calling it in a loop neither
        retraces nor restarts the input pipeline.
        """
        if self._launcher is not None:
            return self._launcher.run(step_fn, input_fn)
        return self._program(step_fn, input_fn).run_one()

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
        from workbench._src.core import run_loop

        if setup is None and (step_fn is None or input_fn is None):
            raise ConfigurationError(
                "train needs step_fn and input_fn, or setup=build where build(repl) returns them; "
                f"received step_fn={step_fn!r}, input_fn={input_fn!r}, setup=None."
            )
        if self._launcher is not None:
            return self._launcher.train(step_fn, input_fn, steps, setup=setup, **options)
        if setup is not None:
            from workbench._src.launch.shipping import unpack_setup

            with self.context():
                step_fn, input_fn = unpack_setup(setup(self))
        return run_loop.train(self, step_fn, input_fn, steps, **options)

    def train_cell(self, source: str, namespace: dict, steps: int, *, filename: str | None = None, **options):
        """Runs a `%%replicate` cell's source (or a `workbench run` file) inside repl.context()
        with `repl` bound to this replicator, then trains the step_fn and input_fn it defines.

        For a replicator whose steps run in other processes, the cell runs here first (its
        mistakes show at once and the notebook gets `model`), then in every process; the
        trained weights come back into the variables the cell made here.
        """
        from workbench._src.core.cells import CELL_FILENAME, execute_source, functions_defined

        filename = filename or CELL_FILENAME
        if self._launcher is not None:
            return self._launcher.train_cell(source, namespace, steps, filename=filename, **options)
        namespace.setdefault("repl", self)
        with self.context():
            execute_source(source, namespace, filename)
        step_fn, input_fn = functions_defined(namespace, where=filename)
        return self.train(step_fn, input_fn, steps, **options)

    def run_on_workers(self, fn: Callable, *, timeout: float | None = None) -> list:
        """Runs fn(repl) in every worker process (here: once, in this process); returns the
        results in worker order. For process backends fn is pickled by value (cloudpickle)."""
        if self._launcher is not None:
            return self._launcher.run_on_workers(fn, timeout=timeout)
        return [fn(self)]

    def _executor(self, program):
        """What runs the chunks of `program` in this process (the run loop's executor)."""
        from workbench._src.core.run_loop import InProcessExecutor

        return InProcessExecutor(program)

    def __reduce__(self):
        # A replicator inside a function that travels to worker processes becomes, there, the
        # process's own replicator (the in-cluster face of the same backend).
        if self._launcher is None:
            raise TypeError(
                f"A {type(self).__name__} cannot be sent to another process; only replicators whose "
                "steps run in worker processes (multi-worker, async-ps) travel with functions."
            )
        from workbench._src.launch.runtime import process_replicator

        return (process_replicator, ())

    def restore(self, checkpoint_dir, checkpoint=None) -> int:
        """Loads the latest checkpoint that `train(checkpoint_dir=...)` wrote; returns its step.

        Build the model (and, to go on training, the optimizer) in `repl.context()` as the run
        that saved it did, on this or any backend (e.g. wb.NonReplicator() to evaluate on one
        device), then call restore. `checkpoint`: what that run was told to save, if it was given
        one (a tf.train.Checkpoint or a dict of trackables); default: the variables created in
        repl.context(), matched in creation order.
        """
        from workbench._src.core.checkpoints import restore_latest

        return restore_latest(self, checkpoint_dir, checkpoint)

    # ----- internals ---------------------------------------------------------------------
    def _program(self, step_fn, input_fn):
        from workbench._src.core.program import Program

        key = (step_fn, input_fn)
        if key not in self._programs:
            self._programs[key] = Program(self, step_fn, input_fn)
        return self._programs[key]

    def __repr__(self):
        details = ", ".join(f"{k}={v}" for k, v in self.describe().items() if k != "backend")
        return f"{type(self).__name__}({details})"


def _replica_primary_device(ctx) -> str:
    devices = getattr(ctx, "devices", None)
    if not devices:
        raise ReplicaContextError("logical_device() needs a replica context with known devices.")
    first = devices[0]
    return first[0] if isinstance(first, (list, tuple)) else first
