"""`workbench` CLI loose ends (issue 41): the progress line's figures are the summary's, every
option's help says what it does and its default, and a long command says what it is doing."""

import contextlib
import io
import os
import re
import signal
import subprocess
import sys

import pytest

from workbench._src.core.run import Event
from workbench._src.core.run_stats import describe, figures
from workbench._src.sinks.progress import ProgressPrinter


def _async_ps_rows(steps: int = 200, step_seconds: float = 0.01, workers: int = 2):
    """Rows as an async-ps run relays them: each worker takes `step_seconds` a step and reports
    its own examples/s; with two workers, rows arrive twice as often as one worker steps."""
    rows, done = [], [0.0] * workers
    for i in range(steps):
        w = i % workers
        done[w] += step_seconds
        rows.append({"step": i + 1, "wall_time": round(done[w] + w * step_seconds / workers, 6),
                     "examples_per_sec": 128 / step_seconds, "examples": 128, "loss": 1.0})  # fmt: skip
    rows.sort(key=lambda r: r["wall_time"])
    return rows


def test_the_final_progress_line_says_the_summarys_examples_per_second():
    rows = _async_ps_rows()
    printer = ProgressPrinter(len(rows))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for start in range(0, len(rows), 20):
            printer(Event("metrics", "r", 0.0, start, {"rows": rows[start : start + 20]}))
    last = out.getvalue().strip().splitlines()[-1]
    history = {k: [r[k] for r in rows] for k in ("wall_time", "examples_per_sec", "examples")}
    summary = figures(history, running=False, target_steps=len(rows))
    assert last.endswith(describe(summary)), (last, summary)
    assert summary["examples_per_sec"] == pytest.approx(summary["steps_per_sec"] * 128, rel=1e-3)
    assert " examples 128" not in last  # bookkeeping columns are not metrics


def _options(parser):
    sub = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    for command, subparser in sub.choices.items():
        for action in subparser._actions:
            if action.option_strings and action.dest != "help":
                yield command, subparser, action


def test_every_option_of_every_command_says_what_it_does_and_its_default():
    from workbench.cli import build_parser

    seen = set()
    for command, subparser, action in _options(build_parser()):
        seen.add(command)
        text = subparser.formatter_class(prog="x")._get_help_string(action)
        assert len(action.help or "") > 8, f"workbench {command} {action.option_strings[0]}: no help"
        if action.default not in (None, False):
            assert "default" in text, f"workbench {command} {action.option_strings[0]}: {text!r}"
    assert seen == {"demo", "run", "scale"}
    demo = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "demo", "--help"], capture_output=True, text=True
    )
    assert re.search(r"--replicas N +mirrored replicas .*\(default: 4\)", demo.stdout), demo.stdout
    assert re.search(r"--steps N +training steps .*\(default: 600\)", demo.stdout), demo.stdout
    run = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "run", "--help"], capture_output=True, text=True
    )
    assert re.search(r"(?s)--startup-timeout SECONDS\s+seconds to wait .*\(default: 120.0\)", run.stdout), (
        run.stdout
    )


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.parametrize(
    "argv, said",
    [
        (["demo", "--steps", "5"], "importing TensorFlow"),
        (["run", TOY := os.path.join(os.path.dirname(__file__), "data", "toy_train.py"), "--steps", "5"],
         "importing TensorFlow, then running toy_train.py"),
        (["run", TOY, "--steps", "5", "--backend", "async-ps", "--workers", "2"],
         "starting 4 processes (2 workers, 1 parameter server, a coordinator) here"),
    ],
)  # fmt: skip
def test_a_long_command_first_says_what_it_is_doing(argv, said, tmp_path):
    # What happened, not wall seconds: the first line comes before TensorFlow's import, after
    # well under 2 CPU-seconds of the command (a busy machine stretches the wall time, not this).
    process = subprocess.Popen(
        [sys.executable, "-m", "workbench.cli", *argv], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        first = process.stdout.readline()
        cpu = _cpu_seconds(process.pid)
    finally:  # (the run itself is not what is tested)
        if "--backend" in argv:  # it started a fork server: Ctrl-C, so it ends what it started
            process.send_signal(signal.SIGINT)
        else:  # nothing started yet but this process, busy importing TensorFlow
            process.kill()
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    assert first.startswith("[workbench] ") and said in first, first
    assert cpu < 2.0, cpu


def test_the_progress_lines_are_the_runs_snapshots():
    """`workbench run`'s progress lines show the run's snapshot (core/live.py), the one the cell,
    the sidebar and the status bar show; the last line is the final snapshot (run.summary())."""
    import workbench as wb
    from workbench._src.core.run_stats import describe

    printer = ProgressPrinter(400)
    out = io.StringIO()
    snapshots = []

    def keep(event):
        if "snapshot" in event.data:
            snapshots.append(event.data["snapshot"])

    import tensorflow as tf

    def input_fn(ctx):
        return tf.data.Dataset.from_tensors(tf.ones([8, 2])).repeat()

    def step_fn(x):
        import time as _time

        return {"loss": tf.reduce_mean(x) + tf.py_function(lambda: _time.sleep(0.004) or 0.0, [], tf.float32)}

    with contextlib.redirect_stdout(out):
        run = wb.replicator("single").train(step_fn, input_fn, steps=400, sinks=[keep, printer])
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    by_steps = {s["steps"]: s for s in snapshots}
    assert len(lines) >= 2, out.getvalue()
    for line in lines:
        steps = int(re.match(r"step (\d+)/400", line).group(1))
        assert steps in by_steps and line.endswith(describe(by_steps[steps])), (line, by_steps.get(steps))
    final = run.snapshot
    assert final["final"] and lines[-1].startswith("step 400/400") and lines[-1].endswith(describe(final))
    assert describe(final) == describe({**run.summary()})


def test_the_readmes_commands_write_only_where_they_say():
    """The README's `workbench run` / `scale` lines name a folder for every file they write
    (history.csv, study.csv and scaling.png were left in the repository root), and `scale`
    writes its figure only where asked: --out, else beside --csv."""
    import argparse

    from workbench._src.scripts.run_file import _figure_path

    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    commands = re.findall(r"workbench (?:run|scale) [^\n`]*(?:\\\n[^\n`]*)*", readme)
    written = [m for c in commands for m in re.findall(r"--(?:history|csv|out) (\S+)", c)]
    assert written, commands
    assert all("/" in path for path in written), f"written into the working directory: {written}"
    figure = _figure_path(argparse.Namespace(out=None, csv="/tmp/x/study.csv"))
    assert figure == "/tmp/x/study.png"
    assert _figure_path(argparse.Namespace(out=None, csv=None)) is None
    # `workbench demo` (the README's first command) writes its plot to the same results folder.
    from workbench.cli import build_parser

    demo_out = build_parser().parse_args(["demo"]).out
    assert os.path.isabs(demo_out) and "workbench-results" in demo_out, demo_out
    assert "/tmp/workbench-results/workbench-demo.png" in readme
