"""Nothing is left behind: a run, a launched process or a failed run leaves its TMPDIR as it found
it (for a finished multi-worker and async-ps `workbench run`, tests/test_readme.py checks it: it
runs the README's commands with a private TMPDIR). TensorFlow's AutoGraph writes a
`__autograph_generated_file*.py` per converted function into the temp folder and removes them
only at a normal interpreter exit, which launched processes never have; each launched process
therefore gets a temp folder of its own (processes.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from workbench._src.placements.local.processes import ProcessGroup
from workbench._src.placements.proc import pids_naming

# A launched process that writes into its temp folder (as AutoGraph does), says where, and waits.
CHILD = """
import sys, tempfile, time
with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    f.write("# as AutoGraph leaves them")
print(tempfile.gettempdir(), f.name, flush=True)
time.sleep(600)
"""


def leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_killed_process_leaves_no_temp_files(tmp_path, monkeypatch):
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))  # where the group makes its folders
    (tmp_path / "child_module.py").write_text(CHILD)
    group = ProcessGroup("test", private_network=False)
    child = group.start("worker", 0, "child_module", {"PYTHONPATH": str(tmp_path)})
    deadline = time.monotonic() + 60
    while not child.log_path.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    child_tmp, written = child.log_path.read_text().split()
    # Its own folder, inside ours, holding what it wrote.
    assert Path(child_tmp) == child.tmp_dir and private in child.tmp_dir.parents
    assert Path(written).parent == child.tmp_dir and Path(written).exists()
    os.kill(child.pid, signal.SIGKILL)  # no chance to clean up: the group does it
    child.popen.wait(10)
    group.stop()
    assert leftovers(private) == []


FAILING = """
import keras
import tensorflow as tf

model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
optimizer = repl.wrap_optimizer(keras.optimizers.SGD(0.1))

def input_fn(ctx):
    return tf.data.Dataset.from_tensors(tf.ones((8, 4))).repeat()

def step_fn(x):
    tf.debugging.assert_less(tf.reduce_sum(x), 0.0, message="a deliberate failure")
    return {"loss": tf.reduce_mean(model(x))}
"""


@pytest.mark.slow
def test_a_failed_workbench_run_leaves_its_tmpdir_empty(tmp_path):
    private = tmp_path / "tmp"
    private.mkdir()
    (tmp_path / "failing.py").write_text(FAILING)
    env = {**os.environ, "TMPDIR": str(private), "WORKBENCH_RUNS_DIR": str(tmp_path / "runs")}
    command = "run failing.py --backend multi-worker --workers 2 --steps 20".split()
    done = subprocess.run(
        [sys.executable, "-m", "workbench.cli", *command],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1 and "a deliberate failure" in done.stderr, done.stderr[-3000:]
    assert leftovers(private) == [], f"left in TMPDIR: {leftovers(private)[:10]}"


def test_a_workbench_run_that_fails_at_once_leaves_no_fork_server_behind(tmp_path):
    # `workbench run` starts its fork server first; a file that does not compile ends the command
    # a moment later. The fork server's start was on a thread of its own, and 3 exits in 5 left its
    # folder half made; later a file of Python's first look for the temp folder was seen there
    # (the fork server, still importing, had just made it). (A short private TMPDIR: under a long
    # one, as tmp_path is, the fork server's socket folder goes to /tmp, where a Unix socket's path
    # fits, and is not seen here.)
    (tmp_path / "broken.py").write_text("def input_fn(ctx)\n    pass\n")
    for attempt in range(5):
        private = Path(tempfile.mkdtemp(prefix="wb-", dir="/tmp"))
        try:
            done = subprocess.run(
                ["workbench", "run", "broken.py", "--backend", "multi-worker", "--workers", "2", "--steps", "5"],
                cwd=tmp_path, env={**os.environ, "TMPDIR": str(private)}, capture_output=True, text=True,
                timeout=120,
            )  # fmt: skip
            assert done.returncode == 1 and "SyntaxError: expected ':'" in done.stderr, done.stderr[-3000:]
            assert leftovers(private) == [], f"left in TMPDIR after exit {attempt + 1}: {leftovers(private)}"
            # Nor its fork server, which was still importing: it would never serve, its folder
            # gone, and seconds of CPU went to its import after the command had ended.
            assert pids_naming(str(private)) == [], f"running after exit {attempt + 1}"
        finally:
            shutil.rmtree(private, ignore_errors=True)


# A launcher that made its private folders (a channel's socket folder, a process group's logs, a
# healing run's checkpoint folder: max_restarts without checkpoint_dir) and is then killed: no
# exit hook runs, and the children that would have removed them are gone.
KILLED_LAUNCHER = """
import time
from workbench._src.launch.heal import Healing
from workbench._src.placements.local.processes import ProcessGroup
from workbench._src.placements.proc import socket_folder

group = ProcessGroup("killed", private_network=False)
healing = Healing(None, type("Options", (), {"max_restarts": 1})(), {})
print(socket_folder("workbench-channel-"), group.log_dir, healing.scratch, flush=True)
time.sleep(600)
"""


def test_a_killed_launchers_folders_go_at_the_next_start(monkeypatch):
    private = Path(tempfile.mkdtemp(prefix="wb-", dir="/tmp"))  # (short: socket folders stay in it)
    try:
        env = {**os.environ, "TMPDIR": str(private)}
        launcher = subprocess.Popen(
            [sys.executable, "-c", KILLED_LAUNCHER], env=env, stdout=subprocess.PIPE, text=True
        )
        folders = launcher.stdout.readline().split()
        assert len(folders) == 3 and all(Path(f).parent == private for f in folders), folders
        assert all(os.path.basename(f).split("-")[2] == str(launcher.pid) for f in folders), folders
        launcher.kill()
        launcher.wait(10)
        launcher.stdout.close()
        assert sorted(os.listdir(private)) == sorted(os.path.basename(f) for f in folders)  # left
        # The next launcher of this user removes them as it makes its own, and only them.
        monkeypatch.setattr(tempfile, "tempdir", str(private))
        group = ProcessGroup("next", private_network=False)
        assert os.listdir(private) == [group.log_dir.name]
        group.stop()
        assert os.listdir(private) == []
    finally:
        shutil.rmtree(private, ignore_errors=True)


def test_a_stop_never_signals_a_process_that_took_an_ended_childs_pid(tmp_path, monkeypatch):
    # Pids wrap at 32,768 here and threads take them too: a child's pid, remembered while its end
    # is not yet seen, may name another process by the time a stop signals it (a SIGKILL by pid
    # once ended a pytest worker). Signals go through a handle on the child itself (pidfd).
    monkeypatch.setenv("WORKBENCH_FORK_SERVER", "off")  # (a child of ours: its pid is ours to set)
    (tmp_path / "quick.py").write_text("pass")
    group = ProcessGroup("reuse", private_network=False)
    child = group.start("worker", 0, "quick", {"PYTHONPATH": str(tmp_path)})
    child.popen.wait(60)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        child.popen.pid, child.popen.returncode = other.pid, None  # its pid, now another's
        group.stop(grace=0.5)
        assert other.poll() is None, "the stop signalled the process that took the child's pid"
    finally:
        other.kill()
        other.wait()
