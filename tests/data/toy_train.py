"""A toy training script for `workbench run` (and the process-backend tests).

Run by the workbench inside the replicator's context: `repl` is defined.
"""

import keras
import numpy as np
import tensorflow as tf

keras.utils.set_random_seed(0)
features = np.random.RandomState(0).randn(512, 8).astype("float32")
labels = (features @ np.arange(1, 9, dtype="float32") / 10.0)[:, None]

model = keras.Sequential(
    [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
)
optimizer = repl.wrap_optimizer(keras.optimizers.Adam(0.01))  # noqa: F821 - given by the workbench


def input_fn(ctx):  # 32 examples a step, or the batch a scaling study prescribes
    batch = ctx.global_batch_size or 32
    return tf.data.Dataset.from_tensor_slices((features, labels)).repeat().batch(batch, drop_remainder=True)


def step_fn(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    optimizer.minimize(loss, model.trainable_variables, tape=tape)
    return {"loss": loss}
