"""Does a warm pool's memory stay flat? RSS of every pool process over many warm runs.

Run: python bench/bench_memory.py [--runs 100] [--backends multi-worker,async-ps]
     python bench/bench_memory.py --cluster ray=local   (the same pools as Ray actors)

Each backend gets one warm replicator (multi-worker x2; async-ps with 2 workers and 1 parameter
server) that trains a small digits MLP for 20 steps `--runs` times. After runs 10, 25, 50 and the
last, the RSS of every process of the pool is read (psutil, by the pids the run reports; a Ray
actor on this machine is a process here too). Printed, per process: RSS after run 10 and after
the last, and the growth between them (issue 39's goal: within 5%). The anchor is the pool's own
10th run, so start-up and the first traces are not counted as growth.
"""

from __future__ import annotations

import argparse
import os

import psutil

CHECKPOINTS = (10, 25, 50)


def digits_setup(repl):
    import keras
    import tensorflow as tf
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16).astype("float32"), y.astype("int32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, "relu"), keras.layers.Dense(10)])
    optimizer = repl.wrap_optimizer(keras.optimizers.Adam(1e-3))

    def input_fn(ctx):
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64, drop_remainder=True)

    def step_fn(images, labels):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
            )
        optimizer.apply_gradients(
            zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        )
        return {"loss": loss}

    return step_fn, input_fn


def rss_by_process(run) -> dict[str, float]:
    """MiB of resident memory of each process of the run's pool, by "role index"."""
    found = {}
    for process in run.processes:
        try:
            found[f"{process['role']} {process['index']}"] = (
                psutil.Process(process["pid"]).memory_info().rss / 2**20
            )
        except psutil.Error:  # (on another node: not readable from here)
            pass
    return found


def measure(wb, backend: str, runs: int, cluster) -> None:
    options = {"num_workers": 2, "cluster": cluster}
    repl = (
        wb.MultiWorkerReplicator(**options)
        if backend == "multi-worker"
        else wb.MultiWorkerAsyncReplicator(num_ps=1, **options)
    )
    seen: dict[int, dict[str, float]] = {}
    pids, renewed = None, []
    try:
        for n in range(1, runs + 1):
            run = repl.train(setup=digits_setup, steps=20)
            assert run.status == "finished", run.stop_reason
            now = sorted(p["pid"] for p in run.processes)
            if pids not in (None, now):
                renewed.append(n)  # launch/pool.py MEMORY_GROWTH_LIMIT: new processes
            pids = now
            if n in CHECKPOINTS or n == runs:
                seen[n] = rss_by_process(run)
    finally:
        repl.shutdown()
    where = f" on {cluster}" if cluster else ""
    marks = [n for n in sorted(seen) if n >= CHECKPOINTS[0]]
    print(
        f"{backend}{where}: RSS (MiB) after runs {', '.join(map(str, marks))}; growth from run 10 to {runs}"
    )
    print(f"  the pool was renewed (MEMORY_GROWTH_LIMIT) before runs: {renewed or 'none'}")
    for name in seen[marks[0]]:
        values = [seen[n].get(name, float("nan")) for n in marks]
        growth = 100 * (values[-1] / values[0] - 1)
        print(f"  {name:<14} {' '.join(f'{v:7.1f}' for v in values)}   {growth:+5.1f}%  (goal within 5%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--backends", default="multi-worker,async-ps")
    parser.add_argument("--cluster", help="place the pools on Ray: ray, ray=ADDRESS or ray=local")
    args = parser.parse_args()
    if args.runs <= CHECKPOINTS[0]:
        parser.error(
            f"--runs must be more than {CHECKPOINTS[0]} (the anchor is run 10); received {args.runs}"
        )
    import workbench as wb

    cluster = wb.RayCluster.from_option(args.cluster) if args.cluster else None
    print(f"load {os.getloadavg()[0]:.1f} at the start")
    for backend in args.backends.split(","):
        measure(wb, backend.strip(), args.runs, cluster)


if __name__ == "__main__":
    main()
