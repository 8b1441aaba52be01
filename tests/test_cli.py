"""The command line: `workbench demo` (the README's main job) and `workbench scale FILE.py`."""

import json
import os
import re
import subprocess
import sys

import pandas as pd
import pytest
from helpers import TF_NOISE


@pytest.mark.slow
def test_workbench_demo_prints_a_summary_and_writes_the_plot_quietly(tmp_path):
    # As from a user's shell: no TF_CPP_MIN_LOG_LEVEL set, so TensorFlow's start-up lines would
    # show unless the workbench holds them back (README; the kernel's side is test_quiet_logs.py).
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "WORKBENCH_TF_LOGS")}
    # As the README runs it (no --out), from a clone's root: the plot goes to the results folder
    # of the temp folder (here a private TMPDIR), nothing into the working folder.
    work, private_tmp = tmp_path / "clone", tmp_path / "tmp"
    work.mkdir()
    private_tmp.mkdir()
    env.update(TMPDIR=str(private_tmp), WORKBENCH_RUNS_DIR=str(tmp_path / "runs"))
    png = private_tmp / "workbench-results" / "workbench-demo.png"
    out = subprocess.run(
        ["workbench", "demo", "--replicas", "2", "--steps", "120"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=work,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert not TF_NOISE.search(out.stderr), "workbench demo printed TensorFlow noise:\n" + out.stderr[-3000:]
    assert "backend        : mirrored, 2 replicas, global batch 128" in out.stdout
    assert "steps          : 120 in" in out.stdout
    # What it does while it trains: the run's progress lines, the last one its final figures.
    assert re.search(r"^\[workbench\] compiling step_fn", out.stdout, re.M), out.stdout
    assert re.search(r"^step 120/120 .*examples/s", out.stdout, re.M), out.stdout
    accuracy = float(out.stdout.split("test accuracy  : ")[1].split()[0])
    assert accuracy > 0.8  # 120 Adam steps on digits learn something real
    # One definition of each figure; the median is labelled as such.
    assert re.search(r"throughput     : [\d,.]+ steps/s \u00b7 [\d,.]+ examples/s \(whole run", out.stdout)
    assert re.search(r"median step    : [\d,.]+ examples/s", out.stdout), out.stdout
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert f"plot           : {png}" in out.stdout
    assert list(work.iterdir()) == [], "workbench demo wrote into the working folder"


def test_cli_usage_error_is_clear():
    out = subprocess.run(["workbench", "fly"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "invalid choice: 'fly'" in out.stderr


TOY_SCRIPT = os.path.join(os.path.dirname(__file__), "data", "toy_train.py")


@pytest.mark.slow
def test_workbench_scale_studies_a_script_and_writes_figure_and_table(tmp_path):
    png, csv = tmp_path / "study.png", tmp_path / "study.csv"
    args = ["--replicas", "1,2", "--steps", "10", "--warmup", "3", "--out", str(png), "--csv", str(csv)]
    out = subprocess.run(
        ["workbench", "scale", TOY_SCRIPT, *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    table = pd.read_csv(csv)
    assert list(table["replicas"]) == [1, 2] and list(table["global_batch"]) == [32, 64]
    assert list(table["steps"]) == [10, 10] and table["efficiency"].notna().all()
    assert f"figure: {png}" in out.stdout and "note: 2 virtual CPU device(s) share" in out.stdout
    # A line as each configuration starts: the study is not silent until its table.
    started = re.findall(r"^\[workbench\] scaling weak n=(\d) .*: compiling step_fn", out.stdout, re.M)
    assert started == ["1", "2"], out.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_workbench_scale_bad_input_says_what_and_how():
    out = subprocess.run(
        ["workbench", "scale", TOY_SCRIPT, "--replicas", "1,two"], capture_output=True, text=True, timeout=60
    )
    # the same declaration and message as %replicate --scaling 1,two (workbench/_src/options.py)
    assert out.returncode == 2 and "--replicas" in out.stderr
    assert "expected replica counts separated by commas, such as 1,2,4,8; received '1,two'" in out.stderr
    out = subprocess.run(["workbench", "scale", "missing.py"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no such file: 'missing.py'" in out.stderr


def _run(*argv, env=None):
    return subprocess.run(
        ["workbench", "run", TOY_SCRIPT, "--steps", "5", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_options_that_do_not_fit_the_backend_get_a_sentence_not_a_traceback():
    cases = {
        (
            "--backend",
            "mirrored",
            "--workers",
            "2",
        ): "--workers applies to the multi-worker and async-ps backends",
        (
            "--backend",
            "multi-worker",
            "--ps",
            "1",
        ): "--ps (parameter servers) applies to the async-ps backend",
        ("--backend", "mirrored", "--cluster", "TF_CONFIG"): "--cluster joins a cluster of worker processes",
        ("--backend", "mirorred"): "Unknown replicator backend 'mirorred'",
    }
    for argv, said in cases.items():
        out = _run(*argv)
        assert out.returncode == 2 and said in out.stderr and "Traceback" not in out.stderr, (
            argv,
            out.stderr,
        )
        assert "Fix:" in out.stderr or "Valid names" in out.stderr


# `workbench run ...` in-process, saying at exit whether TensorFlow was imported.
CLI_SAYING_IF_TF_WAS_IMPORTED = """
import atexit, sys
from workbench.cli import main
atexit.register(lambda: print("tensorflow imported:", "tensorflow" in sys.modules))
sys.argv = ["workbench", *sys.argv[1:]]
sys.exit(main())
"""


@pytest.mark.parametrize(
    "backend, config, said",
    [
        (
            "multi-worker",
            '{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}}',
            "has no 'task' saying which task",
        ),
        (
            "async-ps",
            '{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 3}}',
            "has task index 3",
        ),
        ("multi-worker", None, "the TF_CONFIG environment variable is not set"),
    ],
)
def test_a_wrong_tf_config_is_refused_at_once_before_tensorflows_import(backend, config, said):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"} | (
        {"TF_CONFIG": config} if config else {}
    )
    out = subprocess.run(
        [sys.executable, "-c", CLI_SAYING_IF_TF_WAS_IMPORTED, "run", TOY_SCRIPT, "--steps", "5",
         "--backend", backend, "--cluster", "TF_CONFIG"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert out.returncode == 2 and said in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "tensorflow imported: False" in out.stdout  # (it was: 6 s and a TensorFlow start to say it)


def test_history_is_written_when_the_run_fails(tmp_path):
    # The toy file, with an input that breaks at step 9: a batch of 7 features for a model of 8.
    script = tmp_path / "fails.py"
    script.write_text(
        open(TOY_SCRIPT).read()
        + "\n_good = input_fn\n\n\ndef input_fn(ctx):\n"
        + "    bad = tf.data.Dataset.from_tensors((tf.zeros([32, 7]), tf.zeros([32, 1])))\n"
        + "    return _good(ctx).take(8).concatenate(bad)\n"
    )
    history = tmp_path / "h.csv"
    out = subprocess.run(
        [
            "workbench",
            "run",
            str(script),
            "--backend",
            "single",
            "--steps",
            "50",
            "--steps-per-execution",
            "1",
            "--history",
            str(history),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr[-2000:]
    first = out.stderr.strip().splitlines()[0]
    assert first.startswith("workbench run: the run failed after step 8: InvalidArgumentError"), out.stderr[
        -2000:
    ]
    assert f"history up to step 8: {history}" in out.stderr
    assert list(pd.read_csv(history)["step"]) == list(range(1, 9))


@pytest.mark.slow
def test_sigterm_preempts_a_run_at_a_step_boundary_and_keeps_its_history(tmp_path):
    # A scheduler preempting the job (or `kill PID`): the run saves at the next step boundary and
    # ends "preempted", its history and checkpoint written, the process out with status 75
    # (preempted: run the same command again), not 0 (finished) nor 1 (failed).
    import signal

    history, checkpoints = tmp_path / "h.csv", tmp_path / "ckpt"
    process = subprocess.Popen(
        ["workbench", "run", TOY_SCRIPT, "--backend", "single", "--steps", "100000000",
         "--history", str(history), "--checkpoint", str(checkpoints)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        said = []  # what it says before training ("[workbench] importing TensorFlow ...")
        while not (said and said[-1].startswith("step ")):
            said.append(process.stdout.readline())
            assert said[-1], f"it ended before training: {said}"  # (stderr: read once it has ended)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 75, err[-2000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["status"] == "preempted" and summary["stop_reason"].startswith("preempted at step")
    assert "run the same command again" in err
    assert len(pd.read_csv(history)) == summary["steps"]
    assert any(name.startswith("ckpt") for name in os.listdir(checkpoints))


@pytest.mark.slow
def test_a_script_on_worker_processes_runs_only_there_and_finds_the_modules_beside_it(tmp_path):
    # The file runs in the workers, not in `workbench run` itself (which then never imports
    # TensorFlow); its `import` of a module beside it works from any folder, in every worker.
    project = tmp_path / "project"
    project.mkdir()
    (project / "sizes.py").write_text("HIDDEN = 16\n")
    script = open(TOY_SCRIPT).read().replace("import numpy as np", "import numpy as np\nimport sizes")
    (project / "train.py").write_text(script.replace("Dense(16,", "Dense(sizes.HIDDEN,"))
    out = subprocess.run(
        [sys.executable, "-c", CLI_SAYING_IF_TF_WAS_IMPORTED, "run", "project/train.py", "--steps", "5",
         "--backend", "multi-worker", "--workers", "2"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    assert summary["status"] == "finished" and summary["steps"] == 5
    assert "tensorflow imported: False" in out.stdout
