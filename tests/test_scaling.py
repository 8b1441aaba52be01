"""Scaling studies: complete tables, the arithmetic, the batch sizes each mode promises, the figure."""

import os

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
from toy_models import FEATURES, make_mlp, toy_data

import workbench as wb
from workbench._src.studies.scaling import (
    ScalingContext,
    ScalingStudy,
    reference_speedup,
    scaling_metrics,
    scaling_study,
)
from workbench._src.studies.scaling_live import LiveScalingPlot

FAST = {"steps": 6, "warmup": 2, "steps_per_execution": 3, "live": False}


@pytest.mark.slow
def test_weak_study_with_setup_is_complete_and_starts_each_point_from_the_same_weights(tmp_path):
    import keras

    x, y = toy_data()
    seen, initial = {}, {}

    def setup(repl, ctx):
        model = make_mlp(seed=123)  # reseeds itself; the study seeds too
        initial[ctx.num_replicas] = float(sum(np.abs(w).sum() for w in model.get_weights()))
        opt = repl.wrap_optimizer(keras.optimizers.SGD(0.1))

        def input_fn(ctx):
            assert isinstance(ctx, ScalingContext)
            return (
                tf.data.Dataset.from_tensor_slices((x, y))
                .repeat()
                .batch(ctx.global_batch_size, drop_remainder=True)
            )

        def step_fn(features, labels):
            seen.setdefault(ctx.num_replicas, set()).add(int(features.shape[0]))  # traced shape
            with tf.GradientTape() as tape:
                logits = model(features, training=True)
                loss = tf.reduce_mean(
                    keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
                )
            opt.apply_gradients(
                zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            )
            return {"loss": loss, "batch": tf.cast(tf.shape(features)[0], tf.float32)}

        return step_fn, input_fn

    path = tmp_path / "study" / "scaling.png"
    study = scaling_study(setup=setup, replicas=[1, 2, 4], mode="weak", batch_size=8, path=path, **FAST)
    table = study.table
    assert list(table["replicas"]) == [1, 2, 4]
    numeric = ["examples_per_sec", "step_time_median_s", "step_time_p90_s", "speedup", "efficiency"]
    assert not table[numeric].isna().any().any()
    assert (table["step_time_p90_s"] >= table["step_time_median_s"]).all()
    assert list(table["global_batch"]) == [8, 16, 32]
    assert list(table["per_replica_batch"]) == [8, 8, 8]
    assert seen == {1: {8}, 2: {8}, 4: {8}}
    for run in study.runs.values():
        assert set(run.history["batch"]) == {8.0}  # what step_fn saw, measured steps only
        assert run.steps == 6
    assert len(set(initial.values())) == 1
    assert os.path.getsize(path) > 10_000 and study.path == str(path)
    assert (table["devices_kind"] == "virtual CPU").all()
    assert (table["physical_cores"] == os.cpu_count()).all()
    assert table["threads_note"].str.contains("share").all()
    # One TensorFlow pool shared by the replicas: its threads divided by the virtual CPUs used.
    pool = wb.device_summary()["intra_op_threads"]
    assert list(table["threads_per_replica"]) == [pool / 1, pool / 2, pool / 4]
    assert table["startup_seconds"].isna().all()  # no processes to start in one process
    assert "<img" in study._repr_html_()


def test_strong_study_keeps_the_global_batch_and_splits_it():
    shapes = []

    def input_fn(ctx):
        return tf.data.Dataset.from_tensors(tf.ones([ctx.global_batch_size, FEATURES])).repeat()

    def step_fn(batch):
        shapes.append(int(batch.shape[0]))
        return {"batch": tf.cast(tf.shape(batch)[0], tf.float32)}

    study = scaling_study(step_fn, input_fn, replicas=[1, 2, 4], mode="strong", batch_size=16, **FAST)
    t = study.table
    assert list(t["global_batch"]) == [16, 16, 16]
    assert list(t["per_replica_batch"]) == [16, 8, 4]
    assert sorted(set(shapes)) == [4, 8, 16]
    assert [set(study.runs[n].history["batch"]) for n in (1, 2, 4)] == [{16.0}, {8.0}, {4.0}]


def test_efficiency_arithmetic_on_a_recorded_table():
    recorded = pd.DataFrame(
        {
            "replicas": [4, 1, 2],  # any order: sorted by the function
            "global_batch": [128, 32, 64],  # weak scaling, 32 per replica
            "step_time_median_s": [0.020, 0.010, 0.0125],
        }
    )
    t = scaling_metrics(recorded)
    assert list(t["replicas"]) == [1, 2, 4]
    np.testing.assert_allclose(t["examples_per_sec"], [3200, 5120, 6400])
    np.testing.assert_allclose(t["speedup"], [1.0, 1.6, 2.0])
    np.testing.assert_allclose(t["ideal_speedup"], [1, 2, 4])
    np.testing.assert_allclose(t["efficiency"], [1.0, 0.8, 0.5])
    strong = scaling_metrics(
        {"replicas": [2, 8], "global_batch": [64, 64], "step_time_median_s": [0.04, 0.02]}
    )
    np.testing.assert_allclose(strong["speedup"], [1, 2])
    np.testing.assert_allclose(strong["efficiency"], [1, 0.5])  # baseline is the fewest replicas


def test_public_names():
    assert wb.scaling_study is scaling_study and wb.ScalingStudy is ScalingStudy
    assert {"scaling_study", "ScalingStudy"} <= set(wb.__all__)


def test_reference_from_the_paper_becomes_speedup():
    sp = reference_speedup({1: 7118, 8: 1049, 32: 330, 64: 182})
    assert sp[1] == 1.0
    assert sp[8] == pytest.approx(6.7855, rel=1e-4)
    assert sp[64] == pytest.approx(39.11, rel=1e-3)


def test_live_plot_updates_one_display_in_place(monkeypatch):
    import IPython.display as ipd

    calls = []

    class Handle:
        def update(self, obj):
            calls.append(("update", obj))

    def fake_display(obj, display_id=False):
        calls.append(("display", display_id))
        return Handle()

    monkeypatch.setattr(ipd, "display", fake_display)
    monkeypatch.setattr(ipd, "clear_output", lambda *a, **k: pytest.fail("clear_output called"))
    study = ScalingStudy("weak", [1, 2], reference={1: 1.0, 2: 1.8}, reference_label="ref")
    sink = LiveScalingPlot()
    for n, t in ((1, 0.01), (2, 0.011)):
        study.points.append(
            {"replicas": n, "global_batch": 8 * n, "step_time_median_s": t, "step_time_p90_s": t}
        )
        sink.send(study)
    assert [c[0] for c in calls] == ["display", "update"] and calls[0][1] is True


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"mode": "linear"}, r"mode must be 'weak'.*received mode='linear'"),
        ({"mode": "strong", "batch_size": 6, "replicas": [1, 4]}, r"does not divide by \[4\].*Fix"),
        ({"replicas": [0, 2]}, r"replicas must be a list of positive integers.*received \[0, 2\]"),
        ({"replicas": [1, 16]}, r"needs 16 devices"),
        ({"reference": "nope"}, r"Unknown reference 'nope'"),
        ({"backend": "async-ps"}, r"synchronous steps.*received backend='async-ps'.*Fix: backend='mirrored'"),
    ],
)
def test_errors_say_what_was_received_and_the_fix(kwargs, pattern):
    args = {"step_fn": lambda b: {}, "input_fn": lambda ctx: None, **FAST, **kwargs}
    with pytest.raises(wb.WorkbenchError, match=pattern):
        scaling_study(**args)


def test_input_context_carries_the_batch_size_when_a_study_prescribes_one():
    from workbench._src.core.inputs import InputContext

    plain = InputContext(None, 4)
    assert plain.global_batch_size is None and plain.batch_size_per_replica is None
    ctx = ScalingContext(None, 4, 0, 1, 4, global_batch_size=32, mode="strong")
    assert isinstance(ctx, InputContext) and ctx.batch_size_per_replica == 8
    assert InputContext(None, 4, 0, 1, 4, global_batch_size=32).batch_size_per_replica == 8


@pytest.mark.parametrize("drop_remainder", [True, False])  # static shape, or checked in the pipeline
def test_input_that_ignores_the_prescribed_batch_is_refused(drop_remainder):
    def input_fn(ctx):
        return (
            tf.data.Dataset.from_tensors(tf.ones([FEATURES]))
            .repeat()
            .batch(16, drop_remainder=drop_remainder)
        )

    with pytest.raises(
        wb.ConfigurationError,
        match=r"weak scaling configuration \(2 replica\(s\)\) input_fn must yield batches of 32 "
        r"\(ctx.global_batch_size\).*Fix: batch to the context's size",
    ):
        scaling_study(lambda b: {"s": tf.reduce_sum(b)}, input_fn, replicas=[1, 2], batch_size=16, **FAST)
