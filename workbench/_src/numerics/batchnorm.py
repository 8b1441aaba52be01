"""`wb.CrossReplicaBatchNorm`: batch normalisation over the global batch, built on `repl.all_sum`.

Plain batch norm under a replicator normalises each replica's slice with that slice's own mean
and variance, and (Keras 3) keeps a separate copy of the moving statistics on every replica. This
layer makes the statistics global, following TF-Replicator's formulation: every replica adds up
its sum, sum of squares and row count with one all_sum, so all replicas normalise with the mean
and variance of the whole global batch and update identical moving statistics. On one device
(or outside a replicator) it is ordinary batch norm.

Its weights are those of keras.layers.BatchNormalization, in the same order (gamma, beta,
moving_mean, moving_variance), so `set_weights` moves values between the two.

The Keras class is created on first use, so importing workbench does not import TensorFlow.
"""

from __future__ import annotations

from workbench._src.core import primitives
from workbench._src.core.errors import ConfigurationError
from workbench._src.core.tf_setup import tf

_LAYER_CLASS = None


class _KerasClassOnFirstUse(type):
    """Metaclass of the public name: calling it builds the real Keras layer class, then an instance."""

    def __call__(cls, *args, **kwargs):
        return layer_class()(*args, **kwargs)

    def __instancecheck__(cls, obj) -> bool:
        return _LAYER_CLASS is not None and isinstance(obj, _LAYER_CLASS)

    def __getattr__(cls, name):  # from_config, class attributes, ...
        return getattr(layer_class(), name)


class CrossReplicaBatchNorm(metaclass=_KerasClassOnFirstUse):
    """Batch normalisation whose training statistics cover all replicas (a Keras layer).

    Args:
      axis: the feature axis (normalised separately); the other axes are reduced over.
      momentum: moving-average momentum for the inference statistics.
      epsilon: added to the variance before the square root.
      center, scale: learn a shift (beta) and a scale (gamma).
      beta_initializer, gamma_initializer, moving_mean_initializer,
        moving_variance_initializer: Keras initializers, as in BatchNormalization.
      replicator: whose `all_sum` to use; default: the replicator running the step (any
        synchronous tf.distribute strategy).
      **kwargs: Keras layer arguments (name, dtype, trainable, ...).

    In training mode every replica normalises with the mean and variance of the global batch;
    gradients flow through the cross-replica sums, so with `repl.wrap_optimizer` an N-replica
    step equals a one-device step on the global batch. The moving statistics are identical on
    every replica (each replica makes the same update; replica 0's is written to all copies).

    Example:
      >>> import workbench as wb, keras
      >>> repl = wb.replicator("mirrored", num_replicas=4)
      >>> with repl.context():
      ...     model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32),
      ...                               wb.CrossReplicaBatchNorm(), keras.layers.ReLU()])

    To load a saved model that contains it: `keras.saving.load_model(path, custom_objects=
    {"CrossReplicaBatchNorm": wb.CrossReplicaBatchNorm.keras_class()})`.
    """

    @staticmethod
    def keras_class():
        """The underlying keras.layers.Layer subclass (to subclass it or to load saved models)."""
        return layer_class()


def layer_class():
    """Creates (once) and returns the Keras layer class."""
    global _LAYER_CLASS
    if _LAYER_CLASS is None:
        _LAYER_CLASS = _make_layer_class()
    return _LAYER_CLASS


def _make_layer_class():
    t = tf()  # the device layout first, then Keras (which imports TensorFlow)
    import keras

    @keras.saving.register_keras_serializable(package="workbench", name="CrossReplicaBatchNorm")
    class CrossReplicaBatchNorm(keras.layers.Layer):
        __doc__ = globals()["CrossReplicaBatchNorm"].__doc__

        def __init__(
            self,
            axis: int = -1,
            momentum: float = 0.99,
            epsilon: float = 1e-3,
            center: bool = True,
            scale: bool = True,
            beta_initializer="zeros",
            gamma_initializer="ones",
            moving_mean_initializer="zeros",
            moving_variance_initializer="ones",
            replicator=None,
            **kwargs,
        ):
            super().__init__(**kwargs)
            if isinstance(axis, bool) or not isinstance(axis, int):
                raise ConfigurationError(
                    f"CrossReplicaBatchNorm(axis=...) takes one integer axis (the features); "
                    f"received axis={axis!r}. Example: axis=-1 for channels-last data."
                )
            if not 0.0 <= float(momentum) < 1.0 or not float(epsilon) > 0.0:
                raise ConfigurationError(
                    "CrossReplicaBatchNorm needs 0 <= momentum < 1 and epsilon > 0; received "
                    f"momentum={momentum!r}, epsilon={epsilon!r}. Defaults: 0.99 and 1e-3."
                )
            self.axis, self.momentum, self.epsilon = axis, float(momentum), float(epsilon)
            self.center, self.scale = center, scale
            self.beta_initializer = keras.initializers.get(beta_initializer)
            self.gamma_initializer = keras.initializers.get(gamma_initializer)
            self.moving_mean_initializer = keras.initializers.get(moving_mean_initializer)
            self.moving_variance_initializer = keras.initializers.get(moving_variance_initializer)
            self.replicator = replicator
            self.supports_masking = True
            self.gamma = self.beta = None

        def build(self, input_shape):
            rank = len(input_shape)
            if not -rank <= self.axis < rank or input_shape[self.axis] is None:
                raise ConfigurationError(
                    f"CrossReplicaBatchNorm(axis={self.axis}) needs a known size on that axis; "
                    f"received input shape {tuple(input_shape)}. Fix: pass the feature axis of "
                    "your data (e.g. axis=-1) and give the model a known input shape."
                )
            self._axis = self.axis % rank
            self._reduce_axes = [i for i in range(rank) if i != self._axis]
            shape = (input_shape[self._axis],)
            if self.scale:
                self.gamma = self.add_weight(
                    shape=shape, name="gamma", initializer=self.gamma_initializer, autocast=False
                )
            if self.center:
                self.beta = self.add_weight(
                    shape=shape, name="beta", initializer=self.beta_initializer, autocast=False
                )
            # Every replica computes the same update, so "only_first_replica" keeps the copies
            # identical by construction (replica 0's value is written to all of them).
            for name, init in (
                ("moving_mean", self.moving_mean_initializer),
                ("moving_variance", self.moving_variance_initializer),
            ):
                var = self.add_weight(
                    shape=shape,
                    name=name,
                    initializer=init,
                    trainable=False,
                    autocast=False,
                    aggregation="only_first_replica",
                )
                setattr(self, name, var)

        def call(self, inputs, training=None):
            x = t.cast(inputs, t.float32 if inputs.dtype in (t.float16, t.bfloat16) else inputs.dtype)
            moving_mean = t.cast(self.moving_mean, x.dtype)
            moving_variance = t.cast(self.moving_variance, x.dtype)
            if training and self.trainable:
                mean, variance = self._global_moments(x, moving_mean)
                # the same update formula as keras.layers.BatchNormalization
                self.moving_mean.assign(moving_mean * self.momentum + mean * (1.0 - self.momentum))
                self.moving_variance.assign(
                    moving_variance * self.momentum + variance * (1.0 - self.momentum)
                )
            else:
                mean, variance = moving_mean, moving_variance
            shape = [1] * len(x.shape)
            shape[self._axis] = -1

            def broadcastable(v):
                return None if v is None else t.reshape(t.cast(v, x.dtype), shape)

            out = t.nn.batch_normalization(
                x,
                broadcastable(mean),
                broadcastable(variance),
                broadcastable(self.beta),
                broadcastable(self.gamma),
                self.epsilon,
            )
            return t.cast(out, self.compute_dtype)

        def _global_moments(self, x, shift):
            """Mean and (biased) variance over every replica's rows, with one all_sum.

            Sums are taken of x - shift, shift being the moving mean (the same on every replica,
            no gradient): E[(x-s)^2] - E[x-s]^2 loses far less to rounding than E[x^2] - E[x]^2
            once the moving mean approaches the data's mean. Algebraically both are the variance.
            """
            channels = x.shape[self._axis]
            shape = [1] * len(x.shape)
            shape[self._axis] = channels
            shift = t.stop_gradient(shift)
            centred = x - t.reshape(shift, shape)
            count = t.cast(t.size(x), x.dtype) / channels
            local = t.concat(
                [
                    t.reduce_sum(centred, self._reduce_axes),
                    t.reduce_sum(t.square(centred), self._reduce_axes),
                    count[None],
                ],
                axis=0,
            )
            total = self._all_sum(local)  # [sum, sum of squares, rows] over all replicas
            rows = total[-1]
            shifted_mean = total[:channels] / rows
            variance = t.maximum(total[channels : 2 * channels] / rows - t.square(shifted_mean), 0.0)
            return shifted_mean + shift, variance

        def _all_sum(self, value):
            if self.replicator is not None:
                return self.replicator.all_sum(value)
            if not t.distribute.has_strategy() or t.distribute.in_cross_replica_context():
                return value  # one device, or called outside a replica: local statistics
            strategy = t.distribute.get_strategy()
            if strategy.num_replicas_in_sync == 1:
                return value
            return primitives.all_reduce(strategy, value, "sum")

        def compute_output_shape(self, input_shape):
            return input_shape

        def get_config(self):
            config = super().get_config()
            config.update(
                axis=self.axis,
                momentum=self.momentum,
                epsilon=self.epsilon,
                center=self.center,
                scale=self.scale,
                beta_initializer=keras.initializers.serialize(self.beta_initializer),
                gamma_initializer=keras.initializers.serialize(self.gamma_initializer),
                moving_mean_initializer=keras.initializers.serialize(self.moving_mean_initializer),
                moving_variance_initializer=keras.initializers.serialize(self.moving_variance_initializer),
            )
            return config  # the replicator is a runtime choice, not part of the saved model

    CrossReplicaBatchNorm.__qualname__ = "CrossReplicaBatchNorm"  # not "_make_layer_class.<locals>..."
    return CrossReplicaBatchNorm
