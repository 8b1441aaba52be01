"""async-ps end to end, and what every local cluster must show: real parameter servers, workers and
coordinator processes on this machine, no mocks.

The coordinator runs in a process the launcher starts, never in this (the test's, the kernel's)
process, so these tests run in the ordinary pytest process. Each check looks only at the
processes the run started (run.processes), never at the whole machine.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time

import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    PROCESS_CELL,
    RUN_WAIT,
    connect_error,
    host_addresses,
    nan_after_fifty_setup,
    process_pid,
    regression_input_fn,
    regression_model_and_step,
    regression_setup,
    wait_for_steps,
)

import workbench as wb

pytestmark = pytest.mark.usefixtures("no_orphans")

# The order matters to the tests marked shares_warm_pool (tests/conftest.py): they hand their warm
# pool to the next one, as a notebook's next cell would find it. One worker and one parameter
# server: the one-device match, then the kill while checkpointing (which retires it). Two
# workers: the loopback check, the %%replicate cell, then the killed worker (replaced: the pool
# stays whole and warm, and the file's end shuts it down).


@pytest.mark.slow
@pytest.mark.shares_warm_pool
def test_async_ps_one_worker_matches_one_device_and_refuses_primitives():
    repl = wb.MultiWorkerAsyncReplicator(num_workers=1, num_ps=1)
    run = repl.train_cell(
        "model, step_fn = regression_model_and_step(repl, lr=0.1)\ninput_fn = regression_input_fn",
        {"regression_model_and_step": regression_model_and_step, "regression_input_fn": regression_input_fn},
        steps=3,
        steps_per_execution=1,
    )
    reference = wb.NonReplicator()
    with reference.context():
        ref_model, ref_step = regression_model_and_step(reference, lr=0.1)
    ref_run = reference.train(ref_step, regression_input_fn, steps=3, steps_per_execution=1)
    np.testing.assert_allclose(run.history["loss"], ref_run.history["loss"], atol=1e-5)
    assert run.executed_steps == 3 and run.config["synchronous"] is False
    with pytest.raises(wb.ConfigurationError, match="single, mirrored, multi-worker, tpu"):
        repl.all_sum(1.0)
    del ref_model


@pytest.mark.slow
@pytest.mark.shares_warm_pool
def test_async_ps_parameter_server_killed_while_checkpointing_is_a_worker_error(tmp_path):
    # A checkpoint at every step: most of the run's time is spent saving, so the kill lands in a
    # save (or between two); either way the run ends with the same WorkerError and its history.
    run = wb.MultiWorkerAsyncReplicator(num_workers=1, num_ps=1).train(
        setup=regression_setup, steps=10**6, steps_per_execution=1,
        checkpoint_dir=tmp_path, checkpoint_every=1, background=True,
    )  # fmt: skip
    wait_for_steps(run, 20)
    os.kill(process_pid(run, "ps", 0), signal.SIGKILL)
    with pytest.raises(wb.WorkerError, match=r"parameter server 0 .* killed by SIGKILL") as info:
        run.wait(timeout=60)
    assert info.value.run is run and len(run.history) == run.steps >= 20


@pytest.mark.slow
def test_async_ps_killed_parameter_server_fails_fast_and_checkpoint_restores(tmp_path):
    repl = wb.MultiWorkerAsyncReplicator(num_workers=2, num_ps=1)
    run = repl.train(
        setup=regression_setup, steps=1_000_000, steps_per_execution=5,
        checkpoint_dir=tmp_path, checkpoint_every=50, background=True,
    )  # fmt: skip
    wait_for_steps(run, 160)
    os.kill(process_pid(run, "ps", 0), signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(
        wb.WorkerError, match=r"parameter server 0 .* killed by SIGKILL.*last checkpoint"
    ) as info:
        run.wait(timeout=60)
    assert time.monotonic() - killed < 10
    assert info.value.task == "ps 0" and info.value.run is run and len(run.history) == run.steps
    saved_step = int(tf.train.latest_checkpoint(str(tmp_path)).rsplit("-", 1)[1])
    assert saved_step >= 50 and saved_step % 50 == 0
    fresh = wb.NonReplicator()
    with fresh.context():
        _, fresh_step = regression_model_and_step(fresh)
    resumed = fresh.train(fresh_step, regression_input_fn, steps=5, checkpoint_dir=tmp_path)
    texts = [e.data.get("text", "") for e in resumed.events if e.kind == "message"]
    assert any(f"resumed from checkpoint at step {saved_step}" in t for t in texts)
    assert int(resumed.history["global_step"].iloc[0]) == saved_step + 1  # (step counts from 1)


# ----- no open doors: every process a local run starts is reachable from this machine only -------------
@pytest.mark.slow
@pytest.mark.shares_warm_pool
@pytest.mark.parametrize("backend", ["multi-worker", "async-ps"])
def test_local_cluster_listens_on_loopback_only_and_refuses_the_host_address(backend):
    from workbench._src.placements.local import netns

    repl = wb.replicator(backend, num_workers=2)
    run = repl.train(setup=regression_setup, steps=10**7, background=True)
    try:
        wait_for_steps(run, 20)
        expected = {"multi-worker": 2, "async-ps": 4}[backend]  # async-ps: coordinator, 2 workers, 1 ps
        wait = time.monotonic() + 30
        while len(run.processes) < expected and time.monotonic() < wait:
            time.sleep(0.1)
        pids = [p["pid"] for p in run.processes]
        assert len(pids) == expected, run.processes
        ours = os.readlink("/proc/self/ns/net")
        listening = set()
        for pid in pids:
            assert os.readlink(f"/proc/{pid}/ns/net") != ours  # a private network namespace
            assert netns.interfaces(pid) == ["lo"]
            assert netns.exposed_sockets(pid) == []  # nothing reachable from another address
            listening |= {port for _, port in netns.listening_sockets(pid)}
        assert len(listening) >= 2, listening  # the gRPC servers are there, inside
        for port in listening:
            for host in [*host_addresses(), "127.0.0.1"]:
                assert connect_error(host, port) == errno.ECONNREFUSED, f"{host}:{port} accepted"
    finally:
        run.stop()
        run.wait(timeout=120)
    assert run.status == "stopped"


@pytest.mark.slow
@pytest.mark.shares_warm_pool
def test_replicate_cell_on_async_ps_trains_in_its_processes(notebook):  # noqa: F811 - the fixture
    run = notebook.run_cell_magic(
        "replicate", "--backend async-ps --workers 2 --ps 1 --steps 200 --no-live", PROCESS_CELL
    )
    assert run.status == "finished" and run.steps == 200 and run.executed_steps >= 200
    assert run.config["synchronous"] is False and set(run.history["workers"]) == {2}
    assert run.history["loss"].iloc[-10:].mean() < 0.1 * run.history["loss"].iloc[:10].mean()
    # The trained weights came back into the cell's model in the notebook...
    x = notebook.user_ns["features"][:64]
    y = notebook.user_ns["targets"][:64]
    loss_here = float(np.mean((notebook.user_ns["model"](x).numpy() - y) ** 2))
    assert loss_here < 0.5 * run.history["loss"].iloc[0]
    # ...and this process never joined a cluster: its TensorFlow job is still 'localhost', and
    # a later mirrored run works here.
    assert "/job:localhost/" in tf.constant(1.0).device
    mirrored = wb.replicator("mirrored", num_replicas=2)
    with mirrored.context():
        _, step_fn = regression_model_and_step(mirrored)
    assert mirrored.train(step_fn, regression_input_fn, steps=5).status == "finished"


@pytest.mark.slow
@pytest.mark.shares_warm_pool
def test_async_ps_survives_a_killed_worker_with_an_exact_step_count():
    repl = wb.MultiWorkerAsyncReplicator(num_workers=2, num_ps=1)
    run = repl.train(setup=regression_setup, steps=1500, steps_per_execution=5, background=True)
    wait_for_steps(run, 100)
    os.kill(process_pid(run, "worker", 1), signal.SIGKILL)
    run.wait(timeout=RUN_WAIT)
    assert run.status == "finished", run.stop_reason
    history = run.history
    assert run.steps == 1500 and list(history["step"]) == list(range(1, 1501))
    assert run.executed_steps >= 1500  # at-least-once: lost chunks run again
    lost = [e for e in run.events if e.kind == "message" and "worker 1" in e.data.get("text", "")]
    assert lost and "killed by SIGKILL" in lost[0].data["text"]
    # Dropped to 1, and up again when its replacement answered (tests/test_async_ps_heal.py); a
    # replacement that answers before the next row is recorded (a fork, ~0.1 s) leaves no row at 1.
    workers = set(history["workers"])
    replaced = [r for r in run.restarts if r["member"] == "worker 1" and r.get("replaced")]
    assert history["workers"].iloc[0] == 2 and (1 in workers or (workers == {2} and replaced)), (
        workers,
        run.restarts,
    )
    assert np.isfinite(history["loss"]).all()


@pytest.mark.slow
def test_the_start_counts_every_process_the_pool_runs():
    # One process is started by the launcher (the coordinator), which starts the other three:
    # the run says 4, as `workbench run` does, not 1.
    run = wb.MultiWorkerAsyncReplicator(num_workers=2, num_ps=1, pool=False).train(
        setup=regression_setup, steps=5
    )
    texts = [e.data.get("text", "") for e in run.events if e.kind == "message"]
    assert any(t.startswith("starting 4 async-ps processes") for t in texts), texts
    assert len(run.processes) == 4


def test_unusable_checkpoint_dir_is_refused_before_any_process_starts(tmp_path):
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    started = time.monotonic()
    for repl in (wb.MultiWorkerReplicator(num_workers=2), wb.MultiWorkerAsyncReplicator(num_workers=1)):
        with pytest.raises(wb.ConfigurationError, match="checkpoint_dir") as info:
            repl.train(setup=regression_setup, steps=5, checkpoint_dir=a_file)
        assert str(a_file) in str(info.value)
    assert time.monotonic() - started < 5  # refused here, not after starting workers


@pytest.mark.slow
def test_async_ps_history_ends_at_the_reported_non_finite_step():
    run = wb.MultiWorkerAsyncReplicator(num_workers=2, num_ps=1).train(
        setup=nan_after_fifty_setup, steps=2000, steps_per_execution=10
    )
    history = run.history
    assert run.status == "non-finite" and "Training stopped at step" in run.stop_reason
    reported = int(run.stop_reason.split("Training stopped at step ")[1].split(":")[0])
    assert list(history["step"]) == list(range(1, reported + 1))  # nothing after it
    assert np.isfinite(history["loss"].iloc[:-1]).all() and not np.isfinite(history["loss"].iloc[-1])


def test_a_chunk_lost_with_a_worker_is_told_from_a_lost_parameter_server():
    """The coordinator re-runs a chunk whose fetch failed with a worker (on servers it does not
    watch: a Ray pool, a real cluster), and not one that failed with a parameter server. These are
    the errors TensorFlow raised: the first seen on Ray when a worker actor was killed mid-run."""
    from workbench._src.backends.async_coordinator import _stale_handle_on, _worker_lost_with

    def fetch_error(status: str, what: str) -> str:  # (TensorFlow's words for a failed fetch)
        return (
            f"2 root error(s) found.\n  (0) {status}: {{{{function_node __wrapped__Identity_device_/job:chief/"
            f"replica:0/task:0/device:CPU:0}}}} {what}\nAdditional GRPC error information from remote target "
            "/job:worker/replica:0/task:1/device:CPU:0 while calling /tensorflow.eager.EagerService/RunComponentFunction:"
        )

    with_worker = fetch_error(
        "UNAVAILABLE",
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:192.0.2.2:58431: Failed to connect "
        "to remote host: Connection refused",
    )
    # A result fetched from the new process serving a replaced worker's address (seen in a suite):
    # that worker answers, the chunk runs again.
    stale = fetch_error(
        "INVALID_ARGUMENT",
        "Unable to find the relevant tensor remote_handle: Op ID: 119, Output num: 0. One possible cause is "
        "that the tensor was accessed after deallocation in a distributed worker setup.",
    )
    for told, text in ((_worker_lost_with, with_worker), (_stale_handle_on, stale)):
        assert told(text) == "worker 1"
        assert not told(text.replace("/job:worker/", "/job:ps/"))  # a parameter server's: an error
    assert not _worker_lost_with(with_worker + " and /job:ps/replica:0/task:0/device:CPU:0")
    assert not _worker_lost_with("UNAVAILABLE: Socket closed")  # no task named: not ours to guess
    assert not _stale_handle_on(with_worker)  # (unavailable: the lost-worker path's, not this one's)


def test_the_coordinators_executor_scope_sets_and_restores_the_threads_executor_as_tensorflows_does():
    """async-ps replaces TensorFlow's `executor_scope` (compat.py: leaving it no
    longer waits for the default executor, which held every worker's closures while one worker was
    cut off). What TensorFlow's scope does must still happen: ops inside run on the given executor,
    the thread's own executor is back after it, and a second install changes nothing."""
    import subprocess
    import sys

    code = """
import tensorflow as tf
from tensorflow.python.eager import context, executor
from workbench._src import compat
original = context.executor_scope
compat.replace_executor_scope_with_one_that_does_not_wait()
replacement = context.executor_scope
compat.replace_executor_scope_with_one_that_does_not_wait()
assert context.executor_scope is replacement is not original
private = executor.new_executor(enable_async=True)
assert not context.context().executor.is_async()
with context.executor_scope(private):
    assert context.context().executor.is_async()
    x = tf.constant(20.0) + 1.0
    with context.executor_scope(executor.new_executor(enable_async=False)):
        assert not context.context().executor.is_async()
    assert context.context().executor.is_async()
private.wait()
assert not context.context().executor.is_async()
print("value", float(x) * 2)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["value", "42.0"]


@pytest.mark.slow
def test_a_frozen_coordinator_is_named_though_its_servers_keep_waking():
    """A stopped (SIGSTOP) coordinator is named frozen after its heartbeat timeout: its servers'
    threads go on waking (and, on a loaded machine, waiting for a CPU), but only the start of
    the member counts their CPU as its own (launch/start_progress.py), never its silence."""
    repl = wb.MultiWorkerAsyncReplicator(num_workers=2, num_ps=1, heartbeat_timeout=5)
    run = repl.train(setup=regression_setup, steps=1_000_000, steps_per_execution=5, background=True)
    wait_for_steps(run, 50)
    victim = process_pid(run, "coordinator", 0)
    os.kill(victim, signal.SIGSTOP)
    try:
        with pytest.raises(
            wb.WorkerError, match=r"coordinator 0 \(.*stopped responding.*neither ran nor waited"
        ):
            run.wait(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)  # (only if the test failed before the pool was stopped)
        repl.shutdown()
