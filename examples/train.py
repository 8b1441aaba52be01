"""A training file for `workbench run` (and `workbench scale`): an MLP on scikit-learn's digits.

It plays the part of a `%%replicate` cell: the workbench runs it inside the replicator's context
with `repl` defined, so the model and optimizer built here are replicated; it then trains the
`input_fn` and `step_fn` defined here. With a process backend (multi-worker, async-ps) it runs
once in every worker process, so it does nothing else (no files written, nothing printed).

  workbench run examples/train.py --backend mirrored --replicas 4 --steps 300
  workbench run examples/train.py --backend multi-worker --workers 2 --steps 300
  workbench run examples/train.py --backend async-ps --workers 2 --ps 1 --steps 300
  workbench scale examples/train.py --replicas 1,2,4 --batch-size 32 --steps 50
"""

import keras
import tensorflow as tf
from sklearn.datasets import load_digits

x, y = load_digits(return_X_y=True)  # 1,797 8x8 images, flattened to 64 features
x, y = (x / 16.0).astype("float32"), y.astype("int32")

keras.utils.set_random_seed(0)  # every worker starts from the same weights
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, "relu"), keras.layers.Dense(10)])
optimizer = repl.wrap_optimizer(keras.optimizers.Adam(1e-3))  # noqa: F821 - `repl` is given by the workbench


def input_fn(ctx):  # global batches of 128 (or the batch a scaling study prescribes)
    batch = ctx.global_batch_size or 128
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(2048, seed=0)
        .repeat()
        .batch(batch, drop_remainder=True)
    )


def step_fn(images, labels):  # one replica's step, written as on one device
    with tf.GradientTape() as tape:
        logits = model(images, training=True)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    accuracy = tf.reduce_mean(
        tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32)
    )
    return {"loss": loss, "accuracy": accuracy}
