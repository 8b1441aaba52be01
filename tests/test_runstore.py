"""Run history: every run recorded (config, history, figure, TensorBoard), listed and reloaded."""

import glob
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
from notebook_toy import define_toy, isolated_notebook_state
from tensorflow.python.summary.summary_iterator import summary_iterator

import workbench as wb
from workbench._src.sinks import runstore


def wait_for(condition, timeout=60):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def runs_dir(tmp_path):
    with isolated_notebook_state(tmp_path / "runs"):
        yield tmp_path / "runs"


@pytest.fixture(scope="module")
def toy():
    return define_toy(wb.replicator("mirrored", num_replicas=2), {})


def test_import_workbench_stays_light():
    code = (
        "import sys, workbench; workbench.RayCluster(address='auto'); "
        "print(sorted({'tensorflow', 'matplotlib', 'ipywidgets', 'pandas', 'IPython', 'ray'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_a_run_is_recorded_with_config_history_figure_and_tensorboard(runs_dir, toy):
    run = toy["repl"].train(toy["step_fn"], toy["input_fn"], steps=60, steps_per_execution=20)
    folder = runs_dir / run.id
    assert sorted(os.listdir(folder)) == ["config.json", "dashboard.png", "events.jsonl", "history.csv", "tb"]
    record = json.loads((folder / "config.json").read_text())
    assert record["status"] == "finished" and record["config"]["backend"] == "mirrored"
    assert record["config"]["num_replicas"] == 2 and record["summary"]["steps_recorded"] == 60
    history = pd.read_csv(folder / "history.csv")
    pd.testing.assert_frame_equal(history, run.history, check_dtype=False)
    assert (folder / "dashboard.png").read_bytes().startswith(b"\x89PNG")
    kinds = [json.loads(line)["kind"] for line in (folder / "events.jsonl").read_text().splitlines()]
    assert kinds == ["started", "ended"]
    assert record["breakdown"]["rows"] and record["breakdown"]["text"]  # where its steps went: the latest
    # TensorBoard: one scalar per step and metric, tagged as the scalars plugin expects.
    (events_file,) = glob.glob(str(folder / "tb" / "events.out.tfevents.*"))
    values = {}
    for e in summary_iterator(events_file):
        for v in e.summary.value:
            assert v.metadata.plugin_data.plugin_name == "scalars"
            values.setdefault(v.tag, []).append((e.step, float(tf.make_ndarray(v.tensor))))
    assert [s for s, _ in values["loss"]] == list(range(1, 61))
    np.testing.assert_allclose([x for _, x in values["loss"]], run.history["loss"], rtol=1e-6)
    assert len(values["examples_per_sec"]) == 40  # the first (compiling) chunk is untimed: NaN, not written


def test_runs_lists_them_and_load_run_reloads_one(runs_dir, toy):
    a = toy["repl"].train(toy["step_fn"], toy["input_fn"], steps=10)
    b = toy["repl"].train(toy["step_fn"], toy["input_fn"], steps=20)
    table = wb.runs()
    assert table["id"].tolist() == [a.id, b.id]
    assert table["status"].tolist() == ["finished", "finished"]
    assert table["steps"].tolist() == [10, 20] and table["backend"].tolist() == ["mirrored"] * 2
    for column in ("replicas", "started", "duration_s", "examples_per_sec", "loss", "path"):
        assert column in table.columns
    rec = wb.load_run(b.id)
    assert rec.status == "finished" and rec.config["steps"] == 20 and rec.summary["steps_recorded"] == 20
    pd.testing.assert_frame_equal(rec.history, b.history, check_dtype=False)
    assert wb.load_run(-1).id == b.id and wb.load_run(0).id == a.id and wb.load_run(b).id == b.id
    assert rec.figure_path.exists() and "<img src='data:image/png;base64," in rec._repr_html_()


def test_load_run_mistakes(runs_dir, toy):
    run = toy["repl"].train(toy["step_fn"], toy["input_fn"], steps=3)
    with pytest.raises(
        wb.ConfigurationError,
        match=rf"No recorded run 'nope' under .*the latest: {run.id}.*Fix: pick an id from wb.runs\(\)",
    ):
        wb.load_run("nope")
    with pytest.raises(
        wb.ConfigurationError, match=r"load_run\(5\) asked for position 5, but .* holds 1 recorded run"
    ):
        wb.load_run(5)


def test_failed_stopped_and_lost_runs_are_recorded(runs_dir, toy):
    repl = toy["repl"]

    def bad_input(ctx):  # element 5 is not finite: check_numerics fails inside the compiled loop
        x = tf.data.Dataset.range(10**6).map(lambda i: tf.fill([4, 1], tf.where(i == 5, np.inf, 1.0)))
        return x.map(lambda v: tf.debugging.check_numerics(v, "bad input"))

    with pytest.raises(tf.errors.InvalidArgumentError):
        repl.train(lambda x: {"loss": tf.reduce_mean(x)}, bad_input, steps=20, steps_per_execution=1)
    failed = wb.load_run(-1)
    assert (
        failed.status == "failed"
        and "bad input" in json.loads((failed.path / "config.json").read_text())["stop_reason"]
    )
    assert failed.history["step"].tolist() == [1, 2, 3, 4, 5]

    run = repl.train(toy["step_fn"], toy["input_fn"], steps=10**7, background=True)
    wait_for(lambda: run.steps >= 5)
    run.stop().wait(30)
    assert wb.load_run(run.id).status == "stopped"

    # A record left "running" by a process that is gone (a dead kernel) reads as lost.
    lost = runs_dir / "20200101-000000-001"
    lost.mkdir()
    (lost / "config.json").write_text(
        json.dumps(
            {
                "id": lost.name,
                "status": "running",
                "pid": 2**22 + 12345,
                "host": os.uname().nodename,
                "started": 1.0,
            }
        )
    )
    assert wb.runs().set_index("id").loc[lost.name, "status"] == "lost"


def test_runs_dir_from_env_function_and_logdir(tmp_path, monkeypatch, toy):
    with isolated_notebook_state(tmp_path / "a"):
        assert runstore.runs_dir() == tmp_path / "a"
        wb.set_runs_dir(None)
        monkeypatch.setenv("WORKBENCH_RUNS_DIR", str(tmp_path / "env"))
        assert runstore.runs_dir() == tmp_path / "env"
        monkeypatch.delenv("WORKBENCH_RUNS_DIR")
        assert str(runstore.runs_dir()) == "runs"
        with runstore.directory(tmp_path / "logdir"):
            run = toy["repl"].train(toy["step_fn"], toy["input_fn"], steps=2)
        assert (tmp_path / "logdir" / run.id / "config.json").exists()
        assert wb.runs(tmp_path / "logdir")["id"].tolist() == [run.id]


def test_history_is_flushed_while_running(runs_dir, toy, monkeypatch):
    monkeypatch.setattr(runstore, "FLUSH_SECONDS", 0.0)
    run = toy["repl"].train(toy["step_fn"], toy["input_fn"], steps=10**7, background=True)
    folder = runs_dir / run.id
    try:
        wait_for(lambda: (folder / "history.csv").exists() and run.steps >= 50)
        partial = pd.read_csv(folder / "history.csv")
        assert len(partial) >= 1 and list(partial.columns[:3]) == ["step", "wall_time", "examples_per_sec"]
        assert json.loads((folder / "config.json").read_text())["status"] == "running"
    finally:
        run.stop().wait(30)


def test_one_truth_summary_run_store_and_runs_table_agree(runs_dir, toy):
    """steps/s and examples/s: one definition (workbench/_src/core/run_stats.py) wherever shown."""
    from workbench._src.core.run_stats import fmt

    a = toy["repl"].train(toy["step_fn"], toy["input_fn"], steps=60, steps_per_execution=20)
    b = toy["repl"].train(toy["step_fn"], toy["input_fn"], steps=40, steps_per_execution=20)
    summary = b.summary()
    # The second run of the same program counts its own steps (not the program's 61..100), in
    # its history too; the program's own count is the global_step column.
    assert summary["steps"] == 40 and b.history["step"].tolist() == list(range(1, 41))
    first = a.history["global_step"].iloc[-1] + 1  # (the toy model is shared by the module)
    assert b.history["global_step"].tolist() == list(range(first, first + 40))
    assert summary["steps_per_sec"] > 0 and summary["examples_per_sec"] > 0
    # examples/s is steps/s times the batch (the toy's global batch: 16 examples a step).
    assert summary["examples_per_sec"] == pytest.approx(summary["steps_per_sec"] * 16, rel=2e-3)
    record = json.loads((runs_dir / b.id / "config.json").read_text())["summary"]
    table = wb.runs().set_index("id")
    for key in ("steps_per_sec", "examples_per_sec", "median_examples_per_sec"):
        assert record[key] == summary[key], (key, record[key], summary[key])
    for key in ("steps_per_sec", "examples_per_sec"):
        assert table.loc[b.id, key] == summary[key]
    html = b._repr_html_()
    assert f"<td data-key='steps_per_sec'>{fmt(summary['steps_per_sec'])}</td>" in html

    fig, rows = wb.compare_runs([a.id, b])
    assert rows["id"].tolist() == [a.id, b.id] and rows["steps"].tolist() == [60, 40]
    assert rows.loc[1, "steps_per_sec"] == summary["steps_per_sec"] and "loss" in rows
    assert [ax.get_title() for ax in fig.axes] == ["loss", "examples/s per step (smoothed)"]
    assert len(fig.axes[0].get_lines()) == 2  # one (smoothed) loss curve per run
    assert wb.compare_runs([-2, -1]).png().startswith(b"\x89PNG")
    with pytest.raises(wb.ConfigurationError, match=r"compare_runs needs two or more runs; received 1"):
        wb.compare_runs([a.id])

    assert wb.delete_runs([a.id]) == [a.id] and wb.runs()["id"].tolist() == [b.id]
    assert not (runs_dir / a.id).exists()


def test_compare_view_data_series_names_hparams_and_median_label(runs_dir, toy):
    """What the JupyterLab compare view and run table receive (labcomm's replies): each run's
    loss and examples/s series under its store name, at most MAX_POINTS points, NaN as None; the
    table rows carry each run's hparams; the median is labelled as the compiled step's."""
    import workbench._src.store.compare as compare
    from workbench._src.notebook import lab_store

    a = toy["repl"].train(
        toy["step_fn"], toy["input_fn"], steps=30, name="lr high", hparams={"lr": 0.1, "opt": "sgd"}
    )
    b = toy["repl"].train(toy["step_fn"], toy["input_fn"], steps=20, name="plain")
    reply = lab_store.answer("compare", {"run_ids": [a.id, b.id]}, forget=list)
    assert reply["type"] == "compare", reply
    first, second = reply["series"]
    assert (first["id"], first["name"], second["name"]) == (a.id, "lr high", "plain")
    assert first["step"] == list(range(1, 31)) and len(first["loss"]) == len(first["examples_per_sec"]) == 30
    assert first["loss"] == pytest.approx(a.history["loss"].tolist())
    assert all(v is None or v > 0 for v in first["examples_per_sec"])
    json.dumps(reply, allow_nan=False)  # the browser's JSON.parse takes no NaN
    assert [r["name"] for r in reply["rows"]] == ["lr high", "plain"]

    # A long run is thinned evenly to MAX_POINTS, first and last steps kept; NaN -> None.
    history = pd.DataFrame({"loss": np.linspace(1.0, 0.0, 5000), "examples_per_sec": np.nan})
    long = compare._Loaded("x", "long", "finished", {}, history)
    (thin,) = compare.series([long])
    assert len(thin["step"]) == compare.MAX_POINTS and thin["step"][0] == 1 and thin["step"][-1] == 5000
    assert thin["loss"][0] == 1.0 and thin["loss"][-1] == 0.0 and set(thin["examples_per_sec"]) == {None}
    (no_loss,) = compare.series([long._replace(history=history[["examples_per_sec"]])])
    assert no_loss["loss"] is None

    # The runs table: hparams as recorded (wb.runs() spreads them into columns).
    rows = {r["id"]: r for r in lab_store.runs_rows()}
    assert rows[a.id]["hparams"] == {"lr": 0.1, "opt": "sgd"} and rows[b.id]["hparams"] is None
    # The DataFrame keeps its column names (callers index them); its rendering says what the median is.
    result = wb.compare_runs([a.id, b.id])
    assert "median_examples_per_sec" in result.table.columns
    assert "<th>median compiled step examples/s</th>" in result._repr_html_()


def test_replicate_tensorboard_points_at_the_run_store_event_files(runs_dir, toy):
    """`%replicate --tensorboard [RUN]`: the run's tb/ folder (written by the store), through
    IPython's %tensorboard; without the tensorboard package, a UsageError saying how to get it."""
    import importlib.util

    from IPython.core.error import UsageError
    from notebook_toy import ipython_shell

    from workbench._src.notebook.tensorboard_view import logdir_for

    run = toy["repl"].train(toy["step_fn"], toy["input_fn"], steps=5)
    assert logdir_for("latest") == logdir_for(run.id) == runs_dir / run.id / "tb"
    assert logdir_for("all") == runs_dir and any((runs_dir / run.id / "tb").iterdir())
    ip = ipython_shell()
    with pytest.raises(UsageError, match=r"No recorded run 'nope'"):
        ip.run_line_magic("replicate", "--tensorboard nope")
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(
            UsageError, match=rf"TensorBoard is not installed.*{run.id}/tb.*pip install tensorboard"
        ):
            ip.run_line_magic("replicate", "--tensorboard")


def test_runs_have_identity_and_configuration_columns(runs_dir, toy):
    """Issue 23: an id unique across kernels, a readable unique name, source, tags, the
    configuration and hparams as wb.runs() columns; a second run's steps start at 1 (CSV too)."""
    a = toy["repl"].train(toy["step_fn"], toy["input_fn"], steps=30, steps_per_execution=10,
                          tags=["baseline"], hparams={"lr": 0.05, "optimizer": "sgd"})  # fmt: skip
    b = toy["repl"].train(toy["step_fn"], toy["input_fn"], steps=20, name=a.name)
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", a.id) and a.id != b.id
    # The default name says what ran and when; a clash in the store gets a suffix.
    assert re.fullmatch(r"mirrored x2 \u00b7 .*\d\d:\d\d", a.name), a.name
    assert b.name == f"{a.name} (2)"
    table = wb.runs().set_index("id")
    for column in ("id", "name", "status", "source", "started", "tags", "backend", "replicas", "workers",
                   "ps", "global_batch", "steps", "steps_per_execution", "lr", "optimizer"):  # fmt: skip
        assert column in table.reset_index().columns, column
    row = table.loc[a.id]
    assert (row["name"], row["backend"], row["replicas"], row["workers"], row["ps"]) == (
        a.name,
        "mirrored",
        2,
        1,
        0,
    )
    assert (row["global_batch"], row["steps"], row["steps_per_execution"]) == (16, 30, 10)
    assert (row["tags"], row["lr"], row["optimizer"]) == ("baseline", 0.05, "sgd")
    assert table.loc[b.id, "name"] == b.name and table["name"].is_unique
    # Steps from the run's start everywhere: history, CSV export, TensorBoard.
    assert b.history["step"].tolist() == list(range(1, 21))
    first = a.history["global_step"].iloc[-1] + 1  # (the toy model is shared by the module)
    assert b.history["global_step"].tolist() == list(range(first, first + 20))
    csv = pd.read_csv(runs_dir / b.id / "history.csv")
    assert csv["step"].tolist() == list(range(1, 21)) and csv["global_step"].iloc[0] == first


def test_names_are_unique_across_kernels_sharing_a_store(runs_dir):
    """Two processes naming runs alike in one store: the second gets a suffix (store lock)."""
    code = (
        "import sys, workbench as wb; wb.set_runs_dir(sys.argv[1]);"
        "from workbench._src.core.run import Run; from workbench._src.sinks import attach_default_sinks;"
        "runs = [Run({'backend': 'mirrored', 'num_replicas': 4}, name='shared') for _ in range(3)];"
        "[attach_default_sinks(r) for r in runs]; print('|'.join(r.name for r in runs))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(runs_dir)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    names = [n for p in procs for n in p.communicate(timeout=60)[0].strip().split("|")]
    assert sorted(names) == ["shared"] + [f"shared ({i})" for i in range(2, 7)]
    table = wb.runs()
    assert table["name"].is_unique and len(table) == 6 and table["id"].is_unique


def test_rename_and_tag_runs(runs_dir, toy):
    a = toy["repl"].train(toy["step_fn"], toy["input_fn"], steps=5)
    b = toy["repl"].train(toy["step_fn"], toy["input_fn"], steps=5)
    assert wb.rename_run(a, "baseline lr=0.05") == "baseline lr=0.05" and a.name == "baseline lr=0.05"
    with pytest.raises(wb.ConfigurationError, match=rf"run {a.id} is already named 'baseline lr=0.05'"):
        wb.rename_run(b.id, "baseline lr=0.05")
    assert wb.tag_run(b.id, "sweep", "lr") == ["sweep", "lr"] and b.tags == ["sweep", "lr"]
    assert wb.tag_run(b, "best") == ["sweep", "lr", "best"]
    assert wb.tag_run(b, "only", replace=True) == ["only"]
    with pytest.raises(
        wb.ConfigurationError, match=r"a tag is a non-empty string without commas; received 'a,b'"
    ):
        wb.tag_run(b, "a,b")
    table = wb.runs().set_index("id")
    assert table.loc[a.id, "name"] == "baseline lr=0.05" and table.loc[b.id, "tags"] == "only"
    _, rows = wb.compare_runs([a, b])
    assert rows["name"].tolist() == ["baseline lr=0.05", b.name]  # legends and table use the names


def test_a_run_failing_before_its_first_step_keeps_its_configuration(runs_dir, toy):
    def broken_step(x, y):
        raise ValueError("no step today")

    with pytest.raises(Exception, match="no step today"):
        toy["repl"].train(broken_step, toy["input_fn"], steps=5, name="broken", tags=["t"])
    row = wb.runs().iloc[-1]
    assert (row["name"], row["status"], row["backend"], row["replicas"], row["steps_asked"], row["tags"]) == (
        "broken", "failed", "mirrored", 2, 5, "t")  # fmt: skip


def test_examples_per_step_equals_the_global_batch_in_process(runs_dir, toy):
    """examples/s / steps/s is the global batch (16) on the same window, per-step and fused."""
    for spe in (1, 7, "auto"):
        run = toy["repl"].train(toy["step_fn"], toy["input_fn"], steps=80, steps_per_execution=spe)
        s = run.summary()
        assert s["examples_per_sec"] / s["steps_per_sec"] == pytest.approx(16, rel=0.01), (spe, s)
    single = wb.replicator("single")
    ns = define_toy(single, {})
    s = single.train(ns["step_fn"], ns["input_fn"], steps=50).summary()
    assert s["examples_per_sec"] / s["steps_per_sec"] == pytest.approx(16, rel=0.01)


def test_tensorboard_writer_does_not_retrace(runs_dir, toy):
    """No 'triggered tf.function retracing' warning from our writer, however many runs."""
    import logging

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("tensorflow")  # (TensorFlow's logger does not propagate)
    logger.addHandler(handler)
    try:
        for _ in range(7):
            run = toy["repl"].train(toy["step_fn"], toy["input_fn"], steps=3)
            runstore._write_tensorboard(runs_dir / run.id / "tb2", run.history.to_dict("list"))
    finally:
        logger.removeHandler(handler)
    assert not [m for m in seen if "retracing" in m], seen


def test_delete_runs_refuses_a_symbolic_link(runs_dir, toy, tmp_path):
    run = toy["repl"].train(toy["step_fn"], toy["input_fn"], steps=3)
    target = runs_dir / run.id
    link = runs_dir / "20200101-000000-abcdef"
    link.symlink_to(target)
    with pytest.raises(
        wb.ConfigurationError, match=r"20200101-000000-abcdef \(a link to .*\) is a symbolic link"
    ):
        wb.delete_runs([run.id, link.name])
    assert target.is_dir() and link.is_symlink()  # nothing was deleted, the target least of all


KILLED_KERNEL = """
import sys, time
import workbench as wb
from workbench._src.sinks import runstore

wb.set_runs_dir(sys.argv[1])
runstore.install()
import tensorflow as tf

repl = wb.NonReplicator()
with repl.context():
    w = tf.Variable(1.0)
run = repl.train(
    lambda x: {"loss": tf.reduce_sum(x) * w},
    lambda ctx: tf.data.Dataset.from_tensors(tf.ones([4])).repeat(),
    steps=10**9, steps_per_execution=50, background=True,
)
print(run.id, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_killed_kernel_loses_at_most_about_a_second_of_history(runs_dir, child_tmpdir):
    kernel = subprocess.Popen(
        [sys.executable, "-c", KILLED_KERNEL, str(runs_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        run_id = kernel.stdout.readline().strip()
        history = runs_dir / run_id / "history.csv"
        wait_for(lambda: history.exists() and len(history.read_text().splitlines()) > 100, timeout=120)
        time.sleep(3.0)  # training at a steady rate, the store flushing as it goes
        killed = time.time()
        kernel.kill()
        kernel.wait(30)
    finally:
        if kernel.poll() is None:
            kernel.kill()
    record = json.loads((runs_dir / run_id / "config.json").read_text())
    rows = pd.read_csv(history)
    lost_seconds = killed - (record["started"] + rows["wall_time"].iloc[-1])
    rate = len(rows) / rows["wall_time"].iloc[-1]
    # Two parts. The store's own: it writes the rows it has about every second (FLUSH_SECONDS),
    # so its last write came less than that (and a chunk's rows) before the kill. Then the rows'
    # way to the store: a row written was made a moment before, longer on a busy machine (a
    # fresh-clone suite beside two busy TensorFlow jobs once lost 1.87 s in all), so it is only
    # printed.
    last_write = os.stat(history).st_mtime
    age_when_written = last_write - (record["started"] + rows["wall_time"].iloc[-1])
    assert killed - last_write < 1.6, (
        f"{lost_seconds:.2f} s of history lost (~{lost_seconds * rate:.0f} rows): the last write "
        f"{killed - last_write:.2f} s before the kill, its last row {age_when_written:.2f} s old then"
    )
    assert wb.runs(runs_dir).set_index("id").loc[run_id, "status"] == "lost"
