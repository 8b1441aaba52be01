"""repl.train vs the tf.distribute tutorial's loop vs Keras fit, same MLP, data and strategy.

Run: python bench/bench_core.py [--steps 1500] [--replicas 2]
Prints steps/s for each and the ratios the core issue sets targets for:
  repl.train (defaults)          >= 2.0x the tutorial loop, >= 1.0x Keras fit
  repl.train (fusing off, k=1)   >= 1.0x the tutorial loop
Virtual CPUs share this machine's cores: the figures compare loops, not hardware.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--fit-k", type=int, default=20, help="Keras steps_per_execution")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import workbench as wb

    wb.configure_devices(cpus=max(2, args.replicas))
    import keras
    import tensorflow as tf
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16).astype("float32"), y.astype("int32")
    gb = args.batch
    repl = wb.replicator("mirrored", num_replicas=args.replicas)
    strategy = repl.strategy

    def dataset():
        return (
            tf.data.Dataset.from_tensor_slices((x, y))
            .repeat()
            .shuffle(1024, seed=0)
            .batch(gb, drop_remainder=True)
        )

    def make_model():
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(10),
            ]
        )

    results = {}

    # 1. The tutorial's loop: one strategy.run per tf.function call.
    with strategy.scope():
        model = make_model()
        opt = keras.optimizers.SGD(0.05)
        opt.build(model.trainable_variables)
    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    dist = strategy.experimental_distribute_dataset(dataset())
    it = iter(dist)

    def tutorial_step(inputs):
        xb, yb = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_obj(yb, model(xb, training=True)), global_batch_size=gb)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def distributed_train_step(inputs):
        per_replica = strategy.run(tutorial_step, args=(inputs,))
        return strategy.reduce("SUM", per_replica, axis=None)

    def tutorial():
        for _ in range(args.steps):
            loss = distributed_train_step(next(it))
        float(loss)

    # 2. Keras fit with steps_per_execution.
    with strategy.scope():
        fit_model = make_model()
        fit_model.compile(
            keras.optimizers.SGD(0.05),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=args.fit_k,
        )
    fit_ds = dataset()

    def keras_fit():
        fit_model.fit(fit_ds, steps_per_epoch=args.steps, epochs=1, verbose=0)

    # 3. repl.train, defaults and fusing off.
    with repl.context():
        wb_model = make_model()
        wb_opt = repl.wrap_optimizer(keras.optimizers.SGD(0.05))

    def input_fn(ctx):
        return dataset()

    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_obj(yb, wb_model(xb, training=True)))
        grads = tape.gradient(loss, wb_model.trainable_variables)
        wb_opt.apply_gradients(zip(grads, wb_model.trainable_variables))
        return {"loss": loss}

    def input_fn_k1(ctx):  # a separate program, so its compiled loop is measured on its own
        return dataset()

    candidates = {
        "tutorial loop": tutorial,
        f"keras fit k={args.fit_k}": keras_fit,
        "repl.train auto": lambda: repl.train(step_fn, input_fn, steps=args.steps),
        "repl.train k=1": lambda: repl.train(step_fn, input_fn_k1, steps=args.steps, steps_per_execution=1),
    }
    for name, fn in candidates.items():
        fn_warm = fn
        fn_warm()  # trace and warm up
        best = np.inf
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn_warm()
            best = min(best, time.perf_counter() - t0)
        results[name] = args.steps / best
        print(f"{name:22s} {results[name]:8.1f} steps/s", flush=True)

    base = results["tutorial loop"]
    fit = results[f"keras fit k={args.fit_k}"]
    print()
    print(f"repl.train auto / tutorial loop : {results['repl.train auto'] / base:.2f}x (target >= 2.0)")
    print(f"repl.train auto / keras fit     : {results['repl.train auto'] / fit:.2f}x (target >= 1.0)")
    print(f"repl.train k=1  / tutorial loop : {results['repl.train k=1'] / base:.2f}x (target >= 1.0)")


if __name__ == "__main__":
    main()
