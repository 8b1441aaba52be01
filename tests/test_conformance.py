"""One conformance suite for every backend (tests/backends.py): a cell trains to one device's
weights on all of them, worker processes included; in-process backends also check primitives,
wrap_optimizer equivalence with one device on the global batch, outputs, placement. Missing
hardware skips (TPU)."""

import backends
import numpy as np
import pytest
import tensorflow as tf
from helpers import regression_input_fn, regression_model_and_step
from toy_models import make_mlp, toy_data

import workbench as wb

GLOBAL_BATCH = 32


@pytest.fixture(params=backends.IN_PROCESS)
def repl(request):
    return backends.make(*request.param)


REGRESSION_CELL = "model, step_fn = regression_model_and_step(repl, lr=0.1)\ninput_fn = regression_input_fn"


@pytest.mark.slow
@pytest.mark.parametrize("backend", backends.ALL)
def test_a_cell_trains_to_the_one_device_weights_on_every_backend(backend, no_orphans):
    """The same %%replicate cell on every backend, processes included: the weights that come back
    into the cell's model equal one device's on the global batch."""

    def train(repl):
        namespace = {
            "regression_model_and_step": regression_model_and_step,
            "regression_input_fn": regression_input_fn,
        }
        run = repl.train_cell(REGRESSION_CELL, namespace, steps=3, steps_per_execution=1)
        assert run.status == "finished" and list(run.history["step"]) == [1, 2, 3]
        return namespace["model"].get_weights()

    expected = train(wb.NonReplicator())
    for got, want in zip(train(backends.make(*backend)), expected):
        np.testing.assert_allclose(got, want, atol=1e-5)


def constant_input(ctx):
    return tf.data.Dataset.from_tensors(tf.zeros([GLOBAL_BATCH, 1])).repeat()


def test_primitive_values(repl):
    n = repl.num_replicas
    shared = tf.range(2 * n, dtype=tf.float32)

    def step_fn(batch):
        rid = tf.cast(repl.replica_id, tf.float32)
        return {
            "sum": repl.all_sum(rid),
            "mean": repl.all_reduce(rid, "mean"),
            "max": repl.all_reduce(rid, "max"),
            "min": repl.all_reduce(rid, "min"),
            "gather": repl.all_gather(rid[None], axis=0),
            "broadcast": repl.broadcast(rid, source=n - 1),
            "nested": repl.all_sum({"a": rid, "b": [2 * rid]}),
            "map_gather": repl.map_gather(lambda s: s * 10, shared),
            "map_reduce": repl.map_reduce(tf.reduce_sum, shared),
        }

    outs = repl.run(step_fn, constant_input)
    assert len(outs) == n
    for out in outs:
        assert float(out["sum"]) == n * (n - 1) / 2
        assert float(out["mean"]) == pytest.approx((n - 1) / 2)
        assert float(out["max"]) == n - 1 and float(out["min"]) == 0
        np.testing.assert_array_equal(out["gather"].numpy(), np.arange(n))
        assert float(out["broadcast"]) == n - 1
        assert float(out["nested"]["b"][0]) == n * (n - 1)
        np.testing.assert_array_equal(out["map_gather"].numpy(), np.arange(2 * n) * 10)
        assert float(out["map_reduce"]) == sum(range(2 * n))


def _train_weights(repl, make_optimizer, steps, wrap=True):
    import keras

    x, y = toy_data(rows=GLOBAL_BATCH * 4)
    with repl.context():
        model = make_mlp()
        opt = make_optimizer()
        opt = repl.wrap_optimizer(opt) if wrap else opt

    def input_fn(ctx):
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True).repeat()

    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(yb, logits, from_logits=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return {"loss": loss}

    run = repl.train(step_fn, input_fn, steps=steps)
    assert run.status == "finished" and run.steps == steps
    return [w.copy() for w in model.get_weights()], run


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_one_step_equals_one_device_on_the_global_batch(repl, optimizer):
    import keras

    make = {"sgd": lambda: keras.optimizers.SGD(0.5), "adam": lambda: keras.optimizers.Adam(0.05)}[optimizer]
    reference, _ = _train_weights(wb.NonReplicator(), make, steps=1)
    weights, _ = _train_weights(repl, make, steps=1)
    initial = make_mlp().get_weights()
    assert max(np.abs(a - b).max() for a, b in zip(reference, initial)) > 1e-3  # the step did move
    assert max(np.abs(a - b).max() for a, b in zip(reference, weights)) <= 1e-5


@pytest.mark.slow
def test_hundred_steps_agree_with_one_device(repl):
    import keras

    reference, ref_run = _train_weights(wb.NonReplicator(), lambda: keras.optimizers.Adam(0.01), steps=100)
    weights, run = _train_weights(repl, lambda: keras.optimizers.Adam(0.01), steps=100)
    assert max(np.abs(a - b).max() for a, b in zip(reference, weights)) <= 1e-5
    np.testing.assert_allclose(run.history["loss"], ref_run.history["loss"], atol=1e-5)


def test_per_replica_and_reduced_outputs(repl):
    n = repl.num_replicas
    rows = np.arange(GLOBAL_BATCH, dtype="float32")[:, None]

    def input_fn(ctx):
        return tf.data.Dataset.from_tensors(rows).repeat()

    def step_fn(batch):
        return {"sum_x": tf.reduce_sum(batch), "rid": tf.cast(repl.replica_id, tf.float32)}

    outs = repl.run(step_fn, input_fn)
    share = GLOBAL_BATCH // n
    for r, out in enumerate(outs):  # replica r holds rows [r*share, (r+1)*share) of the global batch
        assert float(out["sum_x"]) == rows[r * share : (r + 1) * share].sum()
        assert float(out["rid"]) == r
    run = repl.train(step_fn, input_fn, steps=3, reduce={"sum_x": "sum"})
    assert list(run.history["sum_x"]) == [rows.sum()] * 3
    assert list(run.history["rid"]) == [(n - 1) / 2] * 3
    assert list(run.history.columns[:3]) == ["step", "wall_time", "examples_per_sec"]


def test_logical_device_placement():
    repl = wb.MultiGpuReplicator(num_gpus=4, num_gpus_per_replica=2)
    assert repl.num_replicas == 2
    placed = []

    def step_fn(batch):
        y = batch * 2.0
        with repl.logical_device(1) as device:
            z = y + 1.0
        (primary,) = tf.nest.flatten(tf.distribute.get_replica_context().devices)
        placed.append((primary, device, z.device))
        return {"z": tf.reduce_sum(z)}

    repl.run(step_fn, constant_input)
    by_primary = {tf.DeviceSpec.from_string(p).device_index: (d, zd) for p, d, zd in placed}
    assert set(by_primary) == {0, 2}
    assert by_primary[0][0] == "/device:CPU:1" and "CPU:1" in by_primary[0][1]
    assert by_primary[2][0] == "/device:CPU:3" and "CPU:3" in by_primary[2][1]
    with pytest.raises(wb.ConfigurationError, match=r"logical_device\(2\).*has 2 device"):
        repl.run(
            lambda b: repl.logical_device(2).__enter__(),
            lambda: tf.data.Dataset.from_tensors(tf.zeros([2, 1])).repeat(),
        )
