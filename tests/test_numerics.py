"""Numerics: one device vs N replicas (compare_numerics), batch-norm statistics (the batch-norm
report and wb.CrossReplicaBatchNorm), and the loss-scaling check with planted mistakes."""

import itertools
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import workbench as wb

REPLICAS = 8
TOL = 2e-6  # the bound for cross-replica batch norm against one device


@pytest.fixture(scope="module")
def bn_report():
    # the study's experiment (32 rows per replica, 64 features), shortened from 100 steps
    return wb.batchnorm_report(replicas=REPLICAS, steps=15)


# ----- batch norm ------------------------------------------------------------------------
def test_cross_replica_batchnorm_matches_one_device(bn_report):
    row = bn_report.table.loc["cross-replica"]
    assert row.training_output <= TOL
    assert row.inference_output <= TOL
    assert row.moving_mean <= TOL
    assert row.moving_variance <= TOL
    assert row.copies_agree  # one set of moving statistics, the same on every replica


def test_synchronized_batchnorm_matches_one_device(bn_report):
    row = bn_report.table.loc["synchronized"]
    assert max(row.training_output, row.moving_mean, row.moving_variance) <= TOL


def test_plain_batchnorm_differs_clearly(bn_report):
    row = bn_report.table.loc["plain"]
    assert row.training_output > 0.3  # each replica normalises with its own 32 rows
    assert row.inference_output > 1e-3
    assert row.moving_mean > 1e-3  # as read: replica 0's copy only
    assert row.moving_mean_avg_copies < 1e-6  # the mean of per-replica means is the global mean
    assert row.moving_variance_avg_copies > 1e-3  # but per-replica variances miss the spread
    assert not row.copies_agree
    copies = bn_report.copies.loc["plain"]
    assert len(copies) == REPLICAS
    assert copies.moving_variance_avg.nunique() == REPLICAS  # every replica has its own copy


def test_batchnorm_report_explains_compares_and_plots(bn_report, tmp_path):
    text = str(bn_report)
    for phrase in ("Training output", "replica 0's copy", "study", "wb.CrossReplicaBatchNorm"):
        assert phrase in text
    study = bn_report.compare_with_study()
    assert study.loc[("plain", "training_output"), "study"] == pytest.approx(1.46, abs=0.01)
    assert list(bn_report.per_step.columns) == ["plain", "synchronized", "cross-replica"]
    assert "<table" in bn_report._repr_html_()
    bn_report.plot(tmp_path / "bn.png")
    assert (tmp_path / "bn.png").stat().st_size > 1000


@pytest.mark.slow
def test_cross_replica_batchnorm_trains_like_one_device():
    """Gradients flow through the cross-replica sums: N-replica SGD steps equal one device."""

    def setup(repl):
        keras.utils.set_random_seed(3)
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16),
                wb.CrossReplicaBatchNorm(),
                keras.layers.ReLU(),
                keras.layers.Dense(1),
            ]
        )
        opt = repl.wrap_optimizer(keras.optimizers.SGD(0.1))

        def step_fn(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - 1.0) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return {"loss": loss}

        return step_fn

    x = np.random.default_rng(0).normal(3.0, 2.0, size=(256, 8)).astype("float32")
    table = wb.compare_numerics(setup, data=x, global_batch_size=128, replicas=REPLICAS, steps=3)
    assert table.max_abs_diff.max() < 1e-5, table.sort_values("max_abs_diff").tail(3)
    assert set(table[table.kind == "variable"].how) == {"mirrored"}


def test_cross_replica_batchnorm_is_a_keras_layer_like_batchnorm():
    layer = wb.CrossReplicaBatchNorm(momentum=0.9, name="bn")
    assert isinstance(layer, wb.CrossReplicaBatchNorm)
    assert isinstance(layer, keras.layers.Layer)
    layer.build((None, 4))
    reference = keras.layers.BatchNormalization()
    reference.build((None, 4))
    reference.set_weights([np.full(4, v, "float32") for v in (2.0, 1.0, 0.5, 3.0)])
    layer.set_weights(reference.get_weights())  # same weights, same order
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    np.testing.assert_allclose(layer(x, training=False), reference(x, training=False), atol=1e-6)
    np.testing.assert_allclose(layer(x, training=True), reference(x, training=True), atol=1e-5)
    clone = wb.CrossReplicaBatchNorm.from_config(layer.get_config())
    assert clone.momentum == 0.9


# ----- compare_numerics --------------------------------------------------------------------
def sgd_setup(repl):
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)]
    )
    opt = repl.wrap_optimizer(keras.optimizers.SGD(0.1))

    def step_fn(x):
        with tf.GradientTape() as tape:
            out = model(x)
            loss = tf.reduce_mean(out**2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return {"loss": loss, "out": out}

    return step_fn


def test_compare_numerics_reports_zero_for_a_correct_sgd_step(tmp_path):
    x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
    table = wb.compare_numerics(
        sgd_setup, data=x, global_batch_size=64, replicas=4, steps=3, plot=tmp_path / "d.png"
    )
    assert table.max_abs_diff.max() < 1e-6
    last = table[table.step == 3].set_index("name")
    assert last.loc["out", "how"] == "concatenated" and len(last.loc["out", "per_replica_max_abs_diff"]) == 4
    assert last.loc["loss", "how"] == "mean"
    kernels = [n for n in last.index if n.endswith("kernel")]
    assert len(kernels) == 2 and (last.loc[kernels, "how"] == "mirrored").all()
    assert (tmp_path / "d.png").stat().st_size > 1000


def test_compare_numerics_shows_every_copy_of_plain_batchnorm_statistics():
    x = np.random.default_rng(0).normal(size=(512, 8)).astype("float32")
    table = wb.compare_numerics(
        lambda repl: keras.layers.BatchNormalization(), data=x, global_batch_size=128, replicas=4, steps=2
    )
    last = table[table.step == 2].set_index("name")
    moving = last.loc[[n for n in last.index if "moving" in n]]
    assert (moving.how == "per-replica").all()
    assert all(len(p) == 4 for p in moving.per_replica_max_abs_diff)
    assert moving.worst_replica.notna().all() and (moving.max_abs_diff > 1e-4).all()
    assert last.loc["output", "max_abs_diff"] > 0.1


# ----- loss scaling ------------------------------------------------------------------------
GLOBAL_BATCH = 64
_X = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
_Y = np.random.default_rng(1).normal(size=(256, 1)).astype("float32")


def xy_input(ctx):
    return tf.data.Dataset.from_tensor_slices((_X, _Y)).batch(GLOBAL_BATCH).repeat()


def regression_setup(wrap: bool, loss: str, regularization: str):
    """A step_fn written one of the common ways (right or wrong) to scale a loss."""

    def setup(repl):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.1)),
                keras.layers.Dense(1),
            ]
        )
        opt = keras.optimizers.SGD(0.01)
        if wrap:
            opt = repl.wrap_optimizer(opt)
        else:
            opt.build(model.trainable_variables)

        def step_fn(x, y):
            with tf.GradientTape() as tape:
                per_example = tf.reduce_sum((model(x) - y) ** 2, axis=1)
                if loss == "mean":
                    value = tf.reduce_mean(per_example)
                else:
                    value = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
                reg = tf.add_n(model.losses)
                value += reg if regularization == "raw" else tf.nn.scale_regularization_loss(reg)
            grads = tape.gradient(value, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return {"loss": value}

        return step_fn

    return setup


@pytest.mark.parametrize(
    "wrap, loss, regularization, expected",
    [
        (True, "mean", "raw", "none"),  # TF-Replicator's convention
        (False, "global", "scaled", "none"),  # tf.distribute's convention
        (False, "mean", "raw", "mean-loss-with-summing-optimizer"),
        (True, "global", "scaled", "global-batch-loss-with-wrap-optimizer"),
        (False, "global", "raw", "regularization-not-scaled"),
        (True, "mean", "scaled", "regularization-scaled-with-wrap-optimizer"),
    ],
)
def test_loss_scaling_check_finds_each_planted_mistake(wrap, loss, regularization, expected):
    report = wb.check_loss_scaling(regression_setup(wrap, loss, regularization), xy_input, replicas=4)
    assert report.mistake == expected, str(report)
    assert report.ok == (expected == "none")
    if expected == "mean-loss-with-summing-optimizer":
        assert report.gradient_scale == pytest.approx(4.0, rel=1e-4)
    if expected == "global-batch-loss-with-wrap-optimizer":
        assert report.gradient_scale == pytest.approx(0.25, rel=1e-4)


def test_loss_scaling_report_says_the_fix():
    report = wb.check_loss_scaling(regression_setup(False, "mean", "raw"), xy_input, replicas=2)
    text = str(report)
    assert "MISTAKE" in text and "Fix:" in text and "repl.wrap_optimizer" in text
    assert "global_batch_size=64" in report.fix
    assert report.to_dict()["replicas"] == 2 and report.global_batch_size == 64
    assert set(report.per_variable.columns) >= {"variable", "scale", "max_abs_diff"}
    assert report.per_variable.scale.round(3).eq(2.0).all()  # no regularisation mismatch here
    assert str(wb.check_loss_scaling(regression_setup(True, "mean", "raw"), xy_input, replicas=2)).startswith(
        "Loss scaling OK"
    )


# ----- errors: what was wrong, what was received, how to fix -------------------------------
def test_errors_for_bad_arguments():
    x = np.zeros((64, 8), "float32")
    with pytest.raises(wb.ConfigurationError, match=r"setup must be a function setup\(repl\).*received int"):
        wb.compare_numerics(3, data=x, global_batch_size=32)
    with pytest.raises(
        wb.ConfigurationError, match=r"replicas must be an integer >= 1; received replicas=0\. Example"
    ):
        wb.compare_numerics(sgd_setup, data=x, global_batch_size=32, replicas=0)
    with pytest.raises(wb.ConfigurationError, match=r"global_batch_size=None.*Example"):
        wb.compare_numerics(sgd_setup, data=x)
    with pytest.raises(
        wb.ConfigurationError, match=r"reduce\['loss'\] must be 'mean' or 'sum'; received 'max'"
    ):
        wb.compare_numerics(sgd_setup, data=x, global_batch_size=32, reduce={"loss": "max"})
    with pytest.raises(wb.InputError, match=r"does not divide across 4 replicas: received .*\(30, 8\)\. Fix"):
        wb.compare_numerics(sgd_setup, data=x, global_batch_size=30, replicas=4)
    with pytest.raises(wb.StepFunctionError, match=r"setup must return step_fn .*returned builtins.int.*Fix"):
        wb.compare_numerics(lambda repl: 3, data=x, global_batch_size=32)
    with pytest.raises(
        wb.ConfigurationError, match=r"compares one device with several replicas.*Fix: replicas=2"
    ):
        wb.check_loss_scaling(sgd_setup, xy_input, replicas=1)
    with pytest.raises(
        wb.ConfigurationError, match=r"axis=\.\.\.\) takes one integer axis.*received axis='x'"
    ):
        wb.CrossReplicaBatchNorm(axis="x")
    with pytest.raises(wb.ConfigurationError, match=r"momentum=1.5"):
        wb.CrossReplicaBatchNorm(momentum=1.5)
    with pytest.raises(wb.ConfigurationError, match=r"plot_numerics takes the DataFrame"):
        wb.plot_numerics([1, 2])


def test_error_when_setup_builds_no_variables():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])  # outside setup: shared

    def setup(repl):
        return lambda x: {"y": model(x)}

    with pytest.raises(
        wb.ConfigurationError, match=r"setup created no variables.*Fix: build the model inside setup"
    ):
        wb.compare_numerics(setup, data=np.zeros((64, 8), "float32"), global_batch_size=32)


def test_error_when_the_two_runs_see_different_data():
    calls = itertools.count()

    def drifting_input(ctx):  # a new offset on every call, like an unseeded shuffle
        offset = float(next(calls))
        return tf.data.Dataset.from_tensor_slices(_X + offset).batch(GLOBAL_BATCH).repeat()

    with pytest.raises(wb.InputError, match=r"received different data.*Fix: seed any shuffle"):
        wb.compare_numerics(sgd_setup, drifting_input, replicas=2)


def test_error_when_step_fn_applies_no_gradients():
    def setup(repl):
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        return lambda x, y: {"loss": tf.reduce_mean(model(x))}

    with pytest.raises(wb.StepFunctionError, match=r"step_fn applied no gradients.*Fix"):
        wb.check_loss_scaling(setup, xy_input, replicas=2)


def test_import_workbench_does_not_import_tensorflow():
    code = "import sys, workbench as wb; wb.compare_numerics; wb.CrossReplicaBatchNorm; assert 'tensorflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_compare_numerics_on_a_replicator_already_in_use():
    """What `%replicate --compare` does: the session's replicator, which holds earlier variables,
    is the distributed side; only what setup builds is compared, earlier variables are untouched."""
    repl = wb.replicator("mirrored", num_replicas=2)
    with repl.context():
        earlier = tf.Variable([5.0, 6.0], name="earlier")
    x = np.random.default_rng(1).normal(size=(64, 8)).astype("float32")
    table = wb.compare_numerics(sgd_setup, data=x, global_batch_size=32, replicas=repl, steps=2)
    assert table.attrs["replicas"] == 2 and table.max_abs_diff.max() < 1e-6
    names = set(table.name)
    assert "earlier" not in names and sum(n.endswith("kernel") for n in names) == 2  # setup's model only
    assert repl._created_variables[0] is earlier and earlier.numpy().tolist() == [5.0, 6.0]
