"""A real cluster of two hosts (two network namespaces joined by a veth pair, tests/two_hosts.py):
`workbench run` in every task, as the README's recipe says, and what happens when a task is
missing. Real TensorFlow servers and real processes; nothing of the machine outside the two
namespaces is touched."""

from __future__ import annotations

import json
import os
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


def test_async_ps_across_two_hosts_with_workbench_run_in_every_task(hosts, tmp_path):
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
            0, [*run, "--steps", "10", "--startup-timeout", "20"], _tf_config(cluster, "chief", 0), log
        )
        code = _wait(chief, 120)
    text = (tmp_path / "chief.log").read_text()
    assert code == 1, text[-3000:]
    assert "worker 1" in text and "startup_timeout" in text and cluster["worker"][1] in text, text[-3000:]
    assert time.monotonic() - started < 20 + 60  # the deadline, plus TensorFlow's import


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
