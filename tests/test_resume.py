"""Exact resume: a run resumed from its checkpoint is the run it continues (issue 40).

The checkpoint holds the input's position and the run's goal beside the variables
(core/resume.py): 15 steps + 25 resumed equal 40 uninterrupted, and a preempted run given the
same steps again trains only the steps it still lacked.
"""

import warnings

import cloudpickle
import keras
import pytest
import tensorflow as tf
import toy_models
from helpers import assert_same_checkpoints
from toy_models import make_mlp, mlp_setup, toy_data

import workbench as wb

cloudpickle.register_pickle_by_value(toy_models)  # setup= travels to worker processes


def _trainer(backend, replicas, shuffle_seed=7):
    """A fresh replicator and its model, optimizer, step_fn and input_fn (same initial weights)."""
    repl = wb.replicator(backend, num_replicas=replicas) if replicas else wb.replicator(backend)
    x, y = toy_data()
    with repl.context():
        model = make_mlp(seed=0)
        adam = keras.optimizers.Adam(1e-2)
        opt = repl.wrap_optimizer(adam)

    def input_fn(ctx):
        if shuffle_seed is None:
            tf.random.set_seed(None)  # no global seed either (make_mlp set one): truly unseeded
        return (
            tf.data.Dataset.from_tensor_slices((x, y))
            .shuffle(256, seed=shuffle_seed)
            .repeat()
            .batch(32, drop_remainder=True)
        )

    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(yb, logits, from_logits=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return {"loss": loss}

    return repl, {"model": model, "optimizer": adam}, step_fn, input_fn


@pytest.mark.parametrize("backend,replicas", [("single", None), ("mirrored", 2)])
def test_fifteen_then_twenty_five_resumed_equal_forty_uninterrupted(tmp_path, backend, replicas):
    repl, items, step_fn, input_fn = _trainer(backend, replicas)
    repl.train(step_fn, input_fn, steps=40, checkpoint_dir=tmp_path / "whole", checkpoint=items)

    repl, items, step_fn, input_fn = _trainer(backend, replicas)
    first = repl.train(step_fn, input_fn, steps=15, checkpoint_dir=tmp_path / "cut", checkpoint=items)
    assert first.history["global_step"].tolist() == list(range(1, 16))
    repl, items, step_fn, input_fn = _trainer(backend, replicas)  # a new replicator: a new kernel
    second = repl.train(step_fn, input_fn, steps=25, checkpoint_dir=tmp_path / "cut", checkpoint=items)
    assert second.history["global_step"].tolist() == list(range(16, 41))
    assert not [e for e in second.events if "cannot resume exactly" in e.data.get("text", "")]
    assert_same_checkpoints(tmp_path / "whole", tmp_path / "cut")


@pytest.mark.slow
def test_multi_worker_fifteen_then_twenty_five_resumed_equal_forty_uninterrupted(tmp_path):
    repl = wb.MultiWorkerReplicator(num_workers=2)
    repl.train(setup=mlp_setup, steps=40, checkpoint_dir=tmp_path / "whole")
    repl.train(setup=mlp_setup, steps=15, checkpoint_dir=tmp_path / "cut")
    second = wb.MultiWorkerReplicator(num_workers=2).train(
        setup=mlp_setup, steps=25, checkpoint_dir=tmp_path / "cut"
    )
    assert second.history["global_step"].tolist() == list(range(16, 41))
    assert_same_checkpoints(tmp_path / "whole", tmp_path / "cut")


def test_a_preempted_run_given_the_same_steps_finishes_the_run_it_began(tmp_path):
    repl, items, step_fn, input_fn = _trainer("single", None)
    repl.train(step_fn, input_fn, steps=60, checkpoint_dir=tmp_path / "whole", checkpoint=items)

    repl, items, step_fn, input_fn = _trainer("single", None)

    def preempt_at_twenty(event):
        if event.kind == "metrics" and event.step >= 20 and not run._preempted:
            run.preempt("SIGTERM")

    run = repl.train(
        step_fn, input_fn, steps=60, checkpoint_dir=tmp_path / "cut", checkpoint=items,
        steps_per_execution=5, background=True, sinks=[preempt_at_twenty],
    )  # fmt: skip
    run.wait(120)
    assert run.status == "preempted", run.stop_reason
    assert "run it again with the same steps" in run.stop_reason
    cut_at = run.history["global_step"].iloc[-1]
    assert 20 <= cut_at < 60

    repl, items, step_fn, input_fn = _trainer("single", None)
    rest = repl.train(step_fn, input_fn, steps=60, checkpoint_dir=tmp_path / "cut", checkpoint=items)
    assert rest.status == "finished"
    assert rest.history["global_step"].tolist() == list(range(cut_at + 1, 61))  # only what was missing
    assert any("finishing the unfinished run of 60 steps" in e.data.get("text", "") for e in rest.events)
    assert_same_checkpoints(tmp_path / "whole", tmp_path / "cut")

    # The run is finished now: the same steps again mean 60 more, as before.
    repl, items, step_fn, input_fn = _trainer("single", None)
    more = repl.train(step_fn, input_fn, steps=10, checkpoint_dir=tmp_path / "cut", checkpoint=items)
    assert more.history["global_step"].tolist() == list(range(61, 71))


def test_an_unseeded_shuffle_is_said_once_when_a_run_resumes(tmp_path):
    repl, items, step_fn, input_fn = _trainer("single", None, shuffle_seed=None)
    repl.train(step_fn, input_fn, steps=5, checkpoint_dir=tmp_path, checkpoint=items)
    repl, items, step_fn, input_fn = _trainer("single", None, shuffle_seed=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = repl.train(step_fn, input_fn, steps=5, checkpoint_dir=tmp_path, checkpoint=items)
    said = [str(w.message) for w in caught if "cannot resume exactly" in str(w.message)]
    assert len(said) == 1 and "shuffles without a seed" in said[0] and "seed=" in said[0]
    assert any("shuffles without a seed" in e.data.get("text", "") for e in run.events)
