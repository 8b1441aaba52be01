"""A real cluster of two hosts (two network namespaces joined by a veth pair, tests/two_hosts.py):
`workbench run` in every task, as the README's recipe says, and what happens when a task is
missing. Real TensorFlow servers and real processes; nothing of the machine outside the two
namespaces is touched."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
from two_hosts import WORKBENCH, TwoHosts

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")


@pytest.fixture
def hosts():
    made = TwoHosts()
    yield made
    made.close()


def _tf_config(cluster: dict, task_type: str, index: int) -> dict:
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})}


def _cluster(hosts) -> dict:
    a, b = hosts.addresses
    return {"chief": [f"{a}:23100"], "ps": [f"{a}:23101"], "worker": [f"{a}:23102", f"{b}:23103"]}


def _wait(process, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    return process.poll()


def _start_server_tasks(hosts, tmp_path) -> tuple[list[str], dict]:
    """ps 0 and worker 0 on host 0, worker 1 on host 1: `workbench run` in each server task, as
    the README's recipe says; returns (the command, {"ps 0": process, ...})."""
    cluster = _cluster(hosts)
    run = [
        *WORKBENCH,
        "run",
        TRAIN,
        "--backend",
        "async-ps",
        "--cluster",
        "TF_CONFIG",
        "--startup-timeout",
        "90",
    ]
    servers = {}
    for task_type, index, host in (("ps", 0, 0), ("worker", 0, 0), ("worker", 1, 1)):
        log = open(tmp_path / f"{task_type}{index}.log", "w")
        servers[f"{task_type} {index}"] = hosts.popen(
            host, [*run, "--steps", "1"], _tf_config(cluster, task_type, index), log
        )
    return run, servers


def test_async_ps_across_two_hosts_with_workbench_run_in_every_task(hosts, tmp_path):
    cluster = _cluster(hosts)
    run, servers = _start_server_tasks(hosts, tmp_path)
    history = tmp_path / "history.csv"
    with open(tmp_path / "chief.log", "w") as log:
        chief = hosts.popen(
            0, [*run, "--steps", "60", "--history", str(history)], _tf_config(cluster, "chief", 0), log
        )
        code = _wait(chief, 300)
    chief_log = (tmp_path / "chief.log").read_text()
    assert code == 0, chief_log[-3000:]
    rows = pd.read_csv(history)
    assert list(rows["step"]) == list(range(1, 61)) and rows["loss"].notna().all()
    ended = time.monotonic()
    for name, server in servers.items():
        assert _wait(server, 60) == 0, f"{name} did not leave after the chief"
        text = (tmp_path / f"{name.replace(' ', '')}.log").read_text()
        assert f"async-ps {name} serving" in text and "has gone (its run ended); exiting" in text, text[
            -2000:
        ]
    assert time.monotonic() - ended < 60
    assert hosts.pids() == []


def test_async_ps_chief_names_a_worker_that_never_starts(hosts, tmp_path):
    cluster = _cluster(hosts)
    run = [*WORKBENCH, "run", TRAIN, "--backend", "async-ps", "--cluster", "TF_CONFIG"]
    for task_type, index in (("ps", 0), ("worker", 0)):  # worker 1, on the other host, never starts
        log = open(tmp_path / f"{task_type}{index}.log", "w")
        hosts.popen(
            0, [*run, "--steps", "1", "--startup-timeout", "120"], _tf_config(cluster, task_type, index), log
        )
    with open(tmp_path / "chief.log", "w") as log:
        started = time.monotonic()
        chief = hosts.popen(
            0, [*run, "--steps", "10", "--startup-timeout", "10"], _tf_config(cluster, "chief", 0), log
        )
        code = _wait(chief, 120)
    text = (tmp_path / "chief.log").read_text()
    assert code == 1, text[-3000:]
    assert "worker 1" in text and "startup_timeout" in text and cluster["worker"][1] in text, text[-3000:]
    assert time.monotonic() - started < 10 + 60  # the deadline, plus TensorFlow's import


def test_a_server_task_whose_chief_never_comes_gives_up_with_the_fix(hosts, tmp_path):
    cluster = _cluster(hosts)
    with open(tmp_path / "ps0.log", "w") as log:
        ps = hosts.popen(
            1,
            [*WORKBENCH, "run", TRAIN, "--backend", "async-ps", "--cluster", "TF_CONFIG", "--steps", "1",
             "--startup-timeout", "5"],
            _tf_config(cluster, "ps", 0),
            log,
        )  # fmt: skip
        code = _wait(ps, 120)
    text = (tmp_path / "ps0.log").read_text()
    assert code == 1, text[-2000:]
    assert f"the chief at {cluster['chief'][0]} never came within startup_timeout=5 s" in text
    assert "Fix: start `workbench run FILE --backend async-ps --cluster TF_CONFIG` in the chief task" in text


# ----- faults on a real cluster: nothing hangs silently -------------------------------------
def _async_cluster_running(hosts, tmp_path, *chief_options: str):
    """ps 0 and worker 0 on host 0, worker 1 on host 1 (`workbench run` server tasks), and the
    chief on host 0 training with `chief_options`; returns (chief, servers) once steps show."""
    cluster = _cluster(hosts)
    run, servers = _start_server_tasks(hosts, tmp_path)
    log = open(tmp_path / "chief.log", "w")
    chief = hosts.popen(
        0, [*run, *chief_options], {**_tf_config(cluster, "chief", 0), "PYTHONUNBUFFERED": "1"}, log
    )
    _wait_for_text(tmp_path / "chief.log", "step ", 180, chief)
    # In its steady state: a cut in a run's first second, while TensorFlow still registers the
    # run's functions on every worker, can hold the coordinator (a function registered then waits
    # for every worker; docs/design-decisions.md)
    deadline = time.monotonic() + 60
    while _last_step(tmp_path / "chief.log") < 1000 and time.monotonic() < deadline and chief.poll() is None:
        time.sleep(0.2)
    return chief, servers


def _wait_for_text(path, text: str, timeout: float, process=None) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = path.read_text()
        if text in content:
            return content
        if process is not None and process.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path.name} within {timeout:.0f} s:\n{path.read_text()[-3000:]}")


def _last_step(path) -> int:
    steps = re.findall(r"^step (\d+)/", path.read_text(), flags=re.M)
    return int(steps[-1]) if steps else 0


def test_async_ps_cut_worker_host_is_declared_lost_rejoins_and_ctrl_c_during_a_cut_ends_the_run(
    hosts, tmp_path
):
    history = tmp_path / "history.csv"
    chief, servers = _async_cluster_running(
        hosts, tmp_path, "--steps", "10000000", "--worker-timeout", "8", "--history", str(history)
    )
    log = tmp_path / "chief.log"
    hosts.cut()
    cut = time.monotonic()
    lost = (
        f"worker 1 at {_cluster(hosts)['worker'][1]} has not answered for 8 s (worker_timeout): declared lost"
    )
    _wait_for_text(log, lost, 8 + 20, chief)
    assert time.monotonic() - cut >= 8 - 2.5  # silent since its last answer, up to a probe before the cut
    assert "the run goes on with 1 of 2 workers" in log.read_text()
    at_loss = _last_step(log)
    time.sleep(5)
    assert _last_step(log) > at_loss + 100, "the run did not go on with worker 0"

    hosts.heal()
    _wait_for_text(log, "answers again: it rejoins the run", 20, chief)
    assert servers["worker 1"].poll() is None  # the worker waited out the silent chief

    hosts.cut()  # Ctrl-C while a chunk is stuck on the cut-off worker: out in seconds
    time.sleep(2)
    chief.send_signal(signal.SIGINT)
    interrupted = time.monotonic()
    summarized = None  # when the run's summary line showed: the run had stopped, the process not yet gone
    idle, last = 0.0, None  # (after the summary: seconds the chief was idle; the last look, idle or not)
    while chief.poll() is None and time.monotonic() - interrupted < 60:
        active = _running_or_runnable(chief.pid)
        now = time.monotonic()
        if summarized is not None and last is not None and active is False and last[1] is False:
            idle += now - last[0]  # (idle at both ends of the interval: a wait, not a moment)
        last = (now, active)
        if summarized is None and '{"run": ' in log.read_text():
            summarized = now - interrupted
        time.sleep(0.1)
    code, took = chief.poll(), time.monotonic() - interrupted
    text = log.read_text()
    assert code == 0, text[-3000:]
    # The stop: the summary 0.2-3.2 s after Ctrl-C, up to one STOP_GRACE for all the chunks stuck
    # on the cut-off worker (once 12 s, a grace apiece). The exit after it: 1-2 s on a quiet
    # machine, 9.9 s at load 13 with two other TensorFlow jobs running, so it is bounded by what it
    # did, not the wall clock: a process that waits on the cut-off worker has none of its threads
    # running, waiting for a CPU or in a disk wait meanwhile.
    assert summarized is not None and summarized < 10, f"the run's summary showed {summarized} s after Ctrl-C"
    assert idle < 3, (
        f"the chief exited {took - summarized:.1f} s after its summary, {idle:.1f} s of it neither running "
        "nor waiting for a CPU (waiting on the cut-off worker)"
    )
    summary = json.loads(text.strip().splitlines()[-1])
    assert summary["status"] == "stopped" and summary["stop_reason"].startswith("interrupted at step")
    rows = pd.read_csv(history)
    assert len(rows) == summary["steps"] > at_loss and list(rows["step"]) == list(range(1, len(rows) + 1))
    assert set(rows["workers"]) == {1, 2}  # the history says when the run had one worker
    assert "Traceback" not in text and "ERROR:tensorflow" not in text


def _running_or_runnable(pid: int) -> bool | None:
    """Whether a thread of `pid` is running or waiting for a CPU (state R) or in a disk wait (D);
    None once it is gone. (Not its CPU time plus its threads' run-queue wait: a thread's wait
    leaves the sum when the thread ends, and ~100 threads end as the chief exits; a loaded run
    saw the sum fall by 2 s.)"""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("R", "D"):
                    return True
        except (OSError, IndexError):  # (a thread ended meanwhile)
            continue
    return False


def _declared_lost_and_the_run_goes_on(hosts, chief, log, times: int) -> None:
    """Worker 1 is declared lost (for the `times`-th time) after 5 s, and the run goes on with
    worker 0: 300 steps more. (The run is then ended by Ctrl-C rather than run to a fixed step
    count: how many steps fit before a loss depends on the machine's speed. That a run finishes on
    its own after a loss is test_async_ps' and test_ray's.)"""
    sentence = (
        f"worker 1 at {_cluster(hosts)['worker'][1]} has not answered for 5 s (worker_timeout): declared lost"
    )
    deadline = time.monotonic() + 5 + 60
    while log.read_text().count(sentence) < times and time.monotonic() < deadline and chief.poll() is None:
        time.sleep(0.2)
    text = log.read_text()
    assert text.count(sentence) == times, f"worker 1 was not declared lost {times} time(s):\n{text[-3000:]}"
    assert text.count("the run goes on with 1 of 2 workers") == times, text[-3000:]
    at_loss = _last_step(log)
    deadline = time.monotonic() + 60
    while _last_step(log) < at_loss + 300 and time.monotonic() < deadline and chief.poll() is None:
        time.sleep(0.2)
    assert _last_step(log) >= at_loss + 300, (
        f"the run did not go on with worker 0:\n{log.read_text()[-3000:]}"
    )


def test_async_ps_frozen_remote_worker_is_lost_rejoins_when_resumed_and_killed_is_lost_again(hosts, tmp_path):
    # A frozen process still accepts TCP (the kernel does it for it): only the peer probe sees it.
    # Resumed, it answers again and rejoins; killed, its port refuses: lost again. Either way the
    # run goes on with worker 0, and Ctrl-C ends it with every step in its history.
    history = tmp_path / "history.csv"
    chief, servers = _async_cluster_running(
        hosts, tmp_path, "--steps", "10000000", "--worker-timeout", "5", "--history", str(history)
    )
    log = tmp_path / "chief.log"
    servers["worker 1"].send_signal(signal.SIGSTOP)
    try:
        _declared_lost_and_the_run_goes_on(hosts, chief, log, times=1)
    finally:
        servers["worker 1"].send_signal(signal.SIGCONT)
    _wait_for_text(log, "answers again: it rejoins the run", 30, chief)
    servers["worker 1"].kill()  # on host 1: its port now refuses
    _declared_lost_and_the_run_goes_on(hosts, chief, log, times=2)

    chief.send_signal(signal.SIGINT)
    code = _wait(chief, 30)
    text = log.read_text()
    assert code == 0, text[-3000:]
    summary = json.loads(text.strip().splitlines()[-1])
    assert summary["status"] == "stopped" and summary["stop_reason"].startswith("interrupted at step")
    rows = pd.read_csv(history)
    assert list(rows["step"]) == list(range(1, summary["steps"] + 1))  # every step, none lost
    assert [count for count, _ in itertools.groupby(rows["workers"])] == [2, 1, 2, 1]  # lost, back, lost


def test_multi_worker_link_cut_ends_both_hosts_with_a_sentence_and_the_chiefs_history(hosts, tmp_path):
    a, b = hosts.addresses
    cluster = {"worker": [f"{a}:23110", f"{b}:23111"]}
    run = [
        *WORKBENCH,
        "run",
        TRAIN,
        "--backend",
        "multi-worker",
        "--cluster",
        "TF_CONFIG",
        "--steps",
        "10000000",
    ]
    workers = []
    for index in (0, 1):
        log = open(tmp_path / f"worker{index}.log", "w")
        csv = ["--history", str(tmp_path / f"history{index}.csv")]
        env = {**_tf_config(cluster, "worker", index), "PYTHONUNBUFFERED": "1"}
        workers.append(hosts.popen(index, [*run, *csv], env, log))
    _wait_for_text(tmp_path / "worker0.log", "step ", 240, workers[0])
    time.sleep(2)
    hosts.cut()
    cut = time.monotonic()
    codes = [_wait(worker, 30 - (time.monotonic() - cut)) for worker in workers]
    logs = [(tmp_path / f"worker{index}.log").read_text() for index in (0, 1)]
    assert codes == [1, 1], f"exit codes {codes} within 30 s of the cut:\n" + "\n".join(
        x[-2000:] for x in logs
    )
    a_said, b_said = (text.split("--- details ---")[0] for text in logs)  # ours, before TensorFlow's
    assert re.search(
        rf"^workbench run: the run failed after step \d+: worker 1 at {b}:23111 stopped answering",
        a_said,
        re.M,
    ), logs[0][-3000:]
    assert re.search(
        rf"^workbench run: the run failed after step \d+: this task \(worker 1\) lost the coordination "
        rf"service on worker 0 at {a}:23110",
        b_said,
        re.M,
    ), logs[1][-3000:]
    for said in (a_said, b_said):
        assert "No checkpoint was kept: give --checkpoint DIR" in said
        assert not [line for line in said.splitlines() if not line.startswith(("step ", "workbench run:", "[workbench] "))], (
            said
        )
    rows = pd.read_csv(tmp_path / "history0.csv")  # the chief's rows, up to the failure
    assert len(rows) > 0 and list(rows["step"]) == list(range(1, len(rows) + 1))


def test_a_port_held_by_something_that_is_not_a_peer_fails_the_join_within_the_timeout(hosts, tmp_path):
    a, b = hosts.addresses
    cluster = {"worker": [f"{a}:23120", f"{b}:23121"]}
    impostor = hosts.popen(  # a stale process on worker 1's port: accepts TCP, says nothing
        1,
        [
            sys.executable,
            "-c",
            f"import socket,time; s=socket.socket(); s.bind(('{b}', 23121)); s.listen(); time.sleep(600)",
        ],
        {},
        subprocess.DEVNULL,
    )
    with open(tmp_path / "worker0.log", "w") as log:
        started = time.monotonic()
        worker = hosts.popen(
            0,
            [*WORKBENCH, "run", TRAIN, "--backend", "multi-worker", "--cluster", "TF_CONFIG", "--steps", "10",
             "--startup-timeout", "10"],
            _tf_config(cluster, "worker", 0),
            log,
        )  # fmt: skip
        code = _wait(worker, 120)
    text = (tmp_path / "worker0.log").read_text()
    assert code == 1, text[-3000:]
    assert f"worker 1 at {b}:23121 (another program, or a stale or frozen process, holds that port)" in text
    assert "did not answer as a TensorFlow peer" in text and "Fix: end what holds the port" in text
    assert time.monotonic() - started < 10 + 60  # the deadline, plus TensorFlow's import
    assert impostor.poll() is None  # (ended with the hosts)
