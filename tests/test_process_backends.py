"""Process backends with real TensorFlow servers on 127.0.0.1: multi-worker (sync) and async-ps.

No mocks: every test starts real worker / parameter-server processes, and checks afterwards
that none is left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import cloudpickle
import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    GLOBAL_BATCH,
    PROCESS_CELL,
    X,
    Y,
    asleep_worker_1_setup,
    busy_worker_1_setup,
    make_model,
    process_pid,
    regression_input_fn,
    regression_setup,
    wait_for_steps,
)
from IPython.core.error import UsageError

import workbench as wb

pytestmark = pytest.mark.usefixtures("no_orphans")

# Functions defined here travel to the workers by value (the workers cannot import tests/).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def train_regression(repl, optimizer_name: str, steps: int):
    """Builds the model under repl, trains `steps` steps; returns (weights, loss history)."""
    import keras

    with repl.context():
        model = make_model()
        opt = repl.wrap_optimizer(
            keras.optimizers.get({"class_name": optimizer_name, "config": {"learning_rate": 0.1}})
        )

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        opt.minimize(loss, model.trainable_variables, tape=tape)
        return {"loss": loss}

    run = repl.train(step_fn, regression_input_fn, steps=steps, steps_per_execution=1)
    return [v.numpy() for v in model.weights], list(run.history["loss"])


def conformance_on_worker(repl):
    """Runs inside each worker: primitive values, and SGD/Adam training from fixed weights."""

    def probe_input(ctx):
        return tf.data.Dataset.from_tensors(tf.zeros([2])).repeat()

    def probe_step(x):
        rid = tf.cast(repl.replica_id, tf.float32)
        return {
            "sum": repl.all_sum(rid + 1.0),
            "mean": repl.all_reduce(rid, "mean"),
            "max": repl.all_reduce(rid, "max"),
            "gather": repl.all_gather(tf.reshape(rid, [1])),
            "broadcast": repl.broadcast(rid + 5.0, source=1),
        }

    probe = [tf.nest.map_structure(lambda v: v.numpy(), out) for out in repl.run(probe_step, probe_input)]
    # The worker imported TensorFlow without Keras's optional extras (tf_setup.keras_extras_skipped),
    # and they still import when a user's function wants them.
    from workbench._src.core.tf_setup import KERAS_EXTRAS

    extras_at_start = sorted(name for name in KERAS_EXTRAS if name in sys.modules)
    import matplotlib
    import sklearn.datasets

    extras_importable = bool(sklearn.datasets.load_digits and matplotlib.__version__)
    sgd = train_regression(repl, "SGD", 1)
    adam = train_regression(repl, "Adam", 20)
    # A custom input_split_fn (every n-th example) cuts the same global batch over the whole run.
    repl.input_split_fn = lambda batch, n: [tuple(t[i::n] for t in batch) for i in range(n)]
    strided = train_regression(repl, "SGD", 3)
    (split,) = repl.run(
        lambda x, y: {"rows": tf.shape(x)[0], "firsts": repl.all_gather(x[:1, 0])}, regression_input_fn
    )
    return {
        "probe": probe,
        "sgd": sgd,
        "adam": adam,
        "strided_sgd": strided,
        "split": tf.nest.map_structure(lambda v: v.numpy(), split),
        "worker_id": repl.worker_id,
        "extras_at_start": extras_at_start,
        "extras_importable": extras_importable,
        "num_replicas": repl.num_replicas,
        "tf_config": os.environ["TF_CONFIG"],
    }


# ----- multi-worker (synchronous) ---------------------------------------------------------------
# The first four tests run on one warm pool of two workers, in this order (shares_warm_pool,
# tests/conftest.py): each later run takes it warm and must behave as on fresh processes; the
# killed worker's run retires it.
@pytest.mark.slow
@pytest.mark.shares_warm_pool
def test_multi_worker_conformance_matches_one_device():
    repl = wb.MultiWorkerReplicator(num_workers=2)
    assert repl.num_replicas == 2 and repl.describe()["synchronous"] is True
    results = repl.run_on_workers(conformance_on_worker)
    assert [r["worker_id"] for r in results] == [0, 1]
    for r in results:
        cluster = json.loads(r["tf_config"])["cluster"]
        assert all(a.startswith("127.0.0.1:") for a in cluster["worker"]), cluster  # loopback only
        (probe,) = r["probe"]  # one local replica per worker
        assert probe["sum"] == 3.0 and probe["mean"] == 0.5 and probe["max"] == 1.0
        assert list(probe["gather"]) == [0.0, 1.0] and probe["broadcast"] == 6.0
        assert r["extras_at_start"] == [] and r["extras_importable"]

    reference = wb.NonReplicator()
    sgd_weights, _ = train_regression(reference, "SGD", 1)
    adam_weights, adam_losses = train_regression(reference, "Adam", 20)
    _, sgd3_losses = train_regression(reference, "SGD", 3)
    for r in results:  # every worker holds the same (mirrored) weights
        np.testing.assert_allclose(r["strided_sgd"][1], sgd3_losses, atol=1e-5)
        # Replica i of the run got examples i, i+2, ... of the global batch of 16.
        assert r["split"]["rows"] == GLOBAL_BATCH // 2
        np.testing.assert_allclose(r["split"]["firsts"], X[:2, 0])
        for got, want in zip(r["sgd"][0], sgd_weights):
            np.testing.assert_allclose(got, want, atol=1e-5)
        for got, want in zip(r["adam"][0], adam_weights):
            np.testing.assert_allclose(got, want, atol=1e-5)
        np.testing.assert_allclose(r["adam"][1], adam_losses, atol=1e-5)


@pytest.mark.slow
@pytest.mark.shares_warm_pool
def test_multi_worker_interrupt_stops_every_worker_at_one_step():
    repl = wb.MultiWorkerReplicator(num_workers=2)
    events = []
    state = {}

    def interrupt_when_training(event):
        events.append(event)
        if event.kind == "metrics" and event.data["rows"][-1]["step"] >= 30 and "sent" not in state:
            state["sent"] = time.monotonic()
            os.kill(os.getpid(), signal.SIGINT)  # what a Jupyter interrupt does to the kernel

    run = repl.train(setup=regression_setup, steps=1_000_000, sinks=[interrupt_when_training])
    # A Jupyter interrupt and a Stop end the same way: "stopped", the reason says which.
    assert run.status == "stopped" and run.stop_reason == f"interrupted at step {run.steps}", run.stop_reason
    assert time.monotonic() - state["sent"] < 10
    history = run.history
    assert len(history) == run.steps and list(history["step"]) == list(range(1, run.steps + 1))
    assert np.isfinite(history["loss"]).all()
    texts = [e.data.get("text", "") for e in events if e.kind == "message"]
    # (on fresh processes "processes ready in ...", on the warm pool "warm pool (run N) ready in ...")
    assert any(re.match(r"multi-worker (processes|warm pool \(run \d+\)) ready in", t) for t in texts), texts
    assert [(p["role"], p["index"]) for p in run.processes] == [("worker", 0), ("worker", 1)]


@pytest.mark.slow
@pytest.mark.shares_warm_pool
def test_replicate_cell_on_multi_worker_trains_in_workers_and_returns_the_weights(notebook):
    run = notebook.run_cell_magic(
        "replicate", "--backend multi-worker --workers 2 --steps 150 --no-live", PROCESS_CELL
    )
    assert isinstance(run, wb.Run) and run.status == "finished" and run.steps == 150
    assert run.config["backend"] == "multi-worker" and run.config["num_workers"] == 2
    history = run.history
    assert history["loss"].iloc[-10:].mean() < 0.1 * history["loss"].iloc[:10].mean()
    # The notebook's `model` was built by the cell here and now holds the chief's trained weights.
    model = notebook.user_ns["model"]
    x = np.random.RandomState(2).randn(64, 8).astype("float32")
    target = x @ np.linspace(-1, 1, 8, dtype="float32")[:, None]
    assert float(np.mean((model(x).numpy() - target) ** 2)) < 0.1 * float(np.mean(target**2))
    assert any("trained weights" in e.data.get("text", "") for e in run.events if e.kind == "message")
    assert wb.runs()["id"].str.contains(run.id).any()  # recorded in the run store like any run


def start_background_run(repl, steps=1_000_000):
    run = repl.train(setup=regression_setup, steps=steps, background=True)
    wait_for_steps(run, 10)
    return run


@pytest.mark.slow
@pytest.mark.shares_warm_pool
def test_multi_worker_killed_worker_stops_the_run_with_its_name():
    run = start_background_run(wb.MultiWorkerReplicator(num_workers=2))
    os.kill(process_pid(run, "worker", 1), signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(wb.WorkerError, match=r"worker 1 \(pid \d+\) killed by SIGKILL") as info:
        run.wait(timeout=60)
    assert time.monotonic() - killed < 30
    assert info.value.task == "worker 1" and run.status == "failed"
    assert len(run.history) == run.steps > 0  # the history up to the failure is kept


@pytest.mark.slow
def test_multi_worker_frozen_worker_is_named_within_30_seconds():
    run = start_background_run(wb.MultiWorkerReplicator(num_workers=2, heartbeat_timeout=8))
    os.kill(process_pid(run, "worker", 1), signal.SIGSTOP)
    frozen = time.monotonic()
    with pytest.raises(wb.WorkerError, match=r"worker 1 \(pid \d+\) stopped responding"):
        run.wait(timeout=60)
    assert time.monotonic() - frozen < 30


@pytest.mark.slow
@pytest.mark.shares_warm_pool
def test_a_busy_worker_whose_heartbeats_are_late_is_not_frozen_until_the_limit():
    # Its heartbeat thread cannot run while one call holds the GIL: late heartbeats with CPU time
    # used are a busy process (the run goes on), for at most BUSY_SILENCE_LIMIT timeouts.
    from workbench._src.launch.liveness import BUSY_SILENCE_LIMIT

    repl = wb.MultiWorkerReplicator(num_workers=2, heartbeat_timeout=2)
    run = repl.train(setup=busy_worker_1_setup(4), steps=20)  # silent 4 s or more: 2 timeouts
    assert run.status == "finished" and run.steps == 20
    with pytest.raises(
        wb.WorkerError,
        match=r"worker 1 \(pid \d+\) stopped responding: no heartbeat for \d+ s while it kept a CPU busy "
        r"\((\d+) CPU-seconds",
    ) as caught:
        # A call 16 times the limit (in CPU time, as the limit is): the run ends once the worker
        # has used the limit's CPU time while silent (2 timeouts x 6 = 12 CPU-s), not at the
        # call's end (192 CPU-s). The CPU time it used says which; wall time does not (at load 20
        # this run took 169 s: a process getting a share of a core is not stuck).
        repl.train(setup=busy_worker_1_setup(16 * BUSY_SILENCE_LIMIT * 2), steps=20)
    used = int(re.search(r"\((\d+) CPU-seconds", str(caught.value)).group(1))
    assert BUSY_SILENCE_LIMIT * 2 <= used < 2 * BUSY_SILENCE_LIMIT * 2, str(caught.value)
    # (where its work was, on both placements: test_pools.py)


@pytest.mark.slow
@pytest.mark.shares_warm_pool
def test_a_worker_asleep_in_one_call_holding_the_gil_is_not_frozen_until_the_limit():
    # No heartbeat and no CPU time, but not stopped: one call sleeps holding the GIL (TensorFlow
    # waiting for a remote worker's answer). The run goes on for up to BUSY_SILENCE_LIMIT timeouts
    # of such silence (a stopped worker is named after one: test_multi_worker_frozen_worker_...).
    from workbench._src.launch.liveness import BUSY_SILENCE_LIMIT

    repl = wb.MultiWorkerReplicator(num_workers=2, heartbeat_timeout=2)
    run = repl.train(setup=asleep_worker_1_setup(6), steps=20)  # silent 6 s: 3 timeouts
    assert run.status == "finished" and run.steps == 20
    with pytest.raises(
        wb.WorkerError,
        match=r"worker 1 \(pid \d+\) stopped responding: no heartbeat for (\d+) s .*asleep in one call",
    ) as caught:
        repl.train(setup=asleep_worker_1_setup(4 * BUSY_SILENCE_LIMIT * 2), steps=20)
    assert caught.value.cause.startswith("asleep and silent"), caught.value.cause


def mistake_setup(raised_by: tuple[int, ...], late_worker: int | None = None, late_by: float = 0.0):
    """A mistake in the run's code (a ValueError) made by the workers in `raised_by`; the
    others go on to train. `late_worker` makes it `late_by` seconds after the others do (a
    loaded machine delays one worker's report so)."""

    def setup(repl):
        if repl.worker_id == late_worker:
            time.sleep(late_by)
        if repl.worker_id in raised_by:
            raise ValueError(f"batch size 7 does not divide over the replicas (worker {repl.worker_id})")
        return regression_setup(repl)

    return setup


@pytest.mark.slow
def test_a_mistake_every_worker_makes_is_reported_as_worker_0s_and_one_worker_makes_as_its_own():
    # As an in-process run would raise it: the first worker's error, whichever report came
    # first (a loaded suite run headed a kernel's error "worker 1: NameError": worker 0's came
    # over 0.7 s late). A mistake only one worker makes is that worker's, not the chief's
    # collective failure that follows it.
    repl = wb.MultiWorkerReplicator(num_workers=2)
    with pytest.raises(wb.WorkerError, match=r"^worker 0: ValueError: batch size 7 .*\(worker 0\)") as caught:
        repl.train(setup=mistake_setup(raised_by=(0, 1), late_worker=0, late_by=3.0), steps=20)
    assert caught.value.task == "worker 0"
    with pytest.raises(wb.WorkerError, match=r"^worker 1: ValueError: batch size 7 .*\(worker 1\)") as caught:
        repl.train(setup=mistake_setup(raised_by=(1,)), steps=20)
    assert caught.value.task == "worker 1"


def worker_number(repl):
    return repl.worker_id


@pytest.mark.slow
def test_a_worker_that_exits_before_its_result_is_read_is_not_a_fault(monkeypatch):
    # The race CI once lost: a worker sends its result and exits; the launcher's
    # poll sees the exit before it has read those messages. Here that order is forced: the
    # first result is held back until its worker has exited, and the poll runs first.
    from workbench._src.launch.watch import Watch

    handle = Watch._handle
    held = []

    def read_late(watch, task, message):
        if message.get("type") == "result" and not held:
            held.append(task)
            watch._child(task).popen.wait(timeout=60)
            time.sleep(0.3)  # its "disconnected" reaches the queue behind it
            watch.channel.messages.queue.appendleft((task, message))  # unread again, first in line
            watch._check()  # the poll between the exit and the read
            return
        handle(watch, task, message)

    monkeypatch.setattr(Watch, "_handle", read_late)
    # pool=False: each worker exits after its result (a warm pool's stay up for the next run).
    results = wb.MultiWorkerReplicator(num_workers=2, pool=False).run_on_workers(worker_number)
    assert held and sorted(results) == [0, 1]


@pytest.mark.slow
def test_peer_that_never_starts_gives_a_startup_timeout(tmp_path):
    from workbench._src.placements.ports import free_ports

    ports = free_ports(2)
    tf_config = {
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
        "task": {"type": "worker", "index": 0},
    }
    env = {**os.environ, "TF_CONFIG": json.dumps(tf_config)}
    started = time.monotonic()
    script = os.path.join(os.path.dirname(__file__), "data", "toy_train.py")
    done = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "run", script, "--backend", "multi-worker",
         "--cluster", "TF_CONFIG", "--steps", "5", "--startup-timeout", "8"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    unreachable = f"never accepted a connection: worker 1 at 127.0.0.1:{ports[1]}"
    assert unreachable in done.stderr, done.stderr[-2000:]
    assert "Nothing was started here, so the process is still usable" in done.stderr
    assert time.monotonic() - started < 90


@pytest.mark.parametrize("backend", [wb.MultiWorkerReplicator, wb.MultiWorkerAsyncReplicator])
def test_functions_holding_tensorflow_state_get_a_clear_error(backend):
    repl = backend(num_workers=2)
    model = make_model()

    def step_fn(x, y):
        return {"loss": tf.reduce_mean(model(x))}

    with pytest.raises(wb.ConfigurationError, match=r"TensorFlow state.*setup=build"):
        repl.train(step_fn, regression_input_fn, steps=5)
    with pytest.raises(wb.ConfigurationError, match="no strategy"):
        repl.strategy  # noqa: B018 - the notebook's replicator of a local cluster has none


# ----- nothing left behind when the kernel dies -----------------------------------------------------
KERNEL_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import cloudpickle
    sys.path.insert(0, {tests!r})
    import test_process_backends as t
    cloudpickle.register_pickle_by_value(t)
    import workbench as wb
    ps = wb.MultiWorkerAsyncReplicator(num_workers=1, num_ps=1)
    ps_run = ps.train(setup=t.regression_setup, steps=10**6, background=True)
    run = wb.MultiWorkerReplicator(num_workers=2).train(setup=t.regression_setup, steps=10**6, background=True)
    while (run.steps < 5 or ps_run.steps < 5) and not (run.ended or ps_run.ended):
        time.sleep(0.1)
    if run.ended or ps_run.ended:  # say why, instead of leaving the test to time out
        print("ENDED", run.status, run.stop_reason, ps_run.status, ps_run.stop_reason, flush=True)
    print(" ".join(str(p["pid"]) for p in run.processes + ps_run.processes), flush=True)
    time.sleep(600)
    """
)


def alive(pid: int) -> bool:
    """pid runs (a zombie does not count: it has exited, its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_killed_kernel_leaves_no_processes(tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL_SCRIPT.format(tests=os.path.dirname(__file__)))
    with open(tmp_path / "kernel.log", "w") as log:  # the script's stderr, for the error message
        kernel = subprocess.Popen(
            [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=log, text=True
        )
    try:
        line: list[str] = []
        ready = threading.Event()
        threading.Thread(
            target=lambda: (line.append(kernel.stdout.readline()), ready.set()), daemon=True
        ).start()
        started = ready.wait(240)
        assert started and not line[0].startswith("ENDED"), (
            f"the kernel script did not start its clusters: {line[:1]}\n"
            + (tmp_path / "kernel.log").read_text()[-3000:]
        )
        pids = [int(p) for p in line[0].split()]
        # 2 sync workers; the async-ps coordinator, its worker and its parameter server
        assert len(pids) == 5 and all(alive(p) for p in pids), line
        kernel.kill()  # SIGKILL: no atexit, no finally; the children must notice by themselves
        kernel.wait()
        deadline = time.monotonic() + 15
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if alive(p)]
    finally:
        if kernel.poll() is None:
            kernel.kill()


# ----- scaling studies on worker processes ----------------------------------------------------
def study_regression_setup(repl, ctx):
    """regression_setup batched as the study prescribes: every worker yields the global batch and
    tf.distribute keeps each worker's share, so 1 and 2 workers step on the same global batches."""
    step_fn, _ = regression_setup(repl)

    def input_fn(ctx):
        data = tf.data.Dataset.from_tensor_slices((X, Y))
        return data.repeat().batch(ctx.global_batch_size, drop_remainder=True)

    return step_fn, input_fn


@pytest.mark.slow
def test_scaling_study_on_worker_processes(tmp_path):
    study = wb.scaling_study(
        setup=study_regression_setup, backend="multi-worker", replicas=[1, 2], mode="strong",
        batch_size=32, steps=20, warmup=10, steps_per_execution=5, path=tmp_path / "study.png", live=False,
    )  # fmt: skip
    table = study.table
    assert list(table["replicas"]) == [1, 2] and list(table["global_batch"]) == [32, 32]
    assert list(table["per_replica_batch"]) == [32, 16] and list(table["steps"]) == [20, 20]
    assert table[["step_time_median_s", "step_time_p90_s", "compile_seconds"]].notna().all().all()
    assert (table["compile_seconds"] > 0).all()  # the warm-up's, measured in the workers
    assert (table["startup_seconds"] > 0).all()  # processes started and joined the cluster
    # One figure per configuration: speed-up and efficiency come from the run's own examples/s
    # (what the sidebar shows), not from the median compiled step.
    assert table["efficiency"].iloc[1] == pytest.approx(
        (table["examples_per_sec"].iloc[1] / table["examples_per_sec"].iloc[0]) / 2
    )
    for n, row in zip((1, 2), table.itertuples()):
        assert row.examples_per_sec == pytest.approx(study.runs[n].summary()["examples_per_sec"], rel=1e-6)
    # Honest about the hardware: two worker processes share this machine's cores.
    assert list(table["devices_kind"]) == ["CPU process"] * 2
    assert "2 worker processes" in table["threads_note"].iloc[1] and table["shared_cores"].iloc[1]
    # Every configuration starts from the same weights (seeded setup in each worker) and steps on
    # the same global batches, so after the same warm-up the first measured loss agrees.
    first = [study.runs[n].history["loss"].iloc[0] for n in (1, 2)]
    assert first[0] == pytest.approx(first[1], rel=1e-4)
    assert len(study.runs[2].history) == 20
    assert (tmp_path / "study.png").stat().st_size > 10_000


@pytest.mark.slow
def test_replicate_scaling_cell_on_multi_worker(notebook):
    cell = PROCESS_CELL.replace(".batch(32)", ".batch(ctx.global_batch_size, drop_remainder=True)")
    options = "--backend multi-worker --steps 10 --warmup 5 --steps-per-execution 5 --no-live"
    study = notebook.run_cell_magic("replicate", f"{options} --scaling 1,2", cell)
    assert isinstance(study, wb.ScalingStudy)
    assert list(study.table["replicas"]) == [1, 2] and list(study.table["global_batch"]) == [32, 64]
    assert study.table["examples_per_sec"].notna().all() and list(study.table["steps"]) == [10, 10]
    # The cell also ran here first (its mistakes would show at once); the session's repl is back.
    assert "model" in notebook.user_ns and "repl" not in notebook.user_ns
    # A cell that ignores the prescribed batch is refused with the study's own message, although
    # the mismatch is found inside a worker process.
    with pytest.raises(UsageError, match=r"must yield batches of 64 \(ctx.global_batch_size\).*Fix"):
        notebook.run_cell_magic(
            "replicate", f"{options} --scaling 1 --mode strong --batch-size 64", PROCESS_CELL
        )


@pytest.mark.slow
def test_a_checkpointed_multi_worker_run_leaves_no_temporary_folders(tmp_path, monkeypatch):
    # Every temporary folder of the run (the launch's logs and channel, a non-chief worker's
    # checkpoint scratch copy) is made under TMPDIR, which the workers inherit: a private one here,
    # so other users of the machine cannot disturb the check.
    import tempfile

    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    repl = wb.MultiWorkerReplicator(num_workers=2)
    run = repl.train(setup=regression_setup, steps=20, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=10)
    assert run.status == "finished" and tf.train.latest_checkpoint(str(tmp_path / "ckpt")).endswith("-20")
    assert [e.data["path"] for e in run.events if e.kind == "checkpoint"]  # the chief saved
    repl.shutdown()  # the warm pool keeps its folders while it lives; they go with it
    # (TensorFlow's AutoGraph writes its own generated files there, in this process: not ours.)
    assert [name for name in os.listdir(private_tmp) if name.startswith("workbench")] == []
