"""Scaling studies you can trust on a shared machine, and study.forecast().

The forecast's arithmetic is checked against the stated ring all-reduce model; the load meter
against a real busy process outside the study's own process tree.
"""

from __future__ import annotations

import subprocess
import sys
import time

import keras
import pytest
import tensorflow as tf

import workbench as wb
from workbench._src.studies.forecast import forecast, ring_allreduce_seconds
from workbench._src.studies.measurements import LoadMeter
from workbench._src.studies.scaling import ScalingStudy

BASELINE = {
    "replicas": 1, "per_replica_batch": 32, "examples_per_sec": 3000.0, "input_s": 0.001,
    "compute_s": 0.008, "communication_s": 0.0, "other_s": 0.001, "gradient_bytes": 4e6,
}  # fmt: skip


def test_ring_all_reduce_model():
    # 2 (N-1)/N x bytes / bandwidth + 2 (N-1) x latency: 4 MB over 1 Gbit/s among 4 workers
    assert ring_allreduce_seconds(4e6, 4, 1.0, 50e-6) == pytest.approx(1.5 * 4e6 / 125e6 + 6 * 50e-6)
    assert ring_allreduce_seconds(4e6, 1, 1.0, 50e-6) == 0.0  # alone: nothing to exchange
    assert ring_allreduce_seconds(4e6, 8, None, 50e-6) == 0.0  # a link not modelled


def test_forecast_from_a_baseline_weak_and_strong():
    table = forecast(BASELINE, [1, 2, 64], link_gbps=1.0, latency_us=0.0)
    one, two, many = (table.iloc[i] for i in range(3))
    assert one["speedup"] == pytest.approx(1.0) and one["communication_ms"] == 0.0
    assert two["communication_ms"] == pytest.approx(1e3 * 4e6 / 125e6)  # 2 (2-1)/2 x B / bw
    assert two["step_ms"] == pytest.approx(10.0 + 32.0)
    assert two["efficiency"] == pytest.approx(10.0 / 42.0)
    assert many["communication_ms"] > two["communication_ms"]
    strong = forecast(BASELINE, [4], link_gbps=1000.0, latency_us=0.0, mode="strong").iloc[0]
    assert strong["compute_ms"] == pytest.approx(2.0) and strong["input_ms"] == pytest.approx(0.25)
    # d devices per worker: one pipeline feeds them all; the ring inside is free unless given
    packed = forecast(BASELINE, [2], link_gbps=1.0, devices_per_worker=8, latency_us=0.0).iloc[0]
    assert packed["replicas"] == 16 and packed["input_ms"] == pytest.approx(8.0)


def test_forecast_prints_numbers_as_people_read_them_and_its_assumptions():
    table = forecast({**BASELINE, "compute_s": 0.8}, [8, 16, 64], link_gbps=10.0)
    text = repr(table)
    assert "e+0" not in text and "e-0" not in text, text
    assert "ring all-reduce across workers, 2(N-1)/N x bytes / 10 Gbit/s" in text
    assert "no overlap of all-reduce and compute" in text
    assert "assumptions" in table._repr_html_()


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (
            {"workers": [0, 8]},
            r"workers must be a list of positive worker counts, e.g. \[8, 16, 64\]; received workers=\[0, 8\]",
        ),
        (
            {"link_gbps": 0},
            r"link_gbps must be a positive number; received link_gbps=0\. Fix: e\.g\. link_gbps=10",
        ),
        (
            {"devices_per_worker": 0},
            r"devices_per_worker must be an integer >= 1; received devices_per_worker=0",
        ),
    ],
)
def test_forecast_errors_say_what_was_received(kwargs, pattern):
    args = {"workers": [8], "link_gbps": 10.0, **kwargs}
    with pytest.raises(wb.ConfigurationError, match=pattern):
        forecast(BASELINE, **args)


def test_every_efficiency_point_stays_on_the_plot_and_numbers_read_plainly():
    study = ScalingStudy("weak", [1, 2])
    base = {"global_batch": 64, "per_replica_batch": 64, "step_time_median_s": 0.01, "step_time_p90_s": 0.012}
    study.points = [
        {**base, "replicas": 1, "examples_per_sec": 6210.0},
        {**base, "replicas": 2, "global_batch": 128, "examples_per_sec": 22105.0},  # 178%
    ]
    assert study.table["efficiency"].iloc[1] == pytest.approx(1.78, abs=0.01)
    top = study.figure.axes[2].get_ylim()[1]
    assert top >= 178, top
    html = study._repr_html_()
    assert "22,105" in html and "e+0" not in html


def test_the_load_meter_sees_a_busy_process_outside_the_study():
    # A busy loop re-parented to init (the shell exits at once): not in this process's tree.
    code = "import time\nend = time.time() + 3\nwhile time.time() < end: pass"
    subprocess.run(["sh", "-c", f"{sys.executable} -c '{code}' >/dev/null 2>&1 &"], check=True)
    time.sleep(0.3)
    with LoadMeter() as load:
        time.sleep(1.5)  # the study's own process idles
    reading = load.reading()
    assert reading["others_cores"] >= 0.5 and reading["unreliable"], reading
    assert "other processes kept" in reading["load_note"]


def test_a_study_repeats_interleaved_and_carries_the_breakdown():
    def setup(repl, ctx):
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(32)])
        opt = repl.wrap_optimizer(keras.optimizers.SGD(0.01))

        def input_fn(c):
            return tf.data.Dataset.from_tensors(tf.ones([ctx.global_batch_size, 32])).repeat()

        def step_fn(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x)))
            opt.minimize(loss, model.trainable_variables, tape=tape)
            return {"loss": loss}

        return step_fn, input_fn

    study = wb.scaling_study(
        setup=setup, replicas=[1, 2], steps=20, warmup=2, batch_size=8, repeats=2, live=False
    )
    table = study.table
    assert list(table["repeats"]) == [2, 2] and (table["spread"] >= 0).all()
    names = [run.name for run in study.runs.values()]
    assert all(" #2 " in name for name in names), names  # the last round's runs
    parts = table[["input_s", "compute_s", "communication_s", "other_s"]]
    assert parts.notna().all().all() and (parts.sum(axis=1) > 0).all()
    assert table["gradient_bytes"].iloc[0] == (32 * 32 + 32) * 4  # the Dense layer's gradients
    assert {"unreliable", "load_note", "others_cores"} <= set(table.columns)
    predicted = study.forecast(workers=[2, 4], link_gbps=1.0)
    assert list(predicted["workers"]) == [2, 4] and (predicted["efficiency"] <= 1.0).all()
