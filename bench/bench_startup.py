"""Start-up of the process backends, first run and re-run, against an in-process re-run (issue 21).

Run: python bench/bench_startup.py [--steps 50] [--skip-anchor] [--think 20]

One invocation, the same digits MLP (64-128-128-10, Adam, global batch 64) and `--steps` steps
per `train(setup=...)` call, each wall time measured around the call:
  mirrored    in-process, 2 replicas: the second train(setup=...) in this process (the re-run a
              notebook user makes after editing a cell); the anchor of the ratios;
  multi-worker 2 workers: first run (a fresh pool), second run (the warm pool);
  async-ps    2 workers, 1 parameter server: first run, second run;
  chosen      the backend chosen first (its pool starts in the background, as after
              `%replicate --backend ...`), the first run `--think` seconds later;
  pool=False  the old path (fresh processes every run, stopped at the end) for both backends:
              its first run is the start-up anchor of "first run start-up <= 60% of before".
Printed: wall seconds, start-up seconds (train() called -> processes ready), run.startup's phases,
and the ratios: second run / in-process re-run (goal <= 2.0) and first-run start-up now / with
pool=False (goal <= 0.6). This machine is shared and loaded: read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import time


def digits_setup(repl):
    """setup(repl): the digits MLP and its input, (step_fn, input_fn)."""
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
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64)

    def step_fn(features, labels):
        with tf.GradientTape() as tape:
            logits = model(features, training=True)
            loss = tf.reduce_mean(
                tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
            )
        optimizer.minimize(loss, model.trainable_variables, tape=tape)
        return {"loss": loss}

    return step_fn, input_fn


def timed(repl, steps: int):
    started = time.perf_counter()
    run = repl.train(setup=digits_setup, steps=steps)
    wall = time.perf_counter() - started
    if run.status != "finished":
        raise SystemExit(f"{repl!r}: run {run.status} ({run.stop_reason})")
    return wall, run


def row(label: str, wall: float, run) -> dict:
    startup = getattr(run, "startup_seconds", None)
    phases = getattr(run, "startup", None) or {}
    phase_text = ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
    print(f"{label:<34} wall {wall:6.2f} s   start-up {startup or 0:6.2f} s   [{phase_text}]", flush=True)
    return {"wall": wall, "startup": startup or 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--skip-anchor", action="store_true", help="no pool=False rows")
    parser.add_argument("--think", type=float, default=20.0, help="seconds between choosing and training")
    args = parser.parse_args()

    import workbench as wb

    wb.configure_devices(cpus=2)
    mirrored = wb.replicator("mirrored", num_replicas=2)
    timed(mirrored, args.steps)  # the first: TensorFlow's own first use, traced
    wall, run = timed(mirrored, args.steps)
    inproc = row("mirrored x2, in-process re-run", wall, run)["wall"]

    results = {}
    backends = [
        ("multi-worker x2", lambda **kw: wb.MultiWorkerReplicator(num_workers=2, **kw)),
        ("async-ps 2w/1ps", lambda **kw: wb.MultiWorkerAsyncReplicator(num_workers=2, num_ps=1, **kw)),
    ]
    for name, make in backends:
        if not args.skip_anchor:
            results[name, "old"] = row(f"{name}, pool=False, first run", *timed(make(pool=False), args.steps))
        repl = make()
        results[name, "first"] = row(f"{name}, first run", *timed(repl, args.steps))
        results[name, "second"] = row(f"{name}, second run (warm)", *timed(repl, args.steps))
        repl.shutdown()
        # Chosen in a cell (`%replicate --backend ...` starts the pool in the background), then
        # the training cell written and run `--think` seconds later.
        repl = make()
        repl.prestart()
        time.sleep(args.think)
        results[name, "chosen"] = row(
            f"{name}, first run {args.think:.0f} s after choosing", *timed(repl, args.steps)
        )
        repl.shutdown()

    print("\nratios (this invocation, same machine):")
    for name, _ in backends:
        second = results[name, "second"]["wall"] / inproc
        print(f"  {name:<16} second run / in-process re-run      {second:5.2f}  (goal <= 2.0)")
        if not args.skip_anchor:
            first = results[name, "first"]["startup"] / max(results[name, "old"]["startup"], 1e-9)
            print(f"  {name:<16} first start-up / pool=False's     {first:5.2f}  (goal <= 0.6)")
        chosen = results[name, "chosen"]["wall"] / inproc
        print(f"  {name:<16} first run after choosing / in-process re-run {chosen:5.2f}")
        if not args.skip_anchor:
            chosen = results[name, "chosen"]["wall"] / results[name, "old"]["wall"]
            print(f"  {name:<16} first run after choosing / pool=False's first run (wall) {chosen:5.2f}")


if __name__ == "__main__":
    main()
