"""What run.breakdown() costs: repl.train with the breakdown on (the default) against off.

Run: python bench/bench_breakdown.py [--replicas 1,2] [--steps 3000] [--repeats 7]

The anchor is the same repl.train with breakdown=False, in the same process, on the same
program (one model, one input iterator: the two variants are two traces of the same fused
loop), interleaved on/off so that load drifts hit both alike. Model: bench_core's digits MLP
(64-128-128-10, global batch 128), whose ~1 ms steps make the clock readings' share of a step
as large as it gets; a larger model only lowers it. Printed per replica count: steps/s of each
(median of --repeats) and the ratio on/off (goal >= 0.97), the median of paired ratios, and
the ratio of this process's CPU seconds per step off/on (what the readings cost in work, which
other processes on a shared machine disturb less than wall time).
A run of at most breakdown.EVERY_STEP_UP_TO steps times every step instead of a sample: give
--steps at most that many to measure what that costs.
Benchmarks never assert timings; say the machine's load (printed) with the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench_common import private_runs_dir

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", default="1,2", help="comma-separated replica counts")
    parser.add_argument("--steps", type=int, default=3000, help="steps per timed run")
    parser.add_argument("--batch", type=int, default=128, help="global batch")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    private_runs_dir("bench-breakdown-runs-")

    import workbench as wb

    counts = [int(r) for r in args.replicas.split(",")]
    wb.configure_devices(cpus=max(2, *counts))
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    results = [bench_one(n, args) for n in counts]
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    print("replicas  steps/s on  steps/s off  on/off (median)  on/off (paired)  on/off (CPU per step)")
    for r in results:
        print(
            f"{r['replicas']:8d}  {r['on']:10.0f}  {r['off']:11.0f}  {r['ratio']:15.3f}  {r['paired']:15.3f}"
            f"  {r['cpu']:21.3f}\n          last run: {r['diagnosis']}"
        )


def bench_one(replicas: int, args) -> dict:
    import keras
    import tensorflow as tf
    from bench_core import make_model
    from sklearn.datasets import load_digits

    import workbench as wb

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16).astype("float32"), y.astype("int32")
    repl = wb.replicator("single") if replicas == 1 else wb.replicator("mirrored", num_replicas=replicas)
    with repl.context():
        model = make_model("mlp")
        opt = repl.wrap_optimizer(keras.optimizers.SGD(0.05))
    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def input_fn(ctx):
        data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().shuffle(1024, seed=0)
        return data.batch(args.batch, drop_remainder=True).prefetch(2)

    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_obj(yb, model(xb, training=True))
        opt.minimize(loss, model.trainable_variables, tape=tape)
        return {"loss": loss}

    def timed(breakdown: bool) -> tuple[float, float, object]:
        started, cpu = time.perf_counter(), time.process_time()
        run = repl.train(step_fn, input_fn, steps=args.steps, breakdown=breakdown)
        steps_per_sec = args.steps / (time.perf_counter() - started)
        return steps_per_sec, 1e6 * (time.process_time() - cpu) / args.steps, run

    print(f"\n{replicas} replica(s), {args.steps} steps per run", flush=True)
    for flag in (True, False):  # trace both variants before timing
        repl.train(step_fn, input_fn, steps=50, breakdown=flag)
    on, off, cpu_on, cpu_off, run = [], [], [], [], None
    for i in range(args.repeats):
        order = (True, False) if i % 2 == 0 else (False, True)  # interleaved, alternating first
        for flag in order:
            rate, cpu, last = timed(flag)
            (on if flag else off).append(rate)
            (cpu_on if flag else cpu_off).append(cpu)
            if flag:
                run = last
        print(
            f"  repeat {i + 1}: on {on[-1]:.0f} steps/s ({cpu_on[-1]:.0f} CPU-us/step), "
            f"off {off[-1]:.0f} steps/s ({cpu_off[-1]:.0f} CPU-us/step); load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    return {
        "replicas": replicas,
        "on": statistics.median(on),
        "off": statistics.median(off),
        "ratio": statistics.median(on) / statistics.median(off),
        "paired": statistics.median(a / b for a, b in zip(on, off)),
        "cpu": statistics.median(cpu_off) / statistics.median(cpu_on),
        "diagnosis": run.diagnosis() if run is not None else "",
    }


if __name__ == "__main__":
    main()
