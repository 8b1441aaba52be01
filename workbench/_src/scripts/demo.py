"""`workbench demo`: the main job. Trains an MLP on scikit-learn's digits on the mirrored backend
(virtual CPUs when there is no GPU), prints a summary and writes a plot PNG."""

from __future__ import annotations

import os
import tempfile

from workbench._src.core.run_stats import describe, fmt
from workbench._src.core.tf_setup import tf
from workbench._src.sinks.progress import ProgressPrinter, say


def default_out() -> str:
    """Where the demo's plot goes unless `--out` says: the results folder the README's other
    commands write to (/tmp/workbench-results/), never the working folder (a clone's root)."""
    return os.path.join(tempfile.gettempdir(), "workbench-results", "workbench-demo.png")


def demo(replicas: int = 4, steps: int = 600, out: str | None = None, global_batch: int = 128) -> dict:
    import workbench as wb  # the public face, as a user's script imports it (it imports this module's package)

    wb.configure_devices(cpus=max(8, replicas))
    import keras
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    t = tf()
    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype("float32"), y.astype("int32")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0)

    repl = wb.replicator("mirrored", num_replicas=replicas)
    with repl.context():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)]
        )
        optimizer = repl.wrap_optimizer(keras.optimizers.Adam(1e-3))

    def input_fn(ctx):
        ds = t.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(2048, seed=0).repeat()
        return ds.batch(global_batch, drop_remainder=True)

    def step_fn(images, labels):
        with t.GradientTape() as tape:
            logits = model(images, training=True)
            loss = t.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
            )
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        correct = t.cast(t.equal(t.argmax(logits, -1, output_type=t.int32), labels), t.float32)
        return {"loss": loss, "accuracy": t.reduce_mean(correct)}

    say(f"training {steps} steps on {repl.num_replicas} mirrored replicas...")
    # A line a second while it trains (as `workbench run`): 600 steps take 10-40 s here.
    run = repl.train(step_fn, input_fn, steps=steps, sinks=[ProgressPrinter(steps)])
    test_accuracy = float(np.mean(np.argmax(model.predict(x_test, verbose=0), -1) == y_test))
    summary = run.summary()  # the run's figures, as the dashboard and the sidebar show them
    devices = wb.device_summary()
    print("Replicator Workbench demo: MLP on scikit-learn digits")
    print(
        f"  devices        : {len(devices['gpus'])} GPU, {devices['virtual_cpus']} virtual CPU on {devices['physical_cores']} physical cores"
    )
    print(f"  backend        : {repl.backend}, {repl.num_replicas} replicas, global batch {global_batch}")
    print(
        f"  steps          : {run.steps} in {fmt(summary.get('wall_time_s'))} s "
        f"(of which compiling {fmt(run.compile_seconds)} s)"
    )
    print(f"  throughput     : {describe(summary)} (whole run, after compiling)")
    print(
        f"  median step    : {fmt(summary.get('median_examples_per_sec'))} examples/s (compiled calls only)"
    )
    print(f"  final loss     : {summary['loss']:.4f}   train accuracy {summary['accuracy']:.3f}")
    print(f"  test accuracy  : {test_accuracy:.3f} ({len(y_test)} held-out digits)")
    out = out or default_out()
    _plot(run, out, title=f"digits MLP, {repl.num_replicas} mirrored replicas")
    print(f"  plot           : {out}")
    return {**summary, "test_accuracy": test_accuracy, "plot": out}


def _plot(run, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = run.history
    plt.rcParams.update({"font.size": 12})
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    step = range(1, len(h) + 1)  # counted from the run's start
    axes[0].plot(step, h["loss"], lw=1)
    axes[0].set(title="loss", xlabel="step", yscale="log")
    axes[1].plot(step, h["accuracy"].rolling(20, min_periods=1).mean(), lw=1)
    axes[1].set(title="train accuracy (20-step mean)", xlabel="step", ylim=(0, 1.02))
    axes[2].plot(step, h["examples_per_sec"], lw=1)
    median = run.summary().get("median_examples_per_sec")
    if median:
        axes[2].axhline(median, ls="--", color="0.4", lw=1, label=f"median {fmt(median)}")
        axes[2].legend(loc="lower right", fontsize=11)
    axes[2].set(title="examples/s per step", xlabel="step")
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # (as --history and --csv do)
    fig.savefig(path, dpi=100)
    plt.close(fig)
