"""Weak (or strong) scaling of an MLP on scikit-learn's digits over 1, 2, 4, 8 replicas.

    python bench/bench_scaling.py [--mode weak|strong] [--batch 32] [--steps 200] [--out DIR (default runs/scaling)]
    python bench/bench_scaling.py --backend multi-worker --replicas 1,2 [--threads 1]

Writes DIR/scaling-<backend>-<mode>.png and .csv and prints the table. On a machine without GPUs
the replicas are virtual CPUs (mirrored) or worker processes (multi-worker) sharing the physical
cores: the figure says so. `--threads` limits each worker's TensorFlow threads (multi-worker).
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["weak", "strong"], default="weak")
    parser.add_argument("--replicas", default="1,2,4,8")
    parser.add_argument("--batch", type=int, default=32, help="per replica (weak) or global (strong)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps-per-execution", type=int, default=20)
    parser.add_argument("--backend", choices=["mirrored", "multi-worker"], default="mirrored")
    parser.add_argument("--threads", type=int, default=None, help="TF threads per worker (multi-worker)")
    parser.add_argument("--out", default="runs/scaling")
    args = parser.parse_args()
    replicas = [int(n) for n in args.replicas.split(",")]

    import workbench as wb

    wb.configure_devices(cpus=max(8, *replicas))
    import keras
    import pandas as pd
    import tensorflow as tf
    from sklearn.datasets import load_digits

    from workbench._src.studies.scaling import SUMMARY_COLUMNS

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype("float32"), y.astype("int32")

    def setup(repl):
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        optimizer = repl.wrap_optimizer(keras.optimizers.Adam(1e-3))

        def input_fn(ctx):
            ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2048, seed=0).repeat()
            return ds.batch(ctx.global_batch_size, drop_remainder=True).prefetch(2)

        def step_fn(images, labels):
            with tf.GradientTape() as tape:
                logits = model(images, training=True)
                loss = tf.reduce_mean(
                    keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
                )
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return {"loss": loss}

        return step_fn, input_fn

    os.makedirs(args.out, exist_ok=True)
    options = {"threads_per_worker": args.threads} if args.backend == "multi-worker" else {}
    name = f"scaling-{args.backend}-{args.mode}"
    study = wb.scaling_study(
        setup=setup,
        backend=args.backend,
        replicas=replicas,
        mode=args.mode,
        batch_size=args.batch,
        steps=args.steps,
        warmup=args.warmup,
        steps_per_execution=args.steps_per_execution,
        reference="tf-replicator-resnet50",
        path=os.path.join(args.out, f"{name}.png"),
        **options,
    )
    study.table.to_csv(os.path.join(args.out, f"{name}.csv"), index=False)
    cols = [*SUMMARY_COLUMNS, "compile_seconds", "devices_kind", "physical_cores", "threads_per_replica"]
    with pd.option_context("display.width", 200, "display.float_format", "{:.4g}".format):
        print(study.table[cols].to_string(index=False))
    print(study.table["threads_note"].iloc[-1])
    print("figure:", study.path)


if __name__ == "__main__":
    main()
