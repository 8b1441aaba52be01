"""A script that trained exits promptly: no wait for TensorFlow input iterators at exit.

Deleting an idle distributed iterator waits 10-40 s for tf.data's autotuning thread (reaper.py);
before, every script that used the workbench spent up to 20 s after its last line deleting them,
then printed "did not finish within 20 s at exit".
"""

import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.slow  # a script that trains, timed to its exit

SCRIPT = textwrap.dedent(
    """
    import time

    import workbench as wb

    wb.configure_devices(cpus=2)
    import keras
    import numpy as np
    import tensorflow as tf

    from workbench._src.core.reaper import discard_programs

    features = np.random.RandomState(0).randn(256, 8).astype("float32")
    targets = features.sum(axis=1, keepdims=True)
    repl = wb.replicator("mirrored", num_replicas=2)
    with repl.context():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        optimizer = repl.wrap_optimizer(keras.optimizers.SGD(0.01))

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        optimizer.minimize(loss, model.trainable_variables, tape=tape)
        return {"loss": loss}

    def input_fn(ctx):
        return tf.data.Dataset.from_tensor_slices((features, targets)).repeat().batch(32)

    def input_fns():  # one program (one input iterator) each
        for shuffle in (4, 8, 16):
            yield lambda ctx, shuffle=shuffle: input_fn(ctx).shuffle(shuffle, seed=0)

    runs = [repl.train(step_fn, each, steps=50) for each in input_fns()]  # kept, as users do
    # One is deleted on the reaper thread (maybe still under way at exit); two stay alive.
    discard_programs(list(repl._programs.values())[:1])
    # An iterator no Program holds (the user's own) is kept alive at exit as well.
    own = iter(tf.data.Dataset.range(10**9).map(lambda i: i + 1, num_parallel_calls=tf.data.AUTOTUNE))
    next(own)
    # tf.data's tuning thread sleeps longer and longer (up to a minute), and deleting an iterator
    # waits for it to wake: iterators that sat idle are the slow ones to delete.
    time.sleep(25.0)
    print("WORK DONE", time.time(), flush=True)
    """
)


def main_thread_seconds(pid: int) -> float | None:
    """Seconds the process's main thread has run or waited, runnable, for a CPU (schedstat):
    the time it was not idle. None once it is gone."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            ran, waited = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return (int(ran) + int(waited)) / 1e9


def test_a_script_that_trained_exits_promptly_and_cleanly(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "WORKBENCH_RUNS_DIR": str(tmp_path / "runs")}
    with open(tmp_path / "stderr.txt", "w+") as stderr:
        child = subprocess.Popen(
            [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
        )
        said = child.stdout.readline()
        while said and "WORK DONE" not in said:
            said = child.stdout.readline()
        at_last_line = busy = main_thread_seconds(child.pid)
        while child.poll() is None:  # (its schedstat until it is reaped: the last reading stands)
            busy = main_thread_seconds(child.pid) or busy
            time.sleep(0.02)
        ended = time.time()
        child.stdout.close()
        stderr.seek(0)
        errors = stderr.read()
    assert child.returncode == 0 and "WORK DONE" in said, errors[-3000:]
    exit_seconds = ended - float(said.split("WORK DONE")[1].split()[0])
    # Python's and TensorFlow's own teardown take 1-3 s here; the old wait for iterators took 20,
    # idle. Counted: the time the exit sat idle, not the time it ran or waited for a CPU, which a
    # loaded machine stretches (13.4 s at load 30).
    # (No first reading: it was gone before it, an exit at once.)
    idle = exit_seconds - (busy - at_last_line) if at_last_line is not None else 0.0
    print(f"exit: {exit_seconds:.1f} s, {idle:.1f} s of it idle")  # (pytest -rP shows it)
    assert idle < 8, f"{exit_seconds:.1f} s from the script's last line to its exit, {idle:.1f} s of it idle"
    assert "did not finish" not in errors
    assert "FATAL" not in errors and "terminate called" not in errors
