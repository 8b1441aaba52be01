"""One model built twice, on one device and under N replicas, from the same weights.

The numerics tools (compare_numerics, batchnorm_report, check_loss_scaling) all need the same
thing: call the user's `setup(repl)` once per replicator (inside `repl.context()`), find the
variables that call created (the replicator records them), copy the one-device values into the
replicated copy, run a step on each, and read every replica's copy of a variable back. `Side` is
one such build; the helpers check that both builds match and saw the same data.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from workbench._src.errors import ConfigurationError, InputError
from workbench._src.inputs import _takes_an_argument, call_input_fn
from workbench._src.tf_setup import tf

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
        """One step; the per-replica outputs as numpy values."""
        outputs = self.repl.run(step_fn, input_fn)
        return [tf().nest.map_structure(np.asarray, o) for o in outputs]


def without_autotune(input_fn: Callable) -> Callable:
    """input_fn whose dataset has tf.data autotuning off.

    Each autotuned iterator runs a tuning thread, and deleting the iterator waits for that thread
    to wake, which here often took 20-300 s (with the GIL held: the whole kernel stalls). The
    comparisons build and drop several short-lived pipelines, where tuning buys nothing.
    """

    def quiet_input_fn(ctx):
        t = tf()
        options = t.data.Options()
        options.autotune.enabled = False
        return call_input_fn(input_fn, ctx).with_options(options)

    return quiet_input_fn


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
    from workbench._src.backends import replicator
    from workbench._src.replicator import Replicator

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
