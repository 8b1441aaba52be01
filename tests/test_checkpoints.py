"""Checkpoints plain TensorFlow reads: the saved objects sit at the top level under their names."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from toy_models import make_mlp, toy_data

import workbench as wb
from workbench._src.core.checkpoints import Saver, check_writable_directory, saved_names


def _setup(repl, seed=0):
    """A model and an Adam optimizer built in repl.context(), a step and an input_fn."""
    x, y = toy_data()
    with repl.context():
        model = make_mlp(seed)
        adam = keras.optimizers.Adam(1e-2)
        opt = repl.wrap_optimizer(adam)

    def input_fn(ctx):
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64, drop_remainder=True)

    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(yb, logits, from_logits=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return {"loss": loss}

    return model, adam, step_fn, input_fn


def _accuracy(model) -> float:
    x, y = toy_data(seed=1)  # held-out rows
    return float(np.mean(np.argmax(model.predict(x, verbose=0), -1) == y))


def test_plain_tensorflow_restores_the_named_objects(tmp_path):
    repl = wb.replicator("mirrored", num_replicas=2)
    model, adam, step_fn, input_fn = _setup(repl)
    repl.train(
        step_fn, input_fn, steps=80, checkpoint_dir=tmp_path, checkpoint={"model": model, "optimizer": adam}
    )
    trained_accuracy = _accuracy(model)
    assert trained_accuracy > 0.7  # it learned: a fresh model is near 0.25

    # TensorFlow's own tutorial code, no workbench: a fresh model and optimizer on one device.
    new_model = make_mlp(seed=5)
    new_opt = keras.optimizers.Adam(1e-2)
    assert _accuracy(new_model) < 0.5
    step = tf.Variable(0, dtype=tf.int64)
    status = tf.train.Checkpoint(model=new_model, optimizer=new_opt, step=step).restore(
        tf.train.latest_checkpoint(str(tmp_path))
    )
    status.assert_existing_objects_matched()
    assert int(step) == 80
    assert _accuracy(new_model) == trained_accuracy
    for a, b in zip(new_model.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert set(saved_names(tf.train.latest_checkpoint(str(tmp_path)))) == {
        "model",
        "optimizer",
        "step",
        "workbench",  # the run state a resumed run continues from (the input's position, its goal)
        "save_counter",
    }

    # The workbench's own restore reads the same files on another backend.
    single = wb.NonReplicator()
    evaluation_model, *_ = _setup(single, seed=7)
    assert single.restore(tmp_path, checkpoint={"model": evaluation_model}) == 80
    assert _accuracy(evaluation_model) == trained_accuracy


def test_default_layout_is_the_list_of_variables_created_in_context(tmp_path):
    repl = wb.replicator("mirrored", num_replicas=2)
    model, _, step_fn, input_fn = _setup(repl)
    repl.train(step_fn, input_fn, steps=20, checkpoint_dir=tmp_path)
    # The model's variables were created first in repl.context(), so they lead the list.
    new_model = make_mlp(seed=5)
    status = tf.train.Checkpoint(variables=list(new_model.variables)).restore(
        tf.train.latest_checkpoint(str(tmp_path))
    )
    status.expect_partial()  # the optimizer's variables follow in the list
    for a, b in zip(new_model.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def _legacy_checkpoint(directory, model, step: int) -> None:
    """What the run loop wrote before issue 17: everything nested under `run`, beside `step`."""
    old = tf.train.Checkpoint(run=tf.train.Checkpoint(model=model), step=tf.Variable(step, dtype=tf.int64))
    tf.train.CheckpointManager(old, str(directory), max_to_keep=3).save(checkpoint_number=step)


def test_checkpoints_in_the_old_nested_layout_still_load(tmp_path):
    old_model = make_mlp(seed=3)
    _legacy_checkpoint(tmp_path, old_model, step=7)

    single = wb.NonReplicator()
    with single.context():
        restored = make_mlp(seed=4)
    assert single.restore(tmp_path, checkpoint={"model": restored}) == 7
    for a, b in zip(restored.get_weights(), old_model.get_weights()):
        np.testing.assert_array_equal(a, b)

    # A run resumes from it: weights and step count come back, and the next save is new-layout.
    repl = wb.replicator("mirrored", num_replicas=2)
    model, adam, step_fn, input_fn = _setup(repl, seed=4)
    run = repl.train(step_fn, input_fn, steps=0, checkpoint_dir=tmp_path, checkpoint={"model": model})
    assert "resumed from checkpoint at step 7" in run.events[0].data["text"]
    for a, b in zip(model.get_weights(), old_model.get_weights()):
        np.testing.assert_array_equal(a, b)
    repl.train(step_fn, input_fn, steps=3, checkpoint_dir=tmp_path, checkpoint={"model": model})
    latest = tf.train.latest_checkpoint(str(tmp_path))
    assert latest.endswith("ckpt-10")
    assert set(saved_names(latest)) == {"model", "step", "workbench", "save_counter"}


def test_saver_resumes_only_when_asked(tmp_path):
    repl = wb.replicator("single")
    model, adam, step_fn, input_fn = _setup(repl)
    repl.train(step_fn, input_fn, steps=5, checkpoint_dir=tmp_path, checkpoint={"model": model})
    saved = model.get_weights()

    fresh = wb.replicator("single")
    model2, _, step_fn2, input_fn2 = _setup(fresh, seed=9)
    program = fresh._program(step_fn2, input_fn2)
    items = {"model": model2}
    assert Saver(program, tmp_path, items, resume=False).restore_if_any() is None
    assert program.steps_done == 0
    assert not np.array_equal(model2.get_weights()[0], saved[0])
    restored = Saver(program, tmp_path, items, resume=True).restore_if_any()
    assert (restored.step, restored.input_position, restored.goal_step) == (5, 5, 0)  # (it finished)
    assert program.steps_done == 5 and program.input_position == 5  # its input is 5 batches in
    np.testing.assert_array_equal(model2.get_weights()[0], saved[0])


def test_resume_names_the_step_of_the_checkpoint_to_restore(tmp_path):
    """resume=N restores ckpt-N, not the latest (a healed run resumes from the checkpoint its
    history was rewound to: launch/heal.py); a step with no checkpoint there is a clear error."""
    repl = wb.replicator("single")
    model, adam, step_fn, input_fn = _setup(repl)
    repl.train(step_fn, input_fn, steps=30, checkpoint_dir=tmp_path, checkpoint_every=10, checkpoint={"model": model})
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-30")
    plain = make_mlp(seed=5)  # (plain TensorFlow's reading of ckpt-20)
    tf.train.Checkpoint(model=plain).restore(str(tmp_path / "ckpt-20")).expect_partial()
    at_20 = plain.get_weights()[0]

    fresh = wb.replicator("single")
    model2, _, step_fn2, input_fn2 = _setup(fresh, seed=9)
    run = fresh.train(step_fn2, input_fn2, steps=0, checkpoint_dir=tmp_path, resume=20, checkpoint={"model": model2})
    assert "resumed from checkpoint at step 20" in run.events[0].data["text"], run.events[0].data
    np.testing.assert_array_equal(model2.get_weights()[0], at_20)
    with pytest.raises(wb.ConfigurationError, match=r"resume=5 names no checkpoint in .*ckpt-10, ckpt-20, ckpt-30"):
        fresh.train(step_fn2, input_fn2, steps=0, checkpoint_dir=tmp_path, resume=5, checkpoint={"model": model2})
    for wrong in (-1, "20", 2.0):
        with pytest.raises(wb.ConfigurationError, match=r"resume must be True, False or the step of a checkpoint"):
            fresh.train(step_fn2, input_fn2, steps=0, checkpoint_dir=tmp_path, resume=wrong)


def test_check_writable_directory(tmp_path):
    made = check_writable_directory(os.path.relpath(tmp_path / "a" / "b"))
    assert made == str(tmp_path / "a" / "b") and os.path.isdir(made)
    assert check_writable_directory(tmp_path) == str(tmp_path)
    assert check_writable_directory("gs://bucket/ckpt") == "gs://bucket/ckpt"


def test_refuses_a_directory_that_is_a_file(tmp_path):
    a_file = tmp_path / "ckpt"
    a_file.write_text("not a folder")
    with pytest.raises(
        wb.ConfigurationError, match=r"must be a folder, but '.*ckpt' is a file \(received .*Fix"
    ):
        check_writable_directory(a_file)
    with pytest.raises(wb.ConfigurationError, match=r"'.*ckpt/sub' cannot be created: .*\(received .*Fix"):
        check_writable_directory(a_file / "sub")


def test_names_that_clash_with_the_workbench_entries(tmp_path):
    repl = wb.replicator("single")
    model, _, step_fn, input_fn = _setup(repl)
    with pytest.raises(
        wb.ConfigurationError,
        match=r"(?s)checkpoint names \['step'\] clash .*'step' is the workbench's exact step count.*"
        r"Received checkpoint keys \['model', 'step'\]\. Fix: rename them",
    ):
        repl.train(
            step_fn,
            input_fn,
            steps=1,
            checkpoint_dir=tmp_path,
            checkpoint={"model": model, "step": tf.Variable(0)},
        )
    with pytest.raises(wb.ConfigurationError, match=r"\['run'\] clash .*old"):
        repl.restore(tmp_path, checkpoint={"run": model})


def test_a_periodic_checkpoint_written_in_the_background_holds_the_weights_of_its_step(tmp_path):
    """A periodic save copies the values at its step and writes them on a thread while the next
    steps train (short chunks: many updates land during the write). Its checkpoint equals the
    final one of a run that stopped at that step, and its event comes before the run's end."""
    from helpers import regression_setup

    wb.NonReplicator().train(setup=regression_setup, steps=200, checkpoint_dir=tmp_path / "stopped")
    run = wb.NonReplicator().train(
        setup=regression_setup, steps=400, steps_per_execution=5,
        checkpoint_dir=tmp_path / "periodic", checkpoint_every=100,
    )  # fmt: skip
    saved = [os.path.basename(e.data["path"]) for e in run.events if e.kind == "checkpoint"]
    assert saved == ["ckpt-100", "ckpt-200", "ckpt-300", "ckpt-400"]
    assert run.events[-1].kind == "ended"
    stopped = tf.train.load_checkpoint(str(tmp_path / "stopped" / "ckpt-200"))
    periodic = tf.train.load_checkpoint(str(tmp_path / "periodic" / "ckpt-200"))
    floats = [k for k, d in stopped.get_variable_to_dtype_map().items() if d.is_floating]
    assert floats
    for key in [*floats, "step/.ATTRIBUTES/VARIABLE_VALUE"]:
        np.testing.assert_array_equal(stopped.get_tensor(key), periodic.get_tensor(key), err_msg=key)


# In a fresh process (glibc's malloc settings are process-wide): a run without checkpoints (its
# tf.distribute iterator makes TensorFlow pin glibc's mmap threshold at 128 KiB), then a run with
# periodic saves; after each, the page faults of allocating, filling and freeing a block the size
# of SaveV2's write buffer, as every save does.
SAVE_BUFFER_CYCLES = """
import ctypes, resource, sys
sys.path.insert(0, sys.argv[1])
import workbench as wb
from helpers import regression_setup
from workbench._src.core.save_buffer import SAVE_BUFFER

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)

def faults_per_buffer(cycles=6):
    counts = []
    for _ in range(cycles):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(SAVE_BUFFER)
        ctypes.memset(block, 0, SAVE_BUFFER)
        libc.free(block)
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return min(counts[1:])  # (the first may grow the heap once)

wb.NonReplicator().train(setup=regression_setup, steps=10)
print("without", faults_per_buffer())
wb.NonReplicator().train(setup=regression_setup, steps=10, checkpoint_dir=sys.argv[2], checkpoint_every=5)
print("with", faults_per_buffer())
"""


def test_a_process_that_saves_periodically_keeps_the_save_buffer_instead_of_faulting_it_in_each_time(tmp_path):
    """TensorFlow pins glibc's mmap threshold once a process iterates a tf.distribute dataset, and
    then every save maps, faults in and zeroes its 8 MiB write buffer afresh (2,048 pages; ~10 ms
    of CPU per save for a small model). A run with periodic saves raises the thresholds above
    that buffer (core/save_buffer.py), so it stays allocated between saves."""
    done = subprocess.run(
        [sys.executable, "-c", SAVE_BUFFER_CYCLES, os.path.dirname(__file__), str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    faults = {line.split()[0]: int(line.split()[1]) for line in done.stdout.splitlines() if line[:1] in "wt"}
    pages = (8 << 20) // os.sysconf("SC_PAGE_SIZE")
    # The premise: TensorFlow's pinned threshold maps the buffer afresh (if this fails, TensorFlow
    # no longer pins it, and core/save_buffer.py may go).
    assert faults["without"] >= pages * 0.9, faults
    assert faults["with"] < pages * 0.05, faults
