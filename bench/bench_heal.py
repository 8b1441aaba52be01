"""What healing costs: periodic checkpoints' throughput, and the time a heal takes.

Run: python bench/bench_heal.py [--steps 3000] [--repeats 3] [--checkpoint-only] [--no-malloc-setting]
     python bench/bench_heal.py --cluster ray=local   (the heal on Ray actors too)

1. Checkpoint cost (issue 40's goal: <= 5%): the digits MLP 64-128-128-10, batch 128, trained on
   one device in this process with checkpoint_every=100 and without (the anchor), interleaved
   `--repeats` times in one invocation; printed: each one's median steps/s and CPU time per step
   and their ratios, and where a periodic save's CPU goes: on the run's thread (the copy at the
   step boundary) and on the writer thread (the hand-over to SaveV2 and the state file,
   core/checkpoints.py; SaveV2's kernel runs on TensorFlow's thread pool, in the process total),
   median CPU-ms per save, and the page faults a save adds (core/save_buffer.py: TensorFlow's
   8 MiB write buffer, faulted in afresh at every save without it). `--no-malloc-setting` runs it
   without core/save_buffer.py's setting (as before it), `--checkpoint-only` skips 2 and 3.
   Then the write alone, timed in this process with nothing else running (load-independent).
2. Heal time (goal: <= 10 s on a local pool): multi-worker x2, max_restarts=1, worker 1
   SIGKILLed at step 300 of 600; printed: run.restarts[0]["seconds"] (the loss known -> the next
   step recorded: new processes, cluster join, restore, retrace) and the steps trained again.
   With --cluster, the same on a Ray-placed pool.
3. With --cluster: the elastic probe (launch/elastic.py) a run on fewer workers makes at each
   checkpoint: the median time of one `room_for` call (Ray's per-node free resources), against
   the time between two checkpoints it is paid once in.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import tempfile
import time


def digits_setup(repl):
    import keras
    import tensorflow as tf
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16).astype("float32"), y.astype("int32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, "relu"),
            keras.layers.Dense(128, "relu"),
            keras.layers.Dense(10),
        ]
    )
    optimizer = repl.wrap_optimizer(keras.optimizers.Adam(1e-3))

    def input_fn(ctx):
        return (
            tf.data.Dataset.from_tensor_slices((x, y))
            .shuffle(2048, seed=0)
            .repeat()
            .batch(128, drop_remainder=True)
        )

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


def steps_per_sec(run) -> float:
    """Over the run's last four fifths (its first calls trace and size the chunks)."""
    history = run.history
    tail = history.iloc[len(history) // 5 :]
    return (len(tail) - 1) / (tail["wall_time"].iloc[-1] - tail["wall_time"].iloc[0])


def timed_saves() -> dict[str, list[float]]:
    """CPU milliseconds of each save on the run's thread and of each write on the writer thread
    (thread CPU time: a loaded machine stretches wall time, not these; wraps core/checkpoints.Saver:
    a bench may look inside)."""
    from workbench._src.core import checkpoints

    times: dict[str, list[float]] = {"on the run's thread": [], "on the writer thread": []}
    for name, key in (("save", "on the run's thread"), ("_write_in_background", "on the writer thread")):
        inner = getattr(checkpoints.Saver, name)

        def timed(*args, _inner=inner, _key=key, **kwargs):
            began = time.thread_time()
            try:
                return _inner(*args, **kwargs)
            finally:
                times[_key].append(1000 * (time.thread_time() - began))

        setattr(checkpoints.Saver, name, timed)
    return times


def minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def steady_run(wb, steps: int, options: dict):
    """A run (in the background) and this process's CPU-ms and page faults per step over its last
    four fifths: its start (tracing the step and, with checkpoints, the save functions: a
    once-per-run cost) is left out, as steps_per_sec leaves it out of the throughput."""
    run = wb.NonReplicator().train(setup=digits_setup, steps=steps, warmup=20, background=True, **options)
    while run.running and run.steps < steps // 5:
        time.sleep(0.005)
    began, cpu, faulted = run.steps, time.process_time(), minor_faults()
    run.wait()
    counted = max(1, run.steps - began)
    return run, 1000 * (time.process_time() - cpu) / counted, (minor_faults() - faulted) / counted


def checkpoint_cost(wb, steps: int, repeats: int) -> None:
    """Wall-clock steps/s, and this process's CPU time per step: on a busy machine the wall
    clock varies 2-3x between runs, while the CPU a run spends varies less (it counts the
    saver's thread too: a background write moves time off the run's thread, not off the CPU)."""
    saves = timed_saves()
    measured: dict[str, list[float]] = {"none": [], "every 100": []}
    cpu: dict[str, list[float]] = {"none": [], "every 100": []}
    faults: dict[str, list[float]] = {"none": [], "every 100": []}
    for _ in range(repeats):
        for label, every in (("none", None), ("every 100", 100)):
            folder = tempfile.mkdtemp(prefix="bench-heal-")
            try:
                options = {"checkpoint_dir": folder, "checkpoint_every": every} if every else {}
                run, cpu_per_step, faults_per_step = steady_run(wb, steps, options)
                cpu[label].append(cpu_per_step)
                faults[label].append(faults_per_step)
                measured[label].append(steps_per_sec(run))
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    print(f"load {os.getloadavg()[0]:.1f} · {steps} steps x {repeats}, interleaved")
    for label, name in (("none", "no checkpoints      "), ("every 100", "checkpoint_every=100")):
        each = ", ".join(f"{v:.0f}" for v in measured[label])
        each_cpu = ", ".join(f"{v:.2f}" for v in cpu[label])
        print(
            f"  {name}  {statistics.median(measured[label]):8.1f} steps/s (each: {each})"
            f"  {statistics.median(cpu[label]):.3f} CPU-ms/step (each: {each_cpu})"
        )
    # Each pair's two runs are neighbours in time: the median of the pairs' ratios follows a
    # machine whose load drifts better than the ratio of the medians.
    wall = statistics.median(e / n for n, e in zip(measured["none"], measured["every 100"]))
    cpu_ratio = statistics.median(n / e for n, e in zip(cpu["none"], cpu["every 100"]))
    print(
        f"  throughput ratio {wall:.3f} (cost {100 * (1 - wall):.1f}%), by CPU time {cpu_ratio:.3f} "
        f"(cost {100 * (1 - cpu_ratio):.1f}%); goal <= 5% (medians of the {repeats} pairs)"
    )
    # (the first save of each run traces its functions: the medians leave it out by their count)
    where = ", ".join(f"{k} {statistics.median(v):.2f} CPU-ms" for k, v in saves.items() if v)
    added = 100 * (statistics.median(faults["every 100"]) - statistics.median(faults["none"]))
    count = len(saves["on the run's thread"])
    print(f"  per save (median of {count}): {where}; {added:.0f} page faults added")
    # The threads' own CPU clocks hardly depend on the load, unlike the ratios above: what the
    # two threads spend per save against 100 steps of the anchor (SaveV2's kernel runs on
    # TensorFlow's thread pool and is not in it: 0.3-0.4 CPU-ms in a fresh process).
    accounted = sum(statistics.median(v) for v in saves.values() if v) / (100 * statistics.median(cpu["none"]))
    print(f"  accounted on the two threads: {100 * accounted:.1f}% of 100 steps' CPU")


def write_cost(wb, saves: int = 40) -> None:
    """The write alone (one SaveV2 of the digits MLP's checkpoint, as the writer thread calls it),
    in this process after its runs and with nothing else running: its CPU time and page faults
    per save do not depend on the machine's load."""
    import tensorflow as tf

    from workbench._src.core import checkpoints

    folder = tempfile.mkdtemp(prefix="bench-heal-")
    try:
        wb.NonReplicator().train(setup=digits_setup, steps=200, checkpoint_dir=folder, checkpoint_every=100)
        reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(folder))
        keys = sorted(reader.get_variable_to_shape_map())
        values = [tf.constant(reader.get_tensor(k)) for k in keys]
        write = tf.function(lambda prefix: checkpoints._save_v2(prefix, keys, values))
        write(tf.constant(os.path.join(folder, "probe-0")))  # (traced here)
        began, faulted = time.process_time(), minor_faults()
        for i in range(saves):
            write(tf.constant(os.path.join(folder, f"probe-{i}")))
        cpu, faults = 1000 * (time.process_time() - began) / saves, (minor_faults() - faulted) / saves
        print(f"  the write alone (SaveV2, {len(keys)} keys, x{saves}): {cpu:.2f} CPU-ms, {faults:.0f} page faults per save")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def heal_time(wb, cluster=None, label="local") -> None:
    repl = wb.MultiWorkerReplicator(num_workers=2, cluster=cluster)
    repl.train(setup=digits_setup, steps=20)  # a warm pool, as in a notebook after its first run
    folder = tempfile.mkdtemp(prefix="bench-heal-")
    try:
        run = repl.train(
            setup=digits_setup, steps=600, checkpoint_dir=folder, checkpoint_every=100, max_restarts=1,
            background=True,
        )  # fmt: skip
        while run.steps < 300 and run.running:
            time.sleep(0.01)
        pid = next(p["pid"] for p in run.processes if p["role"] == "worker" and p["index"] == 1)
        os.kill(pid, signal.SIGKILL)  # (a local Ray instance's actors are processes of this machine too)
        run.wait(600)
        heal = run.restarts[0]
        print(
            f"heal on {label}: {heal['seconds']:.1f} s from the loss to the next step (goal <= 10 s "
            f"local); lost at step {heal['lost_at']}, resumed from {heal['step']}: "
            f"{heal['lost_at'] - heal['step']} steps trained again; load {os.getloadavg()[0]:.1f}"
        )
    finally:
        repl.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


def probe_cost(wb, cluster, calls: int = 50) -> None:
    from workbench._src.placements.ray.capacity import room_for

    cluster.connect()
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        room_for(cluster, 1, set())
        times.append(time.perf_counter() - began)
    print(
        f"elastic probe on {cluster.describe()}: median {statistics.median(times) * 1e3:.2f} ms, "
        f"max {max(times) * 1e3:.2f} ms per checkpoint ({calls} calls); load {os.getloadavg()[0]:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cluster", help="also heal on a Ray-placed pool: ray, ray=ADDRESS or ray=local")
    parser.add_argument("--checkpoint-only", action="store_true", help="only the checkpoint cost (1)")
    parser.add_argument(
        "--no-malloc-setting", action="store_true", help="without core/save_buffer.py's malloc setting"
    )
    args = parser.parse_args()
    import workbench as wb

    if args.no_malloc_setting:
        from workbench._src.core import checkpoints

        checkpoints.keep_save_buffer_allocated = lambda: False
        print("without the save buffer's malloc setting (core/save_buffer.py)")
    checkpoint_cost(wb, args.steps, args.repeats)
    write_cost(wb)
    if args.checkpoint_only:
        return
    heal_time(wb)
    if args.cluster:
        cluster = wb.RayCluster.from_option(args.cluster)
        heal_time(wb, cluster, label=args.cluster)
        probe_cost(wb, cluster)


if __name__ == "__main__":
    main()
