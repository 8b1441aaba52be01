"""`repl.wrap_optimizer`: TF-Replicator's loss convention on top of a Keras 3 optimizer.

step_fn writes its loss as on one device (the mean over its own batch). The wrapped optimizer
makes the applied gradient the *mean* over replicas, so N replicas stepping on N batches equal
one device stepping on their concatenation. (A plain Keras optimizer under tf.distribute sums
gradients over replicas instead; that is tf.distribute's convention, kept for unwrapped ones.)

How: Keras 3 already all-reduces gradients with a SUM in replica context, so dividing each
replica's gradient by N first gives the mean with a single all-reduce. Gradient clipping is
applied by Keras before its all-reduce, i.e. to each replica's share; when the optimizer clips,
the wrapper takes the mean itself and clips the global gradient first, so clipping acts exactly
as on one device (Keras's own clip then sees a gradient N times smaller and changes nothing).
"""

from __future__ import annotations

import weakref

from workbench._src import compat
from workbench._src.core.errors import ConfigurationError
from workbench._src.core.tf_setup import tf


class ReplicatedOptimizer:
    """A Keras optimizer whose updates average gradients across replicas. Made by wrap_optimizer.

    Attribute access falls through to the wrapped optimizer (learning_rate, iterations,
    variables, get_config, ...), so schedules and checkpoints work as with the original.
    """

    def __init__(self, optimizer, replicator):
        if not hasattr(optimizer, "apply_gradients"):
            raise TypeError(
                "wrap_optimizer takes a Keras optimizer (e.g. keras.optimizers.Adam(1e-3)); "
                f"received {type(optimizer).__name__}."
            )
        _refuse_second_wrap(optimizer)
        self.__dict__["_optimizer"] = optimizer
        self.__dict__["_replicator"] = replicator
        self.__dict__["_checked"] = set()  # ids of the variables already found in the context
        _WRAPPERS[optimizer] = weakref.ref(self)

    @property
    def optimizer(self):
        """The wrapped Keras optimizer (use it for checkpoints: tf.train.Checkpoint(opt=...))."""
        return self._optimizer

    def __getattr__(self, name):
        return getattr(self._optimizer, name)

    def __setattr__(self, name, value):
        setattr(self._optimizer, name, value)

    def apply_gradients(self, grads_and_vars):
        grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
        variables = [v for _, v in grads_and_vars]
        self._check_in_context(variables)
        self._build_if_needed(variables)
        grads = [g for g, _ in grads_and_vars]
        # The replicas that step together: every replica under mirrored / multi-worker, one
        # under parameter servers (each worker applies its own gradient asynchronously).
        context = tf().distribute.get_replica_context()
        n = context.num_replicas_in_sync if context is not None else 1
        if n > 1:
            grads = self._mean_across_replicas(grads, n)
        return self._optimizer.apply_gradients(list(zip(grads, variables)))

    def minimize(self, loss_fn_or_tape_loss, var_list, tape=None):
        """apply_gradients(gradient of the loss) with the cross-replica mean.

        Args:
          loss_fn_or_tape_loss: a zero-argument callable computing the loss, or (with `tape`)
            the loss tensor recorded by that GradientTape.
          var_list: the variables to train (e.g. model.trainable_variables).
          tape: the tf.GradientTape that recorded the loss, when a tensor is given.
        """
        t = tf()
        if tape is None:
            with t.GradientTape() as tape:
                loss = loss_fn_or_tape_loss()
        else:
            loss = loss_fn_or_tape_loss
        grads = tape.gradient(loss, var_list)
        self.apply_gradients(zip(grads, var_list))
        return loss

    def _check_in_context(self, variables):
        """Refuses variables (or an optimizer) made outside this replicator's repl.context():
        TensorFlow fails later with an empty AssertionError or a colocation error from Keras."""
        strategy = self._replicator.strategy
        unchecked = [v for v in variables if id(v) not in self._checked]
        if not unchecked:
            return
        outside = [v for v in unchecked if not _created_in_scope(strategy, v)]
        if outside:
            names = ", ".join(getattr(v, "path", None) or getattr(v, "name", "?") for v in outside[:4])
            more = f" and {len(outside) - 4} more" if len(outside) > 4 else ""
            raise ConfigurationError(
                f"{len(outside)} of the {len(unchecked)} variables given to the wrapped optimizer were not "
                f"created in this {self._replicator.backend} replicator's repl.context() (built outside "
                f"any context, or under another replicator); received {names}{more}. A wrapped optimizer "
                "can only update replicated variables. Fix: build the model and the optimizer inside "
                "`with repl.context():` (e.g. `with repl.context(): model = make_model(); opt = "
                "repl.wrap_optimizer(keras.optimizers.Adam(1e-3))`), then train."
            )
        iterations = getattr(self._optimizer, "iterations", None)
        if iterations is not None and not _created_in_scope(strategy, iterations):
            raise ConfigurationError(
                f"The wrapped optimizer ({type(self._optimizer).__name__}) was created outside this "
                f"{self._replicator.backend} replicator's repl.context(), so its own variables (received "
                f"iterations={getattr(iterations, 'path', None) or iterations.name}) are not replicated. "
                "Fix: create it inside `with repl.context():`, e.g. `opt = "
                "repl.wrap_optimizer(keras.optimizers.Adam(1e-3))` there."
            )
        self._checked.update(id(v) for v in unchecked)

    def _mean_across_replicas(self, grads, n):
        opt = self._optimizer
        clips = any(getattr(opt, a, None) for a in ("clipnorm", "clipvalue", "global_clipnorm"))
        if not clips:
            return [g / n for g in grads]  # Keras's SUM all-reduce then yields the mean
        grads = self._replicator.all_reduce(grads, "mean")
        grads = compat.keras_clip_gradients(opt, grads)  # the optimizer's own clipping rule
        return [g / n for g in grads]

    def _build_if_needed(self, variables):
        # Keras 3 optimizers build their slots lazily; inside a distributed tf.function that
        # fails (NOTES.md). Outside one, build now; inside, ask the caller (Program) to build
        # eagerly under the replicator's scope and trace again.
        if getattr(self._optimizer, "built", True):
            return
        if tf().executing_eagerly():
            self.build(variables)
        else:
            _quiet_expected_coordinator_log()
            raise OptimizerNeedsBuild(self, variables)

    def build(self, variables):
        """Creates the optimizer's slot variables for `variables` under the replicator's scope."""
        with self._replicator.context():
            self._optimizer.build(variables)

    def __repr__(self):
        return f"ReplicatedOptimizer({self._optimizer.__class__.__name__}, replicas={self._replicator.num_replicas})"


# Inner optimizer -> its live wrapper: one Keras optimizer, one wrapper (see _refuse_second_wrap).
_WRAPPERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _refuse_second_wrap(optimizer) -> None:
    if isinstance(optimizer, ReplicatedOptimizer):
        raise ConfigurationError(
            f"wrap_optimizer was given an optimizer that is already wrapped: received {optimizer!r}. "
            "Wrapping it again divides every gradient by the replica count twice (on 2 replicas every "
            "update is halved). Fix: use it as it is; wrap_optimizer takes the plain Keras optimizer, "
            "once: `opt = repl.wrap_optimizer(keras.optimizers.Adam(1e-3))`."
        )
    try:
        previous = _WRAPPERS.get(optimizer)
    except TypeError:  # not weak-referenceable / hashable: nothing to compare with
        return
    previous = previous() if previous is not None else None
    if previous is not None:
        raise ConfigurationError(
            f"This {type(optimizer).__name__} optimizer is already wrapped by wrap_optimizer "
            f"(received the optimizer of {previous!r} again). One Keras optimizer has one set of "
            "slots and one step count; two wrappers around it update it twice as often, or under two "
            "replicators. Fix: use the wrapped optimizer you already have everywhere, or wrap a new "
            "one: `opt = repl.wrap_optimizer(keras.optimizers.Adam(1e-3))`."
        )


def _created_in_scope(strategy, variable) -> bool:
    """strategy.extended.variable_created_in_scope for tf and Keras 3 variables (True if unknown)."""
    inner = variable
    if not isinstance(variable, tf().Variable) and isinstance(variable, _keras_variable()):
        inner = getattr(variable, "value", variable)
    try:
        return bool(strategy.extended.variable_created_in_scope(inner))
    except (AttributeError, NotImplementedError, TypeError):
        return True


class OptimizerNeedsBuild(Exception):
    """Raised while tracing step_fn when a wrapped optimizer has no slots yet; Program catches it."""

    def __init__(self, optimizer: ReplicatedOptimizer, variables):
        super().__init__("a wrapped optimizer must be built before its first traced step")
        self.optimizer = optimizer
        self.variables = variables


COORDINATOR_LOG = "Error reported to Coordinator"
_coordinator_filter_installed = False


def _is_expected_build_request(record) -> bool:
    """A tensorflow log record that only reports our own OptimizerNeedsBuild (then retried)."""
    if not record.getMessage().startswith(COORDINATOR_LOG):
        return False
    error = record.exc_info[1] if record.exc_info else None
    while error is not None:  # autograph re-wraps it (StagingError): walk the chain
        if isinstance(error, OptimizerNeedsBuild):
            return True
        error = error.__cause__ or error.__context__
    # Logged without exc_info (TF formats the message itself): match our exception's text.
    return "OptimizerNeedsBuild" in record.getMessage()


def _quiet_expected_coordinator_log() -> None:
    """Drops MirroredStrategy's "Error reported to Coordinator" log of an OptimizerNeedsBuild.

    A replica thread that raises while tracing reports it to TensorFlow's thread Coordinator,
    which logs the whole traceback (INFO) before the error reaches Program.call_compiled; there
    the request is expected: the optimizer is built and the step traced again. Only records
    whose exception is OptimizerNeedsBuild are dropped; every other coordinator error still logs.
    """
    global _coordinator_filter_installed
    if _coordinator_filter_installed:
        return
    import logging

    # A module-level function, not a lambda: this function runs while step_fn is traced, so
    # AutoGraph converts it, and a lambda made here would be a converted one; logging then
    # called it through AutoGraph, which logs, which called the filter again (RecursionError
    # at the first TensorFlow warning after the filter was installed).
    logging.getLogger("tensorflow").addFilter(_keep_record)
    _coordinator_filter_installed = True


def _keep_record(record) -> bool:
    """The tensorflow logger's filter: drop only our expected optimizer-build request."""
    return not _is_expected_build_request(record)


def _keras_variable():
    import keras

    return keras.Variable
