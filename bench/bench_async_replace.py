"""How long a lost async-ps worker takes to come back, on a local pool and on Ray actors.

Run: python bench/bench_async_replace.py [--repeats 3] [--cluster ray=local]

async-ps (2 workers, 1 ps) on a warm pool, a small regression trained in chunks of 5 steps; at
step 100 of each run worker 1's server is SIGKILLed (a local Ray instance's actors are processes
of this machine too). Printed per run: the time from the kill to the heal's record reaching this
process (run.restarts), the record's own `seconds` (the loss seen -> the new server answering at
the lost one's address: placements/local/servers.py locally, placements/ray/replace.py on Ray),
and the rows the run recorded on one worker meanwhile (the other went on). Each run is one of the
same warm pool: a replaced worker leaves the pool whole, and the cap is per run.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time


def setup(repl):
    import keras
    import numpy as np
    import tensorflow as tf

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, "relu"), keras.layers.Dense(1)])
    optimizer = repl.wrap_optimizer(keras.optimizers.SGD(0.01))
    features = np.random.RandomState(0).randn(512, 8).astype("float32")
    targets = features @ np.linspace(-1, 1, 8, dtype="float32")[:, None]

    def input_fn(ctx):
        return tf.data.Dataset.from_tensor_slices((features, targets)).repeat().batch(32)

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return {"loss": loss}

    return step_fn, input_fn


def replace_times(wb, repeats: int, cluster=None, label: str = "local") -> None:
    options = {"cluster": cluster} if cluster is not None else {}
    repl = wb.MultiWorkerAsyncReplicator(num_workers=2, num_ps=1, **options)
    try:
        repl.train(setup=setup, steps=20)  # a warm pool, as in a notebook after its first run
        seen, answered = [], []
        for attempt in range(repeats):
            run = repl.train(setup=setup, steps=10**7, steps_per_execution=5, background=True)
            try:
                while run.steps < 100 and run.running:
                    time.sleep(0.01)
                pid = next(p["pid"] for p in run.processes if p["role"] == "worker" and p["index"] == 1)
                killed = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                while not run.restarts and run.running and time.monotonic() - killed < 300:
                    time.sleep(0.01)
                seen.append(time.monotonic() - killed)
            finally:
                run.stop().wait(timeout=120)
            (heal,) = run.restarts
            answered.append(heal["seconds"])
            one = int((run.history["workers"] == 1).sum())
            print(
                f"  {label} run {attempt + 1}: kill -> record here {seen[-1]:.2f} s; loss -> new server "
                f"answering {heal['seconds']:.2f} s; {one} rows on one worker meanwhile; "
                f"load {os.getloadavg()[0]:.1f}"
            )
        print(
            f"{label}: median kill -> record {statistics.median(seen):.2f} s, loss -> answering "
            f"{statistics.median(answered):.2f} s ({repeats} runs)"
        )
    finally:
        repl.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cluster", help="also on a Ray-placed pool: ray, ray=ADDRESS or ray=local")
    args = parser.parse_args()
    from bench_common import private_runs_dir

    private_runs_dir("bench-async-replace-")
    import workbench as wb

    replace_times(wb, args.repeats)
    if args.cluster:
        cluster = wb.RayCluster.from_option(args.cluster)
        replace_times(wb, args.repeats, cluster, label=args.cluster)
        if cluster.address is None:
            cluster.shutdown()


if __name__ == "__main__":
    main()
