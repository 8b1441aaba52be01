"""async-ps tests, run in a pytest process of their own by
test_process_backends.py::test_async_ps_cases_in_a_process_of_their_own (see why there).

Real parameter servers and workers on 127.0.0.1, no mocks; no process may be left behind.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import tensorflow as tf
from test_process_backends import (  # noqa: F401 - no_orphans is an autouse fixture
    PROCESS_CELL,
    cluster_processes,
    no_orphans,
    notebook,
    regression_input_fn,
    regression_model_and_step,
    train_regression,
    wait_for_steps,
)

import workbench as wb


def test_async_ps_one_worker_matches_one_device_and_refuses_primitives():
    repl = wb.MultiWorkerAsyncReplicator(num_workers=1, num_ps=1)
    try:
        weights, losses = train_regression(repl, "SGD", 3)
        ref_weights, ref_losses = train_regression(wb.NonReplicator(), "SGD", 3)
        for got, want in zip(weights, ref_weights):
            np.testing.assert_allclose(got, want, atol=1e-5)
        np.testing.assert_allclose(losses, ref_losses, atol=1e-5)
        with pytest.raises(wb.ConfigurationError, match="single, mirrored, multi-worker, tpu"):
            repl.all_sum(1.0)
    finally:
        repl.shutdown()


def async_model(repl, lr=0.05):
    with repl.context():
        return regression_model_and_step(repl, lr)


def test_async_ps_survives_a_killed_worker_with_an_exact_step_count():
    repl = wb.MultiWorkerAsyncReplicator(num_workers=2, num_ps=1)
    try:
        model, step_fn = async_model(repl)
        run = repl.train(step_fn, regression_input_fn, steps=1500, steps_per_execution=5, background=True)
        wait_for_steps(run, 100)
        victim = next(c for c in repl.group.children if c.role == "worker" and c.index == 1)
        os.kill(victim.pid, signal.SIGKILL)
        run.wait(timeout=240)
        assert run.status == "finished", run.stop_reason
        history = run.history
        assert run.steps == 1500 and list(history["step"]) == list(range(1, 1501))
        assert run.executed_steps >= 1500  # at-least-once: lost chunks run again
        lost = [e for e in run.events if e.kind == "message" and e.data.get("worker_lost") == 1]
        assert lost and "killed by SIGKILL" in lost[0].data["text"]
        assert history["workers"].iloc[0] == 2 and history["workers"].iloc[-1] == 1
        assert np.isfinite(history["loss"]).all()
    finally:
        repl.shutdown()


def test_async_ps_killed_parameter_server_fails_fast_and_checkpoint_restores(tmp_path):
    repl = wb.MultiWorkerAsyncReplicator(num_workers=2, num_ps=1)
    try:
        model, step_fn = async_model(repl)
        run = repl.train(
            step_fn, regression_input_fn, steps=1_000_000, steps_per_execution=5,
            checkpoint_dir=tmp_path, checkpoint_every=50, background=True,
        )  # fmt: skip
        wait_for_steps(run, 160)
        ps = next(c for c in repl.group.children if c.role == "ps")
        os.kill(ps.pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(wb.WorkerError, match=r"parameter server 0 .* killed by SIGKILL.*last checkpoint"):
            run.wait(timeout=60)
        assert time.monotonic() - killed < 10
    finally:
        repl.shutdown()
    saved_step = int(tf.train.latest_checkpoint(str(tmp_path)).rsplit("-", 1)[1])
    assert saved_step >= 50 and saved_step % 50 == 0
    fresh = wb.NonReplicator()
    _, fresh_step = async_model(fresh)
    resumed = fresh.train(fresh_step, regression_input_fn, steps=5, checkpoint_dir=tmp_path)
    texts = [e.data.get("text", "") for e in resumed.events if e.kind == "message"]
    assert any(f"resumed from checkpoint at step {saved_step}" in t for t in texts)
    assert int(resumed.history["step"].iloc[0]) == saved_step + 1


def test_garbage_collected_async_replicator_leaves_no_servers():
    import gc

    repl = wb.MultiWorkerAsyncReplicator(num_workers=1, num_ps=1)
    repl.strategy  # noqa: B018 - starts the servers
    pids = repl.group.pids()
    assert all(os.path.exists(f"/proc/{p}") for p in pids)
    del repl
    gc.collect()
    deadline = time.monotonic() + 10
    while cluster_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not cluster_processes()


def test_replicate_cell_on_async_ps_trains_from_the_kernel(notebook):  # noqa: F811 - the fixture
    notebook.run_line_magic("replicate", "--backend async-ps --workers 2 --ps 1")
    repl = wb.current()
    try:
        run = notebook.run_cell_magic("replicate", "--steps 200 --no-live", PROCESS_CELL)
        assert run.status == "finished" and run.steps == 200 and run.executed_steps >= 200
        assert run.config["synchronous"] is False and set(run.history["workers"]) == {2}
        assert run.history["loss"].iloc[-10:].mean() < 0.1 * run.history["loss"].iloc[:10].mean()
    finally:
        repl.shutdown()
