"""One model built twice, on one device and under N replicas, from the same weights.

The numerics tools (compare_numerics, batchnorm_report, check_loss_scaling) all need the same
thing: call the user's `setup(repl)` once per replicator (inside `repl.context()`), find the
variables that call created (the replicator records them), copy the one-device values into the
replicated copy, run a step on each, and read every replica's copy of a variable back. `Side` is
one such build; the helpers check that both builds match and saw the same data.

A Side runs steps itself (`Stepper`) rather than through `repl.run`, with the same
`strategy.run` and the same argument handling, but a simpler input path: each global batch is
read eagerly from input_fn's dataset (tf.data autotuning off) and cut into equal consecutive
slices along axis 0, one per replica, which is what PER_WORKER input does. The reason: with
TensorFlow 2.21, deleting a distributed iterator (its per-device prefetch pipelines are
autotuned, whatever the dataset's options) waits for tf.data's tuning thread to wake, measured
here at 2-40 s per iterator with the GIL held, so the kernel stalled whenever the garbage
collector reached a finished comparison. A plain iterator with autotuning off is deleted at once.
Replicators with PER_REPLICA input or an input_split_fn still use `distribute_input`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from workbench._src.backends import replicator
from workbench._src.core import reaper
from workbench._src.core.errors import ConfigurationError, InputError
from workbench._src.core.inputs import (
    InputContext,
    InputReplication,
    _takes_an_argument,
    call_input_fn,
    distribute_input,
)
from workbench._src.core.program import _arguments_for, _validated_outputs, call_compiled
from workbench._src.core.replicator import Replicator
from workbench._src.core.tf_setup import tf

# setup(repl) runs inside repl.context(): it builds the model (and optimizer) and returns either
# step_fn(batch) -> outputs, or a Keras layer to apply to each batch.
SetupFn = Callable[[Any], Any]
_TINY = 1e-30


class Side:
    """One build of `setup` under one replicator: what it returned and the variables it made."""

    def __init__(self, repl, setup: SetupFn, what: str = "setup"):
        if not callable(setup):
            raise ConfigurationError(
                f"{what} must be a function setup(repl) that builds the model inside the "
                f"replicator and returns step_fn (or a Keras layer); received "
                f"{type(setup).__name__}. Example: `def setup(repl): model = make_model(); "
                "opt = repl.wrap_optimizer(keras.optimizers.SGD(0.1)); ...; return step_fn`."
            )
        self.repl = repl
        self._steppers: dict = {}
        self._start = len(repl._created_variables)  # the replicator may hold earlier variables
        with repl.context():
            self.product = setup(repl) if _takes_an_argument(setup) else setup()

    @property
    def variables(self) -> list:
        """Variables created by setup, then by lazily built optimizers, in creation order."""
        return self.repl._created_variables[self._start :]

    def build_layer(self, feature_shape) -> None:
        """Builds a returned Keras layer for inputs of shape (batch, *feature_shape)."""
        if not getattr(self.product, "built", True):
            with self.repl.context():
                self.product.build((None, *feature_shape))

    def values(self) -> list[np.ndarray]:
        return [np.array(v.numpy()) for v in self.variables]

    def copies(self, variable) -> list[np.ndarray]:
        """Every replica's copy of `variable` (one entry for a one-device side)."""
        local = self.repl.strategy.experimental_local_results(tf_variable(variable))
        return [np.array(c.numpy()) for c in local]

    def load(self, values: list[np.ndarray]) -> None:
        """Assigns `values` to the variables, in order (every replica's copy of each)."""
        for v, value in zip(self.variables, values):
            v.assign(value)

    def run(self, step_fn: Callable, input_fn: Callable) -> list:
        """One step (the next batch of input_fn); the per-replica outputs as numpy values."""
        key = (step_fn, input_fn)
        if key not in self._steppers:
            self._steppers[key] = Stepper(self.repl, step_fn, input_fn)
        return [tf().nest.map_structure(np.asarray, o) for o in self._steppers[key]()]


class Stepper:
    """step_fn on input_fn's batches under one replicator, one step per call (see the module doc)."""

    def __init__(self, repl, step_fn: Callable, input_fn: Callable):
        t = tf()
        self.repl, self.step_fn, self.steps = repl, step_fn, 0
        n = repl.num_replicas
        self.split = repl.input_replication is InputReplication.PER_WORKER and repl.input_split_fn is None
        if self.split and repl.num_workers == 1:
            options = t.data.Options()
            options.autotune.enabled = False  # no tuning thread to wait for on deletion
            dataset = call_input_fn(input_fn, InputContext(None, n, 0, 1, n))
            self.iterator = iter(dataset.with_options(options))
        else:
            self.split = False
            self.iterator = iter(
                distribute_input(
                    repl.strategy,
                    input_fn,
                    repl.input_replication,
                    repl.input_split_fn,
                    num_workers=repl.num_workers,
                    worker_id=repl.worker_id,
                )
            )
        # A Stepper sits in a reference cycle (its compiled method): the collector frees it on
        # whatever thread it runs, and deleting a distributed iterator there can freeze that
        # thread 10-40 s (core/reaper.py). The reaper deletes it instead.
        reaper.adopt(self)
        self.compiled = t.function(self._replicated)

    def _next_batch(self):
        batch = next(self.iterator)
        if not self.split:
            return batch
        t, n = tf(), self.repl.num_replicas

        def check(v):
            v = t.convert_to_tensor(v)
            if v.shape.rank == 0 or v.shape[0] % n:
                raise InputError(
                    f"A global batch from input_fn does not divide across {n} replicas: received "
                    f"a part of shape {v.shape}. Fix: use a global batch that is a multiple of {n} "
                    "(batch with drop_remainder=True, or repeat() before batch())."
                )
            return v

        batch = t.nest.map_structure(check, batch)

        def replica_slice(ctx):
            r = ctx.replica_id_in_sync_group
            return t.nest.map_structure(
                lambda v: v[r * (v.shape[0] // n) : (r + 1) * (v.shape[0] // n)], batch
            )

        return self.repl.strategy.experimental_distribute_values_from_function(replica_slice)

    def _call_step_fn(self, batch):
        # the same argument unpacking and output checks as repl.run
        outputs = self.step_fn(*_arguments_for(self.step_fn, batch))
        return _validated_outputs(outputs, getattr(self.step_fn, "__name__", "step_fn"))

    def _replicated(self, batch):
        return self.repl.strategy.run(self._call_step_fn, args=(batch,))

    def __call__(self) -> list:
        try:
            batch = self._next_batch()  # eagerly, on purpose (see the module doc)
        except StopIteration:
            raise InputError(
                f"input_fn's dataset ran out after {self.steps} step(s). Fix: add `.repeat()` "
                "to the dataset, or ask for fewer steps."
            ) from None
        outputs = call_compiled(self.compiled, batch)
        self.steps += 1
        return list(self.repl.strategy.experimental_local_results(outputs))


def variable_names(side: Side) -> list[str]:
    return [v.name.split(":")[0] for v in side.variables]


def check_same_variables(ref: Side, dist: Side) -> list[str]:
    """Names of the reference's variables; refuses two builds that made different variables."""
    a, b = ref.variables, dist.variables
    shapes_a = [tuple(v.shape) for v in a]
    shapes_b = [tuple(v.shape) for v in b]
    if not a:
        raise ConfigurationError(
            "setup created no variables inside the replicator, so there are no weights to start "
            "both runs from. Fix: build the model inside setup (keras.Input(...) in the model, "
            "model.build(shape), or call it once on a sample batch) and return step_fn."
        )
    if shapes_a != shapes_b:
        raise ConfigurationError(
            "setup built different variables on one device and under the replicator "
            f"(one device: {len(a)} variables {shapes_a[:6]}..., replicated: {len(b)} "
            f"{shapes_b[:6]}...). Fix: make setup deterministic: build the same model every "
            "call, and create the variables in setup rather than on the first step."
        )
    return variable_names(ref)


def fingerprinted(step_fn: Callable) -> Callable:
    """step_fn whose outputs also carry a float64 checksum of the batch it received.

    Keeps step_fn's signature (functools.wraps), so the batch is passed to it as before.
    """

    @functools.wraps(step_fn)
    def with_fingerprint(*args, **kwargs):
        t = tf()
        outputs = step_fn(*args, **kwargs)
        leaves = [x for x in t.nest.flatten((args, kwargs)) if _is_numeric(x)]
        total = sum((t.reduce_sum(t.cast(x, t.float64)) for x in leaves), t.constant(0.0, t.float64))
        return {"outputs": {} if outputs is None else outputs, "fingerprint": total}

    return with_fingerprint


def check_fingerprints(ref_out: list, dist_out: list, step: int) -> None:
    """Raises when the two runs did not see the same global batch (e.g. an unseeded shuffle)."""
    a = float(ref_out[0]["fingerprint"])
    b = float(sum(o["fingerprint"] for o in dist_out))
    if not np.isclose(a, b, rtol=1e-7, atol=1e-9):
        raise InputError(
            f"At step {step} the one-device run and the replicated run received different data "
            f"(checksum of the global batch: {a:.9g} vs {b:.9g} summed over replicas). The "
            "comparison needs input_fn to yield the same global batches every time it is "
            "called. Fix: seed any shuffle (`.shuffle(n, seed=0)`) and random augmentation, "
            "and yield global batches (PER_WORKER input)."
        )


def diff(a: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max |a - ref|, that divided by max |ref|): a norm-wise relative difference."""
    a = np.asarray(a, np.float64)
    ref = np.asarray(ref, np.float64)
    if a.size == 0:
        return 0.0, 0.0
    abs_diff = float(np.max(np.abs(a - ref)))
    return abs_diff, abs_diff / max(float(np.max(np.abs(ref))), _TINY)


def check_count(name: str, value, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigurationError(
            f"{name} must be an integer >= {minimum}; received {name}={value!r}. "
            f"Example: {name}={max(minimum, 4)}."
        )


def make_replicator(replicas, backend: str):
    """A fresh replicator for `replicas` (an int), or the Replicator passed in."""

    if isinstance(replicas, Replicator):
        return replicas
    check_count("replicas", replicas)
    return replicator(backend, num_replicas=replicas)


def tf_variable(v):
    """The tf.Variable behind a keras.Variable (a tf.Variable is returned as it is)."""
    inner = getattr(v, "value", None)
    return inner if inner is not None and not callable(inner) else v  # tf.Variable.value is a method


def _is_numeric(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and (dtype.is_floating or dtype.is_integer or dtype.is_bool)
