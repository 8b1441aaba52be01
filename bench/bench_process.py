"""Process backends on the digits MLP: weak scaling of multi-worker, async-ps 1 vs 2 workers.

Run: python bench/bench_process.py [--steps 600] [--batch 64] [--threads 1]

Each configuration trains the same MLP 64-128-128-10 (per-worker batch `--batch`, weak scaling:
the global batch grows with the workers) from a fresh local cluster on 127.0.0.1. Every worker
(and parameter server) is limited to `--threads` TensorFlow threads, so on a machine with at
least that many cores per worker the curve shows the backend's overhead, not core sharing. The
anchor is the 1-worker configuration of the same backend, run in the same invocation; the
in-process single-device loop (`repl.train` on wb.NonReplicator) is printed beside it.

Printed per configuration: steps/s, examples/s, weak-scaling efficiency against the 1-worker
point, and start-up time (train() called -> first step recorded: processes, cluster join,
tracing). The machine's core count is printed too: read the efficiencies against it.
"""

from __future__ import annotations

import argparse
import os
import time

import cloudpickle


def digits_setup(batch: int, threads: int | None):
    """setup(repl) for the process backends: builds the MLP, returns (step_fn, input_fn)."""

    def setup(repl):
        import keras
        import tensorflow as tf
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x, y = (x / 16).astype("float32"), y.astype("int32")
        keras.utils.set_random_seed(0)
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
            # Weak scaling: `batch` per worker, so the global batch grows with the workers.
            global_batch = batch * (ctx.num_replicas if repl.synchronous else 1)
            data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().shuffle(1024, seed=ctx.worker_id)
            return data.batch(global_batch, drop_remainder=True)

        def step_fn(images, labels):
            with tf.GradientTape() as tape:
                # The function form: Keras loss *objects* divide by the replica count under
                # tf.distribute, which wrap_optimizer's convention must not get.
                loss = tf.reduce_mean(
                    keras.losses.sparse_categorical_crossentropy(
                        labels, model(images, training=True), from_logits=True
                    )
                )
            optimizer.minimize(loss, model.trainable_variables, tape=tape)
            return {"loss": loss}

        return step_fn, input_fn

    return setup


def measure(run, started: float) -> dict:
    history = run.history
    first_row_time = run.events_first_metrics_time - started
    steady = history.iloc[len(history) // 5 :]  # skip the start (tracing, warm-up chunks)
    seconds = steady["wall_time"].iloc[-1] - steady["wall_time"].iloc[0]
    steps_per_sec = (len(steady) - 1) / seconds
    examples = float(steady["examples_per_sec"].median())
    return {"steps_per_sec": steps_per_sec, "examples_per_sec": examples, "startup_s": first_row_time}


def timed_train(repl, setup, steps, in_process: bool):
    started = time.monotonic()
    marks = {}

    def first_metrics(event):
        if event.kind == "metrics" and "t" not in marks:
            marks["t"] = time.monotonic()

    if in_process:
        with repl.context():
            step_fn, input_fn = setup(repl)
        run = repl.train(step_fn, input_fn, steps, sinks=[first_metrics])
    else:
        run = repl.train(setup=setup, steps=steps, sinks=[first_metrics])
    run.events_first_metrics_time = marks["t"]
    return measure(run, started)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=64, help="per-worker batch")
    parser.add_argument("--threads", type=int, default=1, help="TensorFlow threads per worker/server")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    # This process (the single-device anchor, and the async-ps coordinator) gets the same
    # thread limit as each worker; set before TensorFlow initialises.
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    import workbench as wb

    wb.configure_devices(cpus=1)
    setup = digits_setup(args.batch, args.threads)
    cloudpickle.register_pickle_by_value(__import__("__main__"))
    print(
        f"machine: {os.cpu_count()} cores; {args.threads} TF thread(s) per process; per-worker batch {args.batch}"
    )

    rows = []
    single = timed_train(wb.NonReplicator(), setup, args.steps, in_process=True)
    rows.append(("single (in process)", 1, single))
    for workers in (1, 2):
        repl = wb.MultiWorkerReplicator(num_workers=workers, threads_per_worker=args.threads)
        rows.append(("multi-worker", workers, timed_train(repl, setup, args.steps, in_process=False)))
    for workers in (1, 2):
        repl = wb.MultiWorkerAsyncReplicator(num_workers=workers, num_ps=1, threads_per_server=args.threads)
        try:
            rows.append(("async-ps", workers, timed_train(repl, setup, args.steps, in_process=True)))
        finally:
            repl.shutdown()

    base = {name: r for name, w, r in rows if w == 1}
    print(
        f"{'backend':22} {'workers':>7} {'steps/s':>9} {'examples/s':>11} {'efficiency':>10} {'start-up s':>10}"
    )
    for name, workers, r in rows:
        anchor = base[name]["examples_per_sec"]
        efficiency = r["examples_per_sec"] / (anchor * workers)
        print(
            f"{name:22} {workers:>7} {r['steps_per_sec']:>9.1f} {r['examples_per_sec']:>11.0f} "
            f"{efficiency:>10.2f} {r['startup_s']:>10.1f}"
        )
    mw1 = next(r for n, w, r in rows if n == "multi-worker" and w == 1)
    print(
        f"multi-worker x1 / single in process (examples/s): {mw1['examples_per_sec'] / single['examples_per_sec']:.2f}"
    )


if __name__ == "__main__":
    main()
