"""The owned run loop and the input modes: caching, fusing, continuation, stops, checkpoints."""

import logging
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf
from toy_models import make_mlp, toy_data

import workbench as wb


def counting_input(ctx):
    """Global batches [4, 1] holding 0, 1, 2, ...: the step number is readable from the data."""
    return tf.data.Dataset.range(10**9).map(lambda i: tf.fill([4, 1], tf.cast(i, tf.float32)))


def test_import_does_not_import_tensorflow():
    code = "import sys, workbench; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_run_is_compiled_once_and_continues_the_input():
    repl = wb.replicator("mirrored", num_replicas=2)
    traces = []

    def step_fn(batch):
        traces.append(1)  # Python side effect: runs once per trace (per replica), not per step
        return {"value": tf.reduce_mean(batch)}

    seen = [float(repl.run(step_fn, counting_input)[0]["value"]) for _ in range(5)]
    assert seen == [0, 1, 2, 3, 4]
    assert len(traces) == 2  # one trace, two replicas


def test_train_continues_from_the_same_iterator_and_reuses_the_compiled_loop():
    repl = wb.replicator("mirrored", num_replicas=2)
    traces = []

    def step_fn(batch):
        traces.append(1)
        return {"value": tf.reduce_mean(batch)}

    first = repl.train(step_fn, counting_input, steps=7, steps_per_execution=3)
    traced = len(traces)
    second = repl.train(step_fn, counting_input, steps=5)  # auto: other chunk lengths
    assert list(first.history["value"]) == list(range(7))
    assert list(second.history["value"]) == list(range(7, 12))
    # steps count from the run's start; the program's own count goes on (global_step)
    assert list(second.history["step"]) == [1, 2, 3, 4, 5]
    assert list(second.history["global_step"]) == list(range(8, 13))
    assert len(traces) == traced  # n is a tensor: no retrace for other chunk sizes


def test_history_throughput_and_summary():
    repl = wb.replicator("mirrored", num_replicas=4)
    step_fn = lambda b: {"m": tf.reduce_mean(b)}  # noqa: E731
    run = repl.train(step_fn, counting_input, steps=50, steps_per_execution=10)
    h = run.history
    assert len(h) == 50 and h["step"].tolist() == list(range(1, 51))
    assert np.isnan(h["examples_per_sec"][:10]).all()  # the first call traces: not a throughput
    assert (h["examples_per_sec"][10:] > 0).all() and run.compile_seconds > 0
    # The same program again (e.g. after a warm-up run): nothing to trace, timed from its first step.
    more = repl.train(step_fn, counting_input, steps=10, steps_per_execution=10)
    assert (more.history["examples_per_sec"] > 0).all() and more.compile_seconds == 0.0
    assert h["wall_time"].is_monotonic_increasing
    assert run.summary()["steps"] == 50 and run.summary()["status"] == "finished"
    kinds = [e.kind for e in run.events]
    assert kinds[0] == "started" and kinds[-1] == "ended" and kinds.count("metrics") == 5


def test_finite_input_ends_the_run_cleanly():
    repl = wb.replicator("mirrored", num_replicas=2)

    def input_fn(ctx):
        return tf.data.Dataset.from_tensor_slices(tf.ones([24, 1])).batch(4)

    # A finite dataset that runs out before `steps` ends the run cleanly, and says so: how many
    # steps ran, why, and the fix.
    with pytest.warns(RuntimeWarning, match=r"input exhausted after 6 of 100 steps.*Fix: add \.repeat\(\)"):
        run = repl.train(lambda b: {"s": tf.reduce_sum(b)}, input_fn, steps=100)
    assert run.status == "finished" and run.steps == 6
    assert run.stop_reason.startswith("input exhausted after 6 of 100 steps")


def test_background_run_stops_at_a_step_boundary():
    repl = wb.replicator("mirrored", num_replicas=2)
    seen = []
    run = repl.train(
        lambda b: {"v": tf.reduce_mean(b)}, counting_input, steps=10**7, background=True, sinks=[seen.append]
    )
    assert run.running
    deadline = time.time() + 60
    while run.steps < 20 and time.time() < deadline:
        time.sleep(0.05)
    t0 = time.perf_counter()
    run.stop().wait(timeout=30)
    assert time.perf_counter() - t0 < 2.0
    assert run.status == "stopped" and 20 <= run.steps < 10**7
    assert list(run.history["v"]) == list(range(run.steps))  # no step lost or repeated
    assert seen[-1].kind == "ended" and seen[-1].data["status"] == "stopped"


def test_ctrl_c_stops_the_run_and_returns_it():
    repl = wb.replicator("mirrored", num_replicas=2)
    sent = []
    # What SIGINT did before the run (Python's KeyboardInterrupt, or SIG_IGN when an earlier test
    # of this worker process left it so: one suite run did): the run's handler replaces it, then
    # puts it back.
    before = signal.getsignal(signal.SIGINT)

    def ctrl_c_once_training(event):
        # A real SIGINT, once steps are being recorded. (A timer started before `train` raced
        # the run's set-up under load: a signal before the run's handler is a KeyboardInterrupt
        # of the set-up, not a stop, and one was lost so: the test then ran 10**7 steps.)
        if event.kind == "metrics" and not sent:
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)

    run = repl.train(
        lambda b: {"v": tf.reduce_mean(b)}, counting_input, steps=10**7, sinks=[ctrl_c_once_training]
    )
    assert sent and time.monotonic() - sent[0] < 30
    assert run.status == "stopped" and run.steps > 0
    assert run.stop_reason == f"interrupted at step {run.steps}"
    assert list(run.history["v"]) == list(range(run.steps))
    assert signal.getsignal(signal.SIGINT) is before  # handler restored


def _model_step(repl, lr=0.1):
    import keras

    x, y = toy_data(rows=64)
    with repl.context():
        model = make_mlp()
        opt = repl.wrap_optimizer(keras.optimizers.SGD(lr))

    def input_fn(ctx):
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True).repeat()

    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(yb, model(xb, training=True), from_logits=True)
            )
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return {"loss": loss}

    return model, opt, step_fn, input_fn


def test_checkpoint_saves_and_resumes(tmp_path):
    repl = wb.replicator("mirrored", num_replicas=2)
    model, opt, step_fn, input_fn = _model_step(repl)
    run = repl.train(step_fn, input_fn, steps=30, checkpoint_dir=tmp_path, checkpoint_every=10)
    saved = [e.data["path"] for e in run.events if e.kind == "checkpoint"]
    assert [os.path.basename(p) for p in saved] == ["ckpt-10", "ckpt-20", "ckpt-30"]
    trained = model.get_weights()

    # A new session: same construction, fresh weights; the checkpoint is restored first.
    repl2 = wb.replicator("mirrored", num_replicas=2)
    model2, _, step_fn2, input_fn2 = _model_step(repl2)
    assert not np.allclose(model2.get_weights()[0], trained[0])
    resumed = repl2.train(step_fn2, input_fn2, steps=0, checkpoint_dir=tmp_path)
    assert "resumed from checkpoint at step 30" in resumed.events[0].data["text"]
    for a, b in zip(model2.get_weights(), trained):
        np.testing.assert_array_equal(a, b)
    more = repl2.train(step_fn2, input_fn2, steps=5, checkpoint_dir=tmp_path)
    assert more.history["step"].tolist() == [1, 2, 3, 4, 5]
    assert more.history["global_step"].tolist() == [31, 32, 33, 34, 35]


def test_restore_loads_a_checkpoint_into_a_model_built_on_another_backend(tmp_path):
    repl = wb.replicator("mirrored", num_replicas=2)
    model, _, step_fn, input_fn = _model_step(repl)
    repl.train(step_fn, input_fn, steps=12, checkpoint_dir=tmp_path)
    # Evaluate on one device: the same construction under wb.NonReplicator, then restore.
    single = wb.NonReplicator()
    evaluation_model, *_ = _model_step(single)
    assert single.restore(tmp_path) == 12
    for a, b in zip(evaluation_model.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(wb.ConfigurationError, match=r"No checkpoint to restore in '.*empty'.*Fix"):
        single.restore(tmp_path / "empty")
    with pytest.raises(wb.ConfigurationError, match=r"Nothing to restore into.*repl.context\(\)"):
        wb.NonReplicator().restore(tmp_path)


def test_context_is_reentrant_and_remembers_each_variable_once():
    # A setup function may open repl.context() although its caller (train(setup=...), a study)
    # already did: the variables the checkpoint saves are still each recorded once.
    repl = wb.replicator("mirrored", num_replicas=2)
    with repl.context():
        outer = tf.Variable(1.0)
        with repl.context():
            inner = tf.Variable(2.0)
    assert [id(v) for v in repl._created_variables] == [id(outer), id(inner)]
    assert isinstance(inner, tf.distribute.DistributedValues)  # still mirrored in the inner scope


def test_an_ended_setup_run_is_forgotten_by_the_replicator_when_the_next_one_starts():
    # Its functions were made for it: kept, every setup= run's traced graphs, input iterator and
    # weights stayed with the replicator (20-40 MiB a run for a digits MLP). Kept until the next
    # setup= run starts (a worker process reads them after the run to send them back), then
    # dropped; what the replicator held before (the user's variables, a program of their
    # functions) stays.
    import gc
    import weakref

    repl = wb.replicator("mirrored", num_replicas=2)
    with repl.context():
        mine = tf.Variable(3.0)
    x = np.ones((64, 4), "float32")
    users_step = lambda b: {"m": tf.reduce_mean(b)}  # noqa: E731
    users_input = lambda ctx: tf.data.Dataset.from_tensor_slices(x).repeat().batch(16)  # noqa: E731
    repl.train(users_step, users_input, steps=2)
    built = []

    def setup(repl):
        w = tf.Variable(tf.ones((4, 1)))
        built.append(weakref.ref(w))
        return (lambda b: {"y": tf.reduce_mean(b @ w)}), users_input

    for background in (False, True, False):
        run = repl.train(setup=setup, steps=3, background=background).wait(timeout=600)
        assert run.status == "finished"
        assert len(repl._programs) == 2  # the user's, and this run's own until the next
        assert [id(v) for v in repl._created_variables] == [id(mine), id(built[-1]())]
    del run
    gc.collect()
    assert [ref() is None for ref in built] == [True, True, False]  # the last run's, until the next


def test_the_gradient_functions_a_setup_runs_traces_registered_go_with_it():
    # ReplicaContext.all_reduce (wrap_optimizer's, on the gradients) is a tf.custom_gradient: each
    # trace registers a gradient function for good in TensorFlow's global registry, holding its
    # graph (compat.custom_gradient_names). A forgotten setup= run takes its own out again.
    import keras

    from workbench._src import compat

    repl = wb.replicator("mirrored", num_replicas=2)
    x = np.ones((64, 4), "float32")

    def setup(repl):
        w = tf.Variable(tf.ones((4, 1)))
        optimizer = repl.wrap_optimizer(keras.optimizers.SGD(0.1))

        def step_fn(b):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(b @ w)
            optimizer.apply_gradients([(tape.gradient(loss, w), w)])
            return {"loss": loss}

        return step_fn, lambda ctx: tf.data.Dataset.from_tensor_slices(x).repeat().batch(16)

    before = compat.custom_gradient_names()
    registered = []
    for _ in range(3):
        repl.train(setup=setup, steps=3)
        registered.append(compat.custom_gradient_names() - before)
    assert registered[0] and not registered[0] & registered[2]  # the first run's are gone
    assert len(registered[2]) == len(registered[1])  # one run's worth, not one more each run


def test_interrupted_run_writes_its_checkpoint(tmp_path):
    repl = wb.replicator("single")
    model, opt, step_fn, input_fn = _model_step(repl)
    run = repl.train(step_fn, input_fn, steps=10**7, background=True, checkpoint_dir=tmp_path)
    while run.steps < 5:
        time.sleep(0.05)
    run.stop().wait(30)
    final = [e for e in run.events if e.kind == "checkpoint"][-1]
    assert final.data["final"] and final.data["path"].endswith(f"ckpt-{run.steps}")


def test_two_wrapped_optimizers_in_one_step():
    """A GAN/actor-critic style step: two losses, two optimizers, each averaged across replicas."""
    import keras

    def build(repl):
        with repl.context():
            keras.utils.set_random_seed(1)
            a, b = tf.Variable([1.0, 2.0]), tf.Variable([3.0])
            opt_a = repl.wrap_optimizer(keras.optimizers.Adam(0.1))
            opt_b = repl.wrap_optimizer(keras.optimizers.SGD(0.1))

        def step_fn(x):
            with tf.GradientTape(persistent=True) as tape:
                loss_a = tf.reduce_mean((x[:, :2] * a - 1.0) ** 2)
                loss_b = tf.reduce_mean((x[:, 2:] * b + tf.stop_gradient(tf.reduce_sum(a))) ** 2)
            opt_a.apply_gradients([(tape.gradient(loss_a, a), a)])
            opt_b.apply_gradients([(tape.gradient(loss_b, b), b)])
            return {"loss_a": loss_a, "loss_b": loss_b}

        return a, b, step_fn

    x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")

    def input_fn(ctx):
        return tf.data.Dataset.from_tensor_slices(x).batch(16, drop_remainder=True).repeat()

    results = []
    for repl in (wb.NonReplicator(), wb.replicator("mirrored", num_replicas=4)):
        a, b, step_fn = build(repl)
        repl.train(step_fn, input_fn, steps=10)
        results.append(np.concatenate([a.numpy(), b.numpy()]))
    np.testing.assert_allclose(results[0], results[1], atol=1e-5)


def test_per_replica_input_gives_each_replica_its_own_pipeline():
    repl = wb.MultiGpuReplicator(num_gpus=4, input_replication=wb.InputReplication.PER_REPLICA)
    contexts = []

    def input_fn(ctx):
        contexts.append(ctx)
        return tf.data.Dataset.from_tensors(tf.fill([3], float(ctx.replica_id))).repeat()

    outs = repl.run(lambda b: {"first": b[0], "rid": tf.cast(repl.replica_id, tf.float32)}, input_fn)
    assert [float(o["first"]) for o in outs] == [0, 1, 2, 3]
    assert [c.replica_id for c in contexts] == [0, 1, 2, 3] and contexts[0].num_replicas == 4


def test_custom_input_split_fn_and_callable_input():
    def split_time_major(batch, n):  # [time, batch] sequences: split the batch axis (1), not time
        return tf.split(batch, n, axis=1)

    repl = wb.MultiGpuReplicator(num_gpus=2, input_split_fn=split_time_major)

    def input_fn(ctx):
        return lambda: tf.reshape(tf.range(12, dtype=tf.float32), [3, 4])  # a callable, not a dataset

    outs = repl.run(lambda b: {"part": b}, input_fn)
    np.testing.assert_array_equal(outs[0]["part"].numpy(), [[0, 1], [4, 5], [8, 9]])
    np.testing.assert_array_equal(outs[1]["part"].numpy(), [[2, 3], [6, 7], [10, 11]])


# ----- run ids, the started event, the optimizer-build log (issue 4 follow-ups) -------------
RUN_ID = r"^\d{8}-\d{6}-[0-9a-f]{6}$"


@pytest.mark.slow
def test_run_ids_are_unique_across_processes_and_sort_by_time():
    code = "from workbench._src.core.run import Run\nprint(' '.join(Run({}).id for _ in range(3)))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(3)
    ]
    ids = [out.split() for out in (p.communicate(timeout=60)[0] for p in procs)]
    flat = [i for per_process in ids for i in per_process]
    assert len(flat) == 9 and len(set(flat)) == 9  # same second, three processes: still distinct
    assert all(re.match(RUN_ID, i) for i in flat), flat
    here = wb.Run({}, name="mine")
    assert re.match(RUN_ID, here.id) and here.name == "mine"
    assert here.id[:15] <= time.strftime("%Y%m%d-%H%M%S")  # starts with the time: sortable


def test_started_event_carries_the_run_name():
    repl = wb.replicator("single")
    name = f"baseline {time.time_ns()}"  # names are unique in the store, which outlives the suite
    run = repl.train(lambda b: {"m": tf.reduce_mean(b)}, counting_input, steps=2, name=name)
    started = [e for e in run.events if e.kind == "started"][0]
    assert started.data["name"] == name and started.data["config"]["steps"] == 2
    assert started.data["first_step"] == 1 and started.run_id == run.id


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_the_optimizer_build_retrace_logs_no_coordinator_error_but_real_errors_still_do():
    import keras

    logger = logging.getLogger("tensorflow")
    records, level = _Records(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)  # the coordinator logs at INFO, as a notebook may show
    try:
        repl = wb.replicator("mirrored", num_replicas=2)
        with repl.context():
            w = tf.Variable(tf.ones([1]))
            opt = repl.wrap_optimizer(keras.optimizers.Adam(0.1))  # unbuilt: built on first trace

        def step_fn(batch):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(batch * w)
            opt.apply_gradients([(tape.gradient(loss, w), w)])
            return {"loss": loss}

        assert repl.train(step_fn, counting_input, steps=3).status == "finished"
        assert not [m for m in records.messages if "Error reported to Coordinator" in m]

        def broken_step(batch):
            raise ValueError("a real mistake in step_fn")

        try:
            repl.train(broken_step, counting_input, steps=1)
        except ValueError:
            pass
        assert [m for m in records.messages if "Error reported to Coordinator" in m and "real mistake" in m]
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)


# ----- faults end the run, never hang it -------------------------------------------------------------
def bad_batch_at_step_45(ctx):
    """44 global batches of 4 rows, then one of 3 (not divisible by 2 replicas), repeated."""
    return tf.data.Dataset.range(44 * 4 + 3).map(lambda i: tf.cast(i, tf.float32)[None]).batch(4).repeat()


@pytest.mark.parametrize("background", [False, True])
def test_a_failing_step_ends_the_run_and_the_error_carries_its_history(background):
    repl = wb.replicator("mirrored", num_replicas=2)
    step = lambda b: {"v": tf.reduce_mean(b)}  # noqa: E731
    run = None
    with pytest.raises(wb.InputError, match="does not divide evenly") as info:
        run = repl.train(step, bad_batch_at_step_45, steps=100, steps_per_execution=1, background=background)
        run.wait(timeout=120)
    run = info.value.run
    assert run is not None and run.status == "failed" and run.ended
    assert list(run.history["step"]) == list(range(1, 45))  # every step before the failing one
    assert "InputError" in run.stop_reason


@pytest.mark.parametrize("background", [False, True])
def test_an_unusable_checkpoint_dir_is_refused_before_the_first_step(tmp_path, background):
    repl = wb.replicator("mirrored", num_replicas=2)
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    for where in (a_file, a_file / "below-a-file"):
        with pytest.raises(
            wb.ConfigurationError, match=r"checkpoint_dir .*Fix: pass checkpoint_dir= a folder"
        ):
            repl.train(lambda b: {"v": tf.reduce_mean(b)}, counting_input, steps=5,
                       checkpoint_dir=where, background=background)  # fmt: skip


def test_resume_false_starts_from_the_variables_as_they_are(tmp_path):
    repl = wb.replicator("mirrored", num_replicas=2)
    with repl.context():
        counter = tf.Variable(0.0, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def step(batch):
        counter.assign_add(1.0)
        return {"counter": tf.identity(counter)}

    repl.train(step, counting_input, steps=5, checkpoint_dir=tmp_path)
    counter.assign(100.0)
    again = repl.train(step, counting_input, steps=2, checkpoint_dir=tmp_path, resume=False)
    assert list(again.history["counter"]) == [101.0, 102.0]  # not restored to 5
    resumed = wb.replicator("mirrored", num_replicas=2)
    with resumed.context():
        counter = tf.Variable(0.0, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    run = resumed.train(step, counting_input, steps=1, checkpoint_dir=tmp_path)  # resume=True
    assert run.history["counter"].iloc[0] == 103.0  # restored from the save at step 7 (102), +1
