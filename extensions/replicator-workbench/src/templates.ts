/**
 * The input_fn / step_fn template cell that the "insert template" command adds.
 */

import { ISnapshot } from './model';

/** The body: runs inside repl.context() under %%replicate (see workbench/_src/notebook/magics.py). */
const BODY = `# Runs inside repl.context(): variables built here are replicated; \`repl\` is the replicator.
import tensorflow as tf, keras

model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])
optimizer = repl.wrap_optimizer(keras.optimizers.Adam(1e-3))  # averages gradients over replicas

def input_fn(ctx):
    # Global batches, split across replicas along axis 0 (ctx.replica_id / ctx.num_replicas).
    x = tf.random.stateless_normal([1024, 8], seed=[0, 1])
    y = tf.reduce_sum(x, axis=1, keepdims=True)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64, drop_remainder=True)

def step_fn(x, y):
    # One step of ONE replica, written as on one device.
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return {"loss": loss}`;

/**
 * The template cell's source. With a session replicator the magic line reuses it; without one
 * it names a backend, so the cell runs as it is.
 */
export function templateCell(snapshot: ISnapshot | null, steps = 300): string {
  const backend = snapshot?.replicator ? '' : ' --backend mirrored --replicas 2';
  return `%%replicate${backend} --steps ${steps}\n${BODY}\n`;
}
