"""What the live dashboard + progress bar cost repl.train: same process, same program, on vs off.

Run: python bench/bench_dashboard.py [--steps 4000] [--repeats 8] [--replicas 2] [--frontend widgets]
     python bench/bench_dashboard.py --flush-compare   (the run store: history flushed every 1 s
     ("on") against every 10 s ("off"), both recording; goal <= 1%)
Runs alternate off / on so that drift in this shared machine's load hits both alike. For each run
it reports training throughput from the run's own history (steps after the first, compiling
chunk, over the wall time they took, gaps between chunks included: that is where sinks run and
where a renderer thread would compete) and the end-to-end time of the call. Goal: dashboard on
costs <= 3% of throughput.

"widgets" (default) exercises what a notebook does (tqdm.notebook bar, figure re-rendered into
an ipywidgets Image); outside a kernel the widget messages go nowhere, the work is the same.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--frontend", choices=["widgets", "console"], default="widgets")
    parser.add_argument("--flush-compare", action="store_true", help="run store: 1 s flushes vs 10 s")
    args = parser.parse_args()

    import workbench as wb

    wb.configure_devices(cpus=max(2, args.replicas))
    import keras
    import tensorflow as tf
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16).astype("float32"), y.astype("int32")
    repl = wb.replicator("mirrored", num_replicas=args.replicas)
    with repl.context():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        opt = repl.wrap_optimizer(keras.optimizers.SGD(0.05))
    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def input_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().shuffle(1024, seed=0)
        return ds.batch(args.batch, drop_remainder=True)

    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            loss = loss_obj(yb, logits)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        accuracy = tf.reduce_mean(tf.cast(tf.argmax(logits, 1, output_type=tf.int32) == yb, tf.float32))
        return {"loss": loss, "accuracy": accuracy}

    if args.flush_compare:
        import tempfile

        from workbench._src.sinks import runstore

        wb.set_runs_dir(tempfile.mkdtemp(prefix="bench-runstore-"))
        runstore.install()

    def one(dashboard_on: bool):
        if args.flush_compare:  # "on": the 1 s flush a killed kernel loses at most; "off": 10 s
            runstore.FLUSH_SECONDS = 1.0 if dashboard_on else 10.0
            sinks = []
        else:
            sinks = [wb.ui.dashboard(display=False, frontend=args.frontend)] if dashboard_on else []
        t0 = time.perf_counter()
        run = repl.train(step_fn, input_fn, steps=args.steps, sinks=sinks)
        total = time.perf_counter() - t0
        h = run.history
        first_chunk = int(h["examples_per_sec"].isna().sum())  # untimed: the first call of each train
        # (a program traced by an earlier run has no untimed chunk: time from the run's start)
        seconds = h["wall_time"].iloc[-1] - (h["wall_time"].iloc[first_chunk - 1] if first_chunk else 0.0)
        steps_per_s = (len(h) - first_chunk) / seconds
        dash = sinks[0] if sinks else None
        return steps_per_s, args.steps / total, dash

    print(
        f"warming up (compile, imports) on mirrored x {args.replicas}, {args.steps} steps per run...",
        flush=True,
    )
    one(True)
    one(False)
    results = {False: [], True: []}
    pairs, cpu_share = [], []
    for r in range(args.repeats):
        order = (False, True) if r % 2 == 0 else (True, False)
        pair = {}
        for on in order:
            train_sps, e2e_sps, dash = one(on)
            results[on].append((train_sps, e2e_sps))
            pair[on] = train_sps
            extra = ""
            if dash:
                seconds = args.steps / train_sps
                cpu_share.append(dash.cpu_seconds / seconds)
                extra = f"  renders {dash.renders}, dashboard thread CPU {dash.cpu_seconds:.2f} s ({100 * cpu_share[-1]:.1f}% of a core)"
            print(
                f"repeat {r + 1} dashboard {'on ' if on else 'off'}: {train_sps:8.1f} steps/s training, {e2e_sps:8.1f} steps/s end to end{extra}",
                flush=True,
            )
        pairs.append(pair[True] / pair[False])

    def med(on, i):
        return statistics.median(v[i] for v in results[on])

    print()
    for i, what in ((0, "training throughput"), (1, "end to end (incl. final figure)")):
        off, on = med(False, i), med(True, i)
        print(
            f"{what:32s} off {off:8.1f}  on {on:8.1f} steps/s  on/off {on / off:.3f}  cost {100 * (1 - on / off):+.1f}%"
        )
    ratio = statistics.median(pairs)
    print(
        f"\non/off training throughput, median of {len(pairs)} back-to-back pairs: {ratio:.3f} "
        f"(cost {100 * (1 - ratio):+.1f}%; goal <= {1 if args.flush_compare else 3}%)"
    )
    if args.flush_compare:
        return
    print(
        f"dashboard thread CPU while training: median {100 * statistics.median(cpu_share):.1f}% of one core "
        f"(of {os.cpu_count()} cores): the cost that load noise cannot hide"
    )
    spread = 100 * np.std([v[0] for v in results[False]]) / med(False, 0)
    print(f"(run-to-run spread with the dashboard off: {spread:.1f}%; this machine's cores are shared)")


if __name__ == "__main__":
    main()
