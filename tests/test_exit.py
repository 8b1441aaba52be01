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


def test_a_script_that_trained_exits_promptly_and_cleanly(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "WORKBENCH_RUNS_DIR": str(tmp_path / "runs")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    ended = time.time()
    assert done.returncode == 0, done.stderr[-3000:]
    work_done = float(done.stdout.split("WORK DONE")[1].split()[0])
    # Python's and TensorFlow's own teardown take 1-3 s here; the old wait for iterators took 20.
    assert ended - work_done < 10, f"{ended - work_done:.1f} s from the script's last line to its exit"
    assert "did not finish" not in done.stderr
    assert "FATAL" not in done.stderr and "terminate called" not in done.stderr
