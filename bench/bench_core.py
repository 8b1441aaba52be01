"""repl.train against the loops a TensorFlow user writes by hand, same model, data and strategy.

Run: python bench/bench_core.py [--models mlp,cnn] [--replicas 1,2] [--repeats 5]

Anchors, all on the replicator's own strategy (1 replica: OneDeviceStrategy; N: MirroredStrategy
over N virtual CPUs):
  hand-fused     `for _ in tf.range(k): strategy.run(step, args=(next(iterator),))` in one
                 tf.function, k steps per call: the fastest loop an expert writes (issue 17)
  seed-003 loop  the tf.distribute tutorial's loop: one strategy.run per tf.function call
  keras fit      model.fit with steps_per_execution
  (and repl.train k=1, fusing off, beside the seed-003 loop: >= 1.0)
Printed per model and replica count: steps/s (median of --repeats timed runs after one warm-up,
candidates interleaved so machine load drifts hit them alike) and the ratios:
  repl.train / hand-fused        goal >= 1.0 (issue 17)
  repl.train / seed-003 loop     >= 2.0 on the MLP (issue 2)
  repl.train / keras fit         >= 1.0 on the MLP (issue 2)
The seed-003 loop and Keras fit run on the MLP only (--all-anchors adds them for the CNN).
Virtual CPUs share this machine's cores: the figures compare loops, not hardware; benchmarks
never assert timings.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_common import private_runs_dir


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--replicas", default="1,2", help="comma-separated replica counts")
    parser.add_argument("--steps", type=int, default=0, help="steps per timed run (0: per model)")
    parser.add_argument("--batch", type=int, default=128, help="global batch")
    parser.add_argument("--fit-k", type=int, default=20, help="Keras steps_per_execution")
    parser.add_argument("--hand-k", type=int, default=100, help="steps per hand-fused call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--all-anchors", action="store_true")
    args = parser.parse_args()
    private_runs_dir("bench-core-runs-")

    import workbench as wb

    replica_counts = [int(r) for r in args.replicas.split(",")]
    wb.configure_devices(cpus=max(2, *replica_counts))
    table = []
    for model_name in args.models.split(","):
        for replicas in replica_counts:
            steps = args.steps or {"mlp": 1500, "cnn": 300}[model_name]
            with_seed_anchors = model_name == "mlp" or args.all_anchors
            table.append(bench_one(model_name, replicas, steps, args, with_seed_anchors))
    print()
    print(
        "model  replicas  train/hand-fused (paired)  train/seed-003  train/keras-fit   (steps/s: train, hand)"
    )
    for row in table:
        print(
            f"{row['model']:5s}  {row['replicas']:8d}  {row['vs_hand']:16.2f} ({row['vs_hand_paired']:.2f})"
            f"  {row.get('vs_seed', float('nan')):14.2f}  {row.get('vs_fit', float('nan')):15.2f}"
            f"   ({row['train']:.0f}, {row['hand']:.0f})"
        )


def make_model(name: str):
    import keras

    keras.utils.set_random_seed(0)
    if name == "mlp":
        layers = [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    else:  # a small CNN on the 8x8 digits
        layers = [
            keras.Input((64,)),
            keras.layers.Reshape((8, 8, 1)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    return keras.Sequential(layers)


def bench_one(model_name: str, replicas: int, steps: int, args, with_seed_anchors: bool) -> dict:
    import keras
    import tensorflow as tf
    from sklearn.datasets import load_digits

    import workbench as wb

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16).astype("float32"), y.astype("int32")
    gb = args.batch
    repl = wb.replicator("single") if replicas == 1 else wb.replicator("mirrored", num_replicas=replicas)
    strategy = repl.strategy
    print(
        f"\n{model_name} on {replicas} replica(s) ({type(strategy).__name__}), {steps} steps per run",
        flush=True,
    )

    def dataset():
        data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().shuffle(1024, seed=0)
        return data.batch(gb, drop_remainder=True)

    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def plain_model_and_step():
        """tf.distribute's convention: plain SGD sums gradients; loss over the global batch."""
        with strategy.scope():
            model = make_model(model_name)
            opt = keras.optimizers.SGD(0.05)
            opt.build(model.trainable_variables)

        def step(inputs):
            xb, yb = inputs
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(
                    loss_obj(yb, model(xb, training=True)), global_batch_size=gb
                )
            opt.apply_gradients(
                zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            )
            return loss

        return step, opt

    candidates = {}

    # 1. Hand-fused: tf.range over strategy.run with next(iterator), k steps per call.
    hand_step, hand_opt = plain_model_and_step()
    hand_iterator = iter(strategy.experimental_distribute_dataset(dataset()))

    @tf.function
    def hand_fused(iterator, n):
        for _ in tf.range(n):
            strategy.run(hand_step, args=(next(iterator),))

    def hand():
        chunk = tf.constant(args.hand_k)
        for _ in range(steps // args.hand_k):
            hand_fused(hand_iterator, chunk)
        int(hand_opt.iterations.numpy())  # wait for the last step

    candidates["hand-fused"] = hand

    if with_seed_anchors:
        # 2. The seed-003 (tf.distribute tutorial) loop: one strategy.run per tf.function call.
        tutorial_step, _ = plain_model_and_step()
        tutorial_iterator = iter(strategy.experimental_distribute_dataset(dataset()))

        @tf.function
        def distributed_train_step(inputs):
            return strategy.reduce("SUM", strategy.run(tutorial_step, args=(inputs,)), axis=None)

        def tutorial():
            for _ in range(steps):
                loss = distributed_train_step(next(tutorial_iterator))
            float(loss)

        candidates["seed-003 loop"] = tutorial

        # 3. Keras fit with steps_per_execution.
        with strategy.scope():
            fit_model = make_model(model_name)
            fit_model.compile(
                keras.optimizers.SGD(0.05),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                steps_per_execution=args.fit_k,
            )
        fit_ds = dataset()
        candidates["keras fit"] = lambda: fit_model.fit(fit_ds, steps_per_epoch=steps, epochs=1, verbose=0)

    # 4. repl.train with its defaults: the model in repl.context(), the wrapped optimizer.
    with repl.context():
        wb_model = make_model(model_name)
        wb_opt = repl.wrap_optimizer(keras.optimizers.SGD(0.05))

    def input_fn(ctx):
        return dataset()

    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_obj(yb, wb_model(xb, training=True)))
        wb_opt.apply_gradients(
            zip(tape.gradient(loss, wb_model.trainable_variables), wb_model.trainable_variables)
        )
        return {"loss": loss}

    candidates["repl.train"] = lambda: repl.train(step_fn, input_fn, steps=steps)
    if with_seed_anchors:

        def input_fn_k1(ctx):  # a program of its own: its compiled one-step loop is timed alone
            return dataset()

        candidates["repl.train k=1"] = lambda: repl.train(
            step_fn, input_fn_k1, steps=steps, steps_per_execution=1
        )

    for fn in candidates.values():
        fn()  # trace and warm up
    times = {name: [] for name in candidates}
    for _ in range(args.repeats):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    rates = {name: steps / statistics.median(ts) for name, ts in times.items()}
    for name, rate in rates.items():
        spread = f"{steps / max(times[name]):.0f}-{steps / min(times[name]):.0f}"
        print(f"  {name:14s} {rate:8.1f} steps/s (median of {args.repeats}; range {spread})", flush=True)
    row = {
        "model": model_name,
        "replicas": replicas,
        "train": rates["repl.train"],
        "hand": rates["hand-fused"],
    }
    row["vs_hand"] = rates["repl.train"] / rates["hand-fused"]
    # Paired: each repeat's two runs were back to back, so load drifts cancel in their ratio.
    row["vs_hand_paired"] = statistics.median(h / t for h, t in zip(times["hand-fused"], times["repl.train"]))
    print(
        f"  repl.train / hand-fused     : {row['vs_hand']:.2f}x (goal >= 1.0; "
        f"median of paired ratios {row['vs_hand_paired']:.2f}x)"
    )
    if with_seed_anchors:
        row["vs_seed"] = rates["repl.train"] / rates["seed-003 loop"]
        row["vs_fit"] = rates["repl.train"] / rates["keras fit"]
        print(f"  repl.train / seed-003 loop  : {row['vs_seed']:.2f}x (target >= 2.0 on the MLP)")
        print(f"  repl.train / keras fit k={args.fit_k:<3d}: {row['vs_fit']:.2f}x (target >= 1.0 on the MLP)")
        k1 = rates["repl.train k=1"] / rates["seed-003 loop"]
        print(f"  repl.train k=1 / seed-003   : {k1:.2f}x (target >= 1.0)")
    return row


if __name__ == "__main__":
    main()
