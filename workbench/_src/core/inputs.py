"""Turning a user's input_fn into the per-replica batches that step_fn receives.

Two replication modes, as in TF-Replicator:
  PER_WORKER  input_fn runs once per worker and yields *global* batches (all of this worker's
              replicas together); `input_split_fn` cuts each one into per-replica parts. The
              default cut is the leading (batch) dimension, which must divide evenly.
  PER_REPLICA input_fn runs once per replica, told its `ctx.replica_id`, and yields that
              replica's own batches.
Both are fed through tf.distribute's input pipeline (prefetching to each device), never through
Python.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
from collections.abc import Callable
from typing import Any

from workbench._src.core.errors import InputError
from workbench._src.core.tf_setup import tf

SPLIT_ASSERT_MARKER = "workbench: global batch not divisible"


class InputReplication(enum.Enum):
    """How input_fn is replicated: once per worker (then split) or once per replica."""

    PER_WORKER = "per_worker"
    PER_REPLICA = "per_replica"


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What input_fn is told about where its data goes.

    Attributes:
      replica_id: this pipeline's replica (PER_REPLICA), or None (PER_WORKER: all local replicas).
      num_replicas: replicas in the whole run (all workers).
      worker_id: this worker's index; 0 on one machine.
      num_workers: workers in the run; 1 on one machine.
      replicas_per_worker: replicas fed by each worker.
      global_batch_size: the batch of one step over all replicas when the caller prescribes one
        (a scaling study does, per configuration); None when input_fn chooses its own batch
        (repl.train, repl.run). Write `ctx.global_batch_size or 128` to serve both.
    """

    replica_id: int | None
    num_replicas: int
    worker_id: int = 0
    num_workers: int = 1
    replicas_per_worker: int = 1
    global_batch_size: int | None = None

    @property
    def batch_size_per_replica(self) -> int | None:
        """The batch each replica's step_fn sees when `global_batch_size` is set, else None."""
        if self.global_batch_size is None:
            return None
        return self.per_replica_batch_size(self.global_batch_size)

    def per_replica_batch_size(self, global_batch_size: int) -> int:
        """The batch each replica sees when the whole run steps on `global_batch_size`."""
        if global_batch_size % self.num_replicas:
            raise InputError(
                f"global batch {global_batch_size} does not divide across {self.num_replicas} "
                "replicas. Fix: choose a global batch that is a multiple of the replica count."
            )
        return global_batch_size // self.num_replicas

    def per_worker_batch_size(self, global_batch_size: int) -> int:
        """This worker's share of a global batch: what its replicas take together per step.

        A PER_WORKER input_fn still yields the *global* batch on every worker (as on one
        machine); tf.distribute keeps each worker's share (auto-sharding by data)."""
        return self.per_replica_batch_size(global_batch_size) * self.replicas_per_worker


def call_input_fn(input_fn: Callable, ctx: InputContext):
    """Calls input_fn(ctx) (or input_fn() when it takes no argument) and returns a Dataset."""
    if not callable(input_fn):
        raise InputError(
            f"input_fn must be a function input_fn(ctx) returning a tf.data.Dataset; received "
            f"{type(input_fn).__name__}. Fix: wrap it, e.g. `def input_fn(ctx): return dataset`."
        )
    result = input_fn(ctx) if _takes_an_argument(input_fn) else input_fn()
    name = getattr(input_fn, "__name__", "input_fn")
    return as_dataset(result, where="input_fn" if name == "input_fn" else f"input_fn ({name})")


def as_dataset(result: Any, where: str = "input_fn"):
    t = tf()
    if isinstance(result, t.data.Dataset):
        return result
    if callable(result):
        # A callable producing nested tensors (e.g. a replay-buffer dequeue): an endless pipeline.
        dataset = t.data.Dataset.from_tensors(0).repeat().map(lambda _: result())
        dataset._workbench_from_callable = True  # a resumed run must not skip through it (resume.py)
        return dataset
    raise InputError(
        f"{where} must return a tf.data.Dataset or a callable that returns nested tensors; it "
        f"returned {type(result).__module__}.{type(result).__qualname__}. Fix: e.g. "
        "`return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(128)`."
    )


def _takes_an_argument(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return bool(positional) or any(p.kind == p.VAR_POSITIONAL for p in params)


def distribute_input(
    strategy,
    input_fn: Callable,
    replication: InputReplication,
    input_split_fn: Callable | None,
    num_workers: int = 1,
    worker_id: int = 0,
    skip: int = 0,
    notes: list | None = None,
):
    """Returns a tf.distribute distributed dataset fed by input_fn under `strategy`.

    skip: batches each pipeline passes over first (a resumed run fast-forwards its input to where
    the checkpoint left it: core/resume.py). Applied to what input_fn returns, before the split,
    so every worker and replica skips the same steps' batches; `notes` collects why that may
    not reproduce them exactly.
    """
    t = tf()
    if not isinstance(replication, InputReplication):
        raise InputError(
            f"input_replication must be wb.InputReplication.PER_WORKER or PER_REPLICA; received "
            f"{replication!r}."
        )
    num_replicas = strategy.num_replicas_in_sync
    local = max(1, num_replicas // max(1, num_workers))

    if replication is InputReplication.PER_WORKER and input_split_fn is None:
        ctx = InputContext(None, num_replicas, worker_id, num_workers, local)
        dataset = _skipped(call_input_fn(input_fn, ctx), skip, notes)
        # Every worker's pipeline yields global batches; tf.distribute cuts each into
        # num_replicas parts and keeps this worker's (data auto-sharding), so it must divide.
        dataset = _check_even_split(dataset, num_replicas)
        options = t.distribute.InputOptions(experimental_fetch_to_device=True)
        return strategy.experimental_distribute_dataset(dataset, options)

    def dataset_fn(tf_ctx):
        wid = tf_ctx.input_pipeline_id
        if replication is InputReplication.PER_REPLICA:
            pipelines = [
                _skipped(
                    call_input_fn(input_fn, InputContext(wid * local + i, num_replicas, wid, num_workers, local)),
                    skip,
                    notes,
                )
                for i in range(local)
            ]
            if local == 1:
                return pipelines[0]
            # tf.distribute hands consecutive elements of a worker's pipeline to its replicas in
            # turn, so interleaving round-robin gives replica i exactly pipeline i's batches.
            order = t.data.Dataset.range(local).repeat()
            return t.data.Dataset.choose_from_datasets(pipelines, order)
        dataset = _skipped(call_input_fn(input_fn, InputContext(None, num_replicas, wid, num_workers, local)), skip, notes)
        # As with the default split: the pipeline yields global batches, cut into one part per
        # replica of the run; this worker keeps its replicas' parts (all of them on one machine).
        split = functools.partial(_split_to_elements, input_split_fn, num_replicas, wid * local, local)
        return dataset.flat_map(split)

    return strategy.distribute_datasets_from_function(dataset_fn)


def _skipped(dataset, batches: int, notes: list | None):
    """The dataset without its first `batches` elements (one element: one step's batch); what
    stands in the way of an exact resume is added to `notes` (resume.pipeline_notes)."""
    if not batches:
        return dataset
    from workbench._src.core.resume import pipeline_notes

    if notes is not None:
        notes.extend(n for n in pipeline_notes(dataset) if n not in notes)
    if getattr(dataset, "_workbench_from_callable", False):
        return dataset  # (skipping would call it `batches` times for nothing)
    return dataset.skip(batches)


def _split_to_elements(input_split_fn, n, first, count, *batch):
    """A global batch cut into n parts by input_split_fn; parts first..first+count-1 as elements."""
    t = tf()
    batch = batch[0] if len(batch) == 1 else batch
    parts = list(input_split_fn(batch, n))
    if len(parts) != n:
        raise InputError(f"input_split_fn must return one part per replica ({n}); it returned {len(parts)}.")
    parts = parts[first : first + count]
    out = t.data.Dataset.from_tensors(parts[0])
    for part in parts[1:]:
        out = out.concatenate(t.data.Dataset.from_tensors(part))
    return out


def _check_even_split(dataset, n: int):
    """Refuses global batches that do not divide by n (statically if possible, else per batch)."""
    t = tf()
    leaves = t.nest.flatten(dataset.element_spec)
    static, dynamic = [], False
    for spec in leaves:
        shape = getattr(spec, "shape", None)
        if shape is None or shape.rank is None:
            dynamic = True
            continue
        if shape.rank == 0:
            raise InputError(
                "PER_WORKER input is split across replicas along its leading (batch) dimension, "
                f"but input_fn yields scalars (element_spec={dataset.element_spec}). Fix: batch "
                "the dataset (`.batch(global_batch_size)`), or use PER_REPLICA input."
            )
        if shape[0] is None:
            dynamic = True
        else:
            static.append(shape[0])
    for size in static:
        if size % n:
            raise InputError(
                f"The global batch of {size} does not divide across {n} replicas (received "
                f"element_spec={dataset.element_spec}). Fix: use a global batch that is a "
                f"multiple of {n} (e.g. {max(n, size // n * n)}), or pass an input_split_fn."
            )
    if n == 1 or not dynamic:
        return dataset

    def assert_divisible(*element):
        checks = [
            t.debugging.assert_equal(
                t.shape(leaf)[0] % n,
                0,
                message=f"{SPLIT_ASSERT_MARKER} across {n} replicas; batch with "
                f"drop_remainder=True or repeat() before batch()",
            )
            for leaf in t.nest.flatten(element)
        ]
        with t.control_dependencies(checks):
            element = t.nest.map_structure(t.identity, element)
        return element[0] if len(element) == 1 else element

    return dataset.map(assert_divisible)
