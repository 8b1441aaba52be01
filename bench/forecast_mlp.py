"""The model bench/validate_forecast.py trains with `workbench run`: a 256-wide 4-layer MLP on
batches of 16 from memory (the issue's communication-bound case: 1 MB of gradients per step
against well under a millisecond of compute)."""

import keras
import tensorflow as tf

keras.utils.set_random_seed(0)
model = keras.Sequential(
    [keras.Input((256,))] + [keras.layers.Dense(256, activation="relu") for _ in range(4)]
)
optimizer = repl.wrap_optimizer(keras.optimizers.SGD(0.01))  # noqa: F821 - given by the workbench


def input_fn(ctx):
    return tf.data.Dataset.from_tensors(tf.ones([16, 256])).repeat()


def step_fn(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x)))
    optimizer.minimize(loss, model.trainable_variables, tape=tape)
    return {"loss": loss}
