"""The JupyterLab sidebar's worker pools: the kernel side (workbench/_src/notebook/labcomm.py).

A real kernel with the workbench loaded, spoken to over jupyter_client as the sidebar speaks to it
(the comm is the only stand-in: it is JupyterLab's end of the transport, as in
tests/test_lab_extension.py). A real warm pool: `wb.MultiWorkerReplicator(num_workers=1)` trains
a few steps in the kernel; its snapshots list the pool (busy, then idle with its process), and
{"type": "shutdown_pools"} ends the pool's processes. A pool that ends by itself (its idle
timeout) is pushed from the thread that ended it.
"""

from __future__ import annotations

import ast
import time
from pathlib import Path

import psutil
import pytest
from helpers import MESSAGE_WAIT, RUN_WAIT, LabFrontend, shell_reply

TESTS = Path(__file__).resolve().parent

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_orphans")]

SETUP = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})  # helpers' functions travel to the workers by value
import workbench as wb
from helpers import regression_setup
"""
TRAIN = "run = wb.MultiWorkerReplicator(num_workers=1{}).train(setup=regression_setup, steps=10)"
RUN = {"pids": "[p['pid'] for p in run.processes]", "status": "run.status"}


def _execute(kc, code: str, expressions: dict | None = None, timeout: float = MESSAGE_WAIT) -> dict:
    """Runs `code` in the kernel and returns `expressions` (literals) evaluated there afterwards.
    `timeout` only keeps a broken test from hanging (a loaded kernel's %load_ext took over 60 s)."""
    msg_id = kc.execute(code, user_expressions=expressions or {})
    content = shell_reply(kc, msg_id, timeout, f"{code[:60]!r}...")["content"]
    assert content["status"] == "ok", f"{content.get('ename')}: {content.get('evalue')}"
    found = {}
    for name, value in content["user_expressions"].items():
        assert value["status"] == "ok", value
        found[name] = ast.literal_eval(value["data"]["text/plain"])
    return found


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_sidebar_lists_the_warm_pool_and_shuts_it_down(tmp_path, monkeypatch, child_tmpdir):
    from jupyter_client.manager import start_new_kernel

    monkeypatch.setenv("WORKBENCH_RUNS_DIR", str(tmp_path / "runs"))
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        _execute(kc, "%load_ext workbench")
        sidebar = LabFrontend(kc)
        sidebar.open()
        (hello,) = sidebar.snapshots(lambda s: True)
        assert hello["pools"] == []

        # A run on a process backend: its pool is pushed busy while it trains, idle once it ends.
        _execute(kc, SETUP)
        started = time.time()
        found = _execute(kc, TRAIN.format(""), RUN, timeout=RUN_WAIT)
        assert found["status"] == "finished"
        pids = found["pids"]
        assert len(pids) == 1 and all(_alive(p) for p in pids)
        seen = sidebar.snapshots(lambda s: [p["state"] for p in s["pools"]] == ["idle"])
        assert any(p["state"] == "busy" for s in seen for p in s["pools"]), seen
        (idle,) = seen[-1]["pools"]
        shown = (idle["backend"], idle["workers"], idle["processes"], idle["runs"])
        assert shown == ("multi-worker", 1, 1, 1), idle
        assert started <= idle["idle_since"] <= time.time() and 0 <= idle["idle_seconds"] < 60
        assert idle["idle_timeout"] == 600 and "placement" not in idle  # (local processes, no Ray)

        # The sidebar's Shut down: the processes end, every snapshot from then on has no pool.
        sidebar.send({"type": "shutdown_pools"})
        sidebar.snapshots(lambda s: s["pools"] == [])
        assert not any(_alive(p) for p in pids), [psutil.Process(p).cmdline() for p in pids if _alive(p)]
        sidebar.send({"type": "refresh"})
        (after,) = sidebar.snapshots(lambda s: True)
        assert after["pools"] == []

        # A pool that ends on its own (its idle timer, another thread; nothing asked) is pushed too.
        found = _execute(kc, TRAIN.format(", idle_timeout=3"), RUN, timeout=RUN_WAIT)
        assert found["status"] == "finished" and not set(found["pids"]) & set(pids)
        seen = sidebar.snapshots(lambda s: [p["state"] for p in s["pools"]] == ["idle"])
        assert seen[-1]["pools"][0]["idle_timeout"] == 3 and seen[-1]["pools"][0]["runs"] == 1
        sidebar.snapshots(lambda s: s["pools"] == [])
        assert not any(_alive(p) for p in found["pids"])
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
