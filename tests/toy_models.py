"""Small models and data shared by the tests (a module, not conftest: `python -m pytest` also
collects notebooks/, whose own conftest.py would shadow `from conftest import ...`)."""

import numpy as np

FEATURES, CLASSES = 8, 4


def make_mlp(seed: int = 0):
    """A small MLP with deterministic initial weights (same on every backend)."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(CLASSES)]
    )


def toy_data(rows: int = 256, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = (x[:, :CLASSES].argmax(axis=1)).astype("int32")
    return x, y


def mlp_setup(repl, shuffle_seed=7):
    """setup(repl) for every backend: the seeded MLP, wrapped Adam, a seeded shuffle of the toy
    data, and an SGD-style step_fn; returns (step_fn, input_fn). Travels to worker processes
    (register this module with cloudpickle.register_pickle_by_value)."""
    import keras
    import tensorflow as tf

    x, y = toy_data()
    with repl.context():
        model = make_mlp(seed=0)
        opt = repl.wrap_optimizer(keras.optimizers.Adam(1e-2))

    def input_fn(ctx):
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(256, seed=shuffle_seed).repeat().batch(32)

    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(yb, logits, from_logits=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return {"loss": loss}

    return step_fn, input_fn


def gated_mlp_setup(flag: str):
    """mlp_setup whose every step waits 50 ms while the file `flag` exists: a test holds the run
    there, far from its end, until it has done what it waits for. The arithmetic is mlp_setup's."""

    def setup(repl):
        import os
        import time

        import tensorflow as tf

        step_fn, input_fn = mlp_setup(repl)

        def pause():
            if os.path.exists(flag):
                time.sleep(0.05)
            return 0

        def gated_step(xb, yb):
            with tf.control_dependencies([tf.py_function(pause, [], tf.int32)]):
                return step_fn(xb, yb)

        return gated_step, input_fn

    return setup
