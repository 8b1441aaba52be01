"""How one configuration of a scaling study is built and measured: the seeded setup, the input
wrapped with the configuration's ScalingContext and batch check, and the measured run (warm-up
first) on any backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Mapping

from workbench._src.core.errors import ConfigurationError
from workbench._src.core.inputs import InputContext, call_input_fn
from workbench._src.core.reaper import discard_programs
from workbench._src.core.tf_setup import tf


@dataclasses.dataclass(frozen=True)
class ScalingContext(InputContext):
    """The InputContext a scaling study gives input_fn and setup; `global_batch_size` is always set.

    input_fn batches its dataset to `ctx.global_batch_size` (PER_WORKER input, the default) or to
    `ctx.batch_size_per_replica` (PER_REPLICA input); the study refuses batches of another size.

    Attributes (besides InputContext's):
      mode: "weak" or "strong".
    """

    mode: str = "weak"


class Build:
    """Builds one configuration: seeds, calls `setup` inside repl.context(), wraps input_fn.

    A plain object rather than a closure so that it pickles (cloudpickle) to the worker
    processes of a multi-worker study, where it runs inside each worker's replicator.
    """

    def __init__(self, setup, step_fn, input_fn, mode: str, global_batch: int, seed: int | None):
        self.setup, self.step_fn, self.input_fn = setup, step_fn, input_fn
        self.mode, self.global_batch, self.seed = mode, global_batch, seed

    def context_for(self, repl) -> ScalingContext:
        workers = repl.num_workers
        return ScalingContext(
            None, repl.num_replicas, getattr(repl, "worker_id", 0), workers, repl.num_replicas // workers,
            global_batch_size=self.global_batch, mode=self.mode,
        )  # fmt: skip

    def __call__(self, repl):
        """(step_fn, input_fn) for `repl` (a worker calls it already inside repl.context(),
        which is re-entrant)."""
        ctx = self.context_for(repl)
        step, inputs = _build(repl, self.setup, self.step_fn, self.input_fn, ctx, self.seed)
        return step, _with_context(
            inputs, self.global_batch, self.mode, check_batch=repl.input_split_fn is None
        )


def measure(repl, build: Build, warmup: int, steps: int, name: str, options: dict):
    """Warm-up steps (tracing) then the measured steps, on any backend; returns (run, compile
    seconds). On a process backend one launch per configuration: `build` travels to the
    workers, the warm-up runs in the same processes, and the per-step times stream back."""

    with batch_errors_translated(build.context_for(repl)):
        run = repl.train(setup=build, steps=steps, warmup=warmup, name=name, **options)
    if not repl.runs_in_processes:
        # This configuration is done: delete its input iterator now, off the main thread
        # (reaper.py), rather than freeze the notebook whenever the garbage collector finds it.
        discard_programs(repl._programs.values())
        repl._programs.clear()
    return run, run.compile_seconds


def _build(repl, setup, step_fn, input_fn, ctx, seed):
    if seed is not None:
        import keras

        keras.utils.set_random_seed(seed)
    if setup is None:
        return step_fn, input_fn
    with repl.context():
        takes_ctx = len(inspect.signature(setup).parameters) >= 2
        built = setup(repl, ctx) if takes_ctx else setup(repl)
    if isinstance(built, Mapping):
        built = (built.get("step_fn"), built.get("input_fn", input_fn))
    elif callable(built):
        built = (built, input_fn)
    if not (isinstance(built, tuple) and len(built) == 2 and all(callable(f) for f in built)):
        raise ConfigurationError(
            "setup(repl) must return (step_fn, input_fn), {'step_fn': ..., 'input_fn': ...}, or "
            f"step_fn alone with input_fn given to scaling_study; it returned {built!r}."
        )
    return built


def _with_context(input_fn: Callable, global_batch: int, mode: str, check_batch: bool = True) -> Callable:
    """input_fn wrapped so it receives a ScalingContext (the core builds a plain InputContext).

    With check_batch, a batch of another size than the configuration's is refused: the study's
    throughput is global batch / step time, so an input_fn that ignores ctx.global_batch_size
    would make every number wrong without any error.
    """

    def scaling_input_fn(ctx: InputContext):
        fields = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(InputContext)}
        fields["global_batch_size"] = global_batch
        scaling_ctx = ScalingContext(**fields, mode=mode)
        dataset = call_input_fn(input_fn, scaling_ctx)
        return _check_batch_size(dataset, scaling_ctx) if check_batch else dataset

    scaling_input_fn.__name__ = getattr(input_fn, "__name__", "input_fn")
    return scaling_input_fn


def _check_batch_size(dataset, ctx: ScalingContext):
    """Refuses batches of another size than this configuration's: statically when the shape is
    known, else with an assertion in the pipeline (reported by `_batch_size_error`)."""

    t = tf()
    per_replica = ctx.replica_id is not None  # PER_REPLICA input: one replica's batch
    # PER_WORKER: every worker yields the global batch (tf.distribute keeps each worker's share).
    expected = ctx.batch_size_per_replica if per_replica else ctx.global_batch_size
    name = "ctx.batch_size_per_replica" if per_replica else "ctx.global_batch_size"
    leaves = t.nest.flatten(dataset.element_spec)
    shape = getattr(leaves[0], "shape", None) if leaves else None
    if shape is None or shape.rank in (None, 0):
        return dataset  # not a batch: the run loop reports it
    if shape[0] is not None:
        if shape[0] != expected:
            raise _batch_size_error(ctx, expected, name, f"{shape[0]} (element_spec={dataset.element_spec})")
        return dataset

    def assert_batch(*element):  # e.g. batch() without drop_remainder: the size is unknown here
        first = t.nest.flatten(element)[0]
        check = t.debugging.assert_equal(
            t.shape(first)[0], expected, message=f"{BATCH_ASSERT_MARKER} {expected} {name}"
        )
        with t.control_dependencies([check]):
            element = t.nest.map_structure(t.identity, element)
        return element[0] if len(element) == 1 else element

    return dataset.map(assert_batch)


BATCH_ASSERT_MARKER = "workbench: scaling study batch size must be"


def _batch_size_error(ctx, expected: int, name: str, received: str) -> ConfigurationError:
    return ConfigurationError(
        f"In this {ctx.mode} scaling configuration ({ctx.num_replicas} replica(s)) input_fn must "
        f"yield batches of {expected} ({name}), but it yields {received}. The study computes "
        f"examples/s from the prescribed batch. Fix: batch to the context's size, e.g. "
        f"`.batch({name}, drop_remainder=True)`."
    )


@contextlib.contextmanager
def batch_errors_translated(ctx):
    """The pipeline assertion of `_check_batch_size`, raised inside, becomes the study's
    ConfigurationError (also when it arrives from a worker as a WorkerError); others pass."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised, translated when it is our assertion
        translated = translated_batch_error(e, ctx)
        if translated is e:
            raise
        raise translated from None


def translated_batch_error(error: BaseException, ctx) -> BaseException:
    """The pipeline assertion of `_check_batch_size` as a ConfigurationError; others unchanged."""
    text = str(error)
    if BATCH_ASSERT_MARKER not in text:
        return error
    expected, name = text.split(BATCH_ASSERT_MARKER, 1)[1].split()[:2]  # TF may add "]" after it
    return _batch_size_error(ctx, int(expected), name.rstrip("].,'\""), "batches of another size")
