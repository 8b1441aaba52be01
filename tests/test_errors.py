"""Bad input gets a clear error: what was wrong, what was received, how to fix it."""

import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import workbench as wb

# (ports that servers bind later: outside the kernel's ephemeral range, so no other socket takes
# one meanwhile; CI once met "Could not start gRPC server")
from workbench._src.placements.ports import free_ports


def batches(shape=(8, 2)):
    return lambda ctx: tf.data.Dataset.from_tensors(tf.ones(shape)).repeat()


def test_unknown_backend_lists_valid_names():
    with pytest.raises(
        wb.ConfigurationError, match=r"(?s)Unknown replicator backend 'mirored'.*'single'.*'mirrored'.*'tpu'"
    ):
        wb.replicator("mirored")


def test_more_replicas_than_devices():
    with pytest.raises(
        wb.DeviceError, match=r"(?s)needs 16 devices .* has 8 CPU device.*configure_devices\(cpus=16\)"
    ):
        wb.replicator("mirrored", num_replicas=16)


def test_single_backend_refuses_several_replicas():
    with pytest.raises(
        wb.ConfigurationError, match=r"(?s)exactly one replica; received num_replicas=4.*'mirrored'"
    ):
        wb.replicator("single", num_replicas=4)


def test_step_fn_signature_mismatch():
    repl = wb.replicator("mirrored", num_replicas=2)

    def step_fn(x, y, z):
        return {}

    with pytest.raises(
        wb.StepFunctionError,
        match=r"(?s)step_fn\(x, y, z\) takes 3 argument\(s\), but each input element is one .*Fix: write step_fn\(batch\)",
    ):
        repl.run(step_fn, batches())


def test_step_fn_unpacks_a_tuple_when_it_takes_its_parts():
    repl = wb.replicator("mirrored", num_replicas=2)

    def input_fn(ctx):
        return tf.data.Dataset.from_tensors((tf.ones([4, 2]), tf.zeros([4]))).repeat()

    out = repl.run(lambda x, y: {"s": tf.reduce_sum(x) + tf.reduce_sum(y)}, input_fn)
    assert [float(o["s"]) for o in out] == [4.0, 4.0]


def test_input_fn_returning_something_else():
    repl = wb.replicator("single")
    with pytest.raises(
        wb.InputError,
        match=r"(?s)input_fn \(<lambda>\) must return a tf.data.Dataset or a callable.*returned numpy.ndarray.*Fix",
    ):
        repl.run(lambda b: {}, lambda ctx: np.ones([4, 2]))


def test_global_batch_not_divisible_static():
    repl = wb.replicator("mirrored", num_replicas=4)
    with pytest.raises(
        wb.InputError,
        match=r"(?s)global batch of 10 does not divide across 4 replicas.*Fix: use a global batch that is a multiple of 4",
    ):
        repl.run(lambda b: {}, batches((10, 2)))


def test_global_batch_not_divisible_at_run_time():
    repl = wb.replicator("mirrored", num_replicas=4)

    def input_fn(ctx):  # 10 rows batched by 8 without drop_remainder: the last batch has 2
        return tf.data.Dataset.from_tensor_slices(tf.ones([10, 2])).batch(8)

    def step_fn(batch):
        return {"n": tf.cast(tf.shape(batch)[0], tf.float32)}

    run = repl.train(step_fn, input_fn, steps=1)
    assert run.steps == 1
    with pytest.raises(
        wb.InputError,
        match=r"(?s)does not divide evenly across 4 replicas; batch with drop_remainder=True or repeat\(\) before batch\(\)\. Received",
    ):
        repl.train(step_fn, input_fn, steps=1)


def test_step_fn_returning_non_tensors():
    repl = wb.replicator("mirrored", num_replicas=2)
    with pytest.raises(
        wb.StepFunctionError, match=r"(?s)must return tensors.*output 'note' is a builtins.str.*Fix"
    ):
        repl.run(lambda b: {"loss": tf.reduce_sum(b), "note": "hello"}, batches())


def test_primitives_outside_a_replica_context():
    repl = wb.replicator("mirrored", num_replicas=2)
    with pytest.raises(
        wb.ReplicaContextError,
        match=r"(?s)repl.all_sum\(\) was called outside any replicator.*Fix: move the call into step_fn",
    ):
        repl.all_sum(tf.ones([]))
    with repl.context():
        with pytest.raises(
            wb.ReplicaContextError, match=r"(?s)all_gather\(\) was called in cross-replica code"
        ):
            repl.all_gather(tf.ones([2]))


@pytest.mark.slow
def test_tensorflow_initialised_before_virtual_devices():
    script = textwrap.dedent(
        """
        import tensorflow as tf
        tf.constant(1.0)  # TensorFlow starts with one CPU device
        import workbench as wb
        try:
            wb.replicator("mirrored", num_replicas=4)
        except wb.DeviceError as e:
            print("ERROR:", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (
        "ERROR: TensorFlow was initialised with 1 CPU device(s) before the workbench could split"
        in out.stdout
    ), out.stderr[-2000:]
    assert "restart the kernel" in out.stdout and "wb.configure_devices(cpus=4)" in out.stdout


def test_tpu_absent():
    with pytest.raises(
        wb.TpuUnavailableError,
        match=r"(?s)No TPU is reachable .*tpu=None.*Fix: .*wb.replicator\('mirrored'\)",
    ):
        wb.replicator("tpu")


def test_nan_loss_stops_with_a_clear_reason():
    repl = wb.replicator("mirrored", num_replicas=2)
    with repl.context():
        w = tf.Variable(1.0)

    def step_fn(batch):
        w.assign_add(1.0)
        return {"loss": tf.math.log(5.0 - w)}  # log(0) at step 4, NaN after

    def input_fn(ctx):
        return tf.data.Dataset.from_tensors(tf.ones([2])).repeat()

    with pytest.warns(
        RuntimeWarning,
        match=r"(?s)Training stopped at step 4: metric 'loss' is -inf \(last finite value at step 3\)",
    ):
        run = repl.train(step_fn, input_fn, steps=20, steps_per_execution=1)
    assert run.status == "non-finite" and run.steps == 4
    assert np.isfinite(run.history["loss"][:3]).all()
    with pytest.raises(wb.NonFiniteError, match=r"(?s)metric 'loss' is nan") as err:
        repl.train(step_fn, input_fn, steps=5, on_nonfinite="raise")
    assert err.value.run.status == "non-finite"
    # Fused: the chunk of 10 steps ran on, but the history ends at the reported step.
    w.assign(0.0)
    with pytest.warns(RuntimeWarning, match="Training stopped at step 5"):
        fused = repl.train(step_fn, input_fn, steps=20, steps_per_execution=10)
    assert fused.status == "non-finite" and list(fused.history["step"]) == [1, 2, 3, 4, 5]


def test_bad_train_options():
    repl = wb.replicator("single")
    with pytest.raises(
        wb.ConfigurationError,
        match=r"(?s)steps_per_execution must be a positive integer; received steps_per_execution=0 \(int\)\. "
        r"Fix: .*'auto'",
    ):
        repl.train(lambda b: {}, batches(), steps=1, steps_per_execution=0)
    with pytest.raises(
        wb.ConfigurationError, match=r"(?s)reduce\['loss'\] must be 'mean' or 'sum'; received 'max'"
    ):
        repl.train(lambda b: {}, batches(), steps=1, reduce={"loss": "max"})


# ----- issue 17: mistakes plain tf.distribute lets through ----------------------------------


def _model_and_step(repl, model, opt):
    def input_fn(ctx):
        return tf.data.Dataset.from_tensors((tf.ones([4, 8]), tf.zeros([4], tf.int32))).repeat()

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return {"loss": loss}

    return step_fn, input_fn


def test_wrap_optimizer_twice():
    repl = wb.replicator("mirrored", num_replicas=2)
    with repl.context():
        adam = keras.optimizers.Adam(1e-3)
        opt = repl.wrap_optimizer(adam)
        with pytest.raises(
            wb.ConfigurationError,
            match=r"(?s)already wrapped: received ReplicatedOptimizer\(Adam, replicas=2\)\. .*divides every "
            r"gradient by the replica count twice.*Fix: use it as it is",
        ):
            repl.wrap_optimizer(opt)
        with pytest.raises(
            wb.ConfigurationError,
            match=r"(?s)This Adam optimizer is already wrapped by wrap_optimizer \(received the optimizer of "
            r"ReplicatedOptimizer\(Adam.*Fix: use the wrapped optimizer you already have",
        ):
            repl.wrap_optimizer(adam)
        assert repl.wrap_optimizer(keras.optimizers.Adam(1e-3))  # a new optimizer is fine


def test_variables_built_outside_the_context():
    from toy_models import make_mlp

    repl = wb.replicator("mirrored", num_replicas=2)
    model = make_mlp()  # outside repl.context()
    with repl.context():
        opt = repl.wrap_optimizer(keras.optimizers.Adam(1e-3))
    step_fn, input_fn = _model_and_step(repl, model, opt)
    with pytest.raises(
        wb.ConfigurationError,
        match=r"(?s)4 of the 4 variables given to the wrapped optimizer were not created in this mirrored "
        r"replicator's repl.context\(\).*received sequential.*/kernel.*Fix: build the model and the optimizer "
        r"inside `with repl.context\(\):`",
    ):
        repl.train(step_fn, input_fn, steps=2)

    repl = wb.replicator("mirrored", num_replicas=2)
    with repl.context():
        model = make_mlp()
    opt = repl.wrap_optimizer(keras.optimizers.Adam(1e-3))  # the optimizer outside
    step_fn, input_fn = _model_and_step(repl, model, opt)
    with pytest.raises(
        wb.ConfigurationError,
        match=r"(?s)The wrapped optimizer \(Adam\) was created outside this mirrored replicator's "
        r"repl.context\(\).*received iterations=.*Fix: create it inside `with repl.context\(\):`",
    ):
        repl.train(step_fn, input_fn, steps=2)


@pytest.mark.parametrize(
    "backend, fix",
    [
        ("mirrored", r"wb.replicator\('mirrored', num_replicas=2\), or leave it out"),
        ("single", r"leave num_replicas out \('single' runs one replica\)"),
        ("tpu", r"leave num_replicas out \('tpu' uses every core"),
    ],
)
@pytest.mark.parametrize("value", [0, -1, "2", 2.0, True])
def test_num_replicas_must_be_a_positive_integer(backend, fix, value):
    with pytest.raises(
        wb.ConfigurationError,
        match=rf"num_replicas must be a positive integer; received num_replicas={value!r} "
        rf"\({type(value).__name__}\)\. Fix: {fix}",
    ):
        wb.replicator(backend, num_replicas=value)


def test_backend_classes_check_replica_counts_under_the_names_typed():
    from workbench._src.backends.mirrored import MultiGpuReplicator

    with pytest.raises(wb.ConfigurationError, match=r"received num_replicas=0 \(int\)\. Fix: num_replicas=2"):
        MultiGpuReplicator.from_replicas(0)
    with pytest.raises(wb.ConfigurationError, match=r"received num_gpus='4' \(str\)"):
        wb.MultiGpuReplicator(num_gpus="4")


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            "{'cluster': {}}",
            r"TF_CONFIG is not valid JSON \(Expecting property name enclosed in double quotes",
        ),
        ('{"cluster": {"worker": ["localhost:1"]}', r"TF_CONFIG is not valid JSON \(Expecting"),
        ('{"task": {"type": "worker", "index": 0}}', r"has no 'cluster' object"),
        ('{"cluster": {"worker": "a:1,b:2"}, "task": {"type": "worker", "index": 0}}', r"not a list of"),
        (
            '{"cluster": {"worker": ["a:1", "b"]}, "task": {"type": "worker", "index": 0}}',
            r"'b' .* not 'host:port'",
        ),
        ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}', r"task type 'chief'"),
        (
            '{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 2}}',
            r"index 2, .* has 2",
        ),
    ],
)
def test_malformed_tf_config(monkeypatch, raw, message):
    monkeypatch.setenv("TF_CONFIG", raw)
    with pytest.raises(
        wb.ConfigurationError, match=rf"(?s){message}.*received .*Fix: .*\"cluster\": \{{\"worker\""
    ):
        wb.MultiWorkerReplicator(cluster="TF_CONFIG")


def _resolver(ports, index):
    spec = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{p}" for p in ports]})
    return tf.distribute.cluster_resolver.SimpleClusterResolver(spec, task_type="worker", task_id=index)


def test_a_peer_that_never_starts_raises_instead_of_killing_the_caller():
    import time

    from workbench._src.backends.join_watchdog import wait_for_peers

    ports = free_ports(2)
    start = time.monotonic()
    with pytest.raises(
        wb.WorkerError,
        match=rf"(?s)\(worker 0\) waited startup_timeout=1 s .* 1 of 1 never accepted a connection: worker 1 at "
        rf"127\.0\.0\.1:{ports[1]}\..*still usable.*Fix: start the same program on every host",
    ) as caught:
        wait_for_peers(_resolver(ports, 0), timeout=1.0)
    assert caught.value.task == "worker 1"
    assert time.monotonic() - start < 5


def test_peers_waiting_for_each_other_all_go_on():
    # Every task runs the same code: each holds its own port while it waits, so none deadlocks;
    # once a task goes on, "TensorFlow's server" (a listener here) binds the port it released.
    import threading

    from workbench._src.backends.join_watchdog import wait_for_peers

    ports = free_ports(3)
    results, servers, all_done = {}, [], threading.Event()

    def task(i):
        try:
            results[i] = wait_for_peers(_resolver(ports, i), timeout=20)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            results[i] = e
            return
        # TensorFlow's server binds the port released (it answers the probe as a peer too)
        spec = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{p}" for p in ports]})
        servers.append(tf.distribute.Server(spec, job_name="worker", task_index=i, start=True))
        all_done.wait(30)

    threads = [threading.Thread(target=task, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    while len(results) < 3 and any(thread.is_alive() for thread in threads):
        threading.Event().wait(0.05)
    all_done.set()
    for thread in threads:
        thread.join(30)
    assert all(isinstance(results.get(i), float) for i in range(3)), results


def test_a_port_held_by_something_that_is_not_a_peer_is_named_within_the_timeout():
    # A stale process or another program on a peer's port accepts TCP: it must not pass for a
    # peer, or TensorFlow's join would wait for it forever.
    import socket
    import time

    from workbench._src.backends.join_watchdog import wait_for_peers
    from workbench._src.backends.peer_probe import NOT_A_PEER, PEER, UNREACHABLE, probe

    ports = free_ports(2)
    impostor = socket.socket()
    impostor.bind(("127.0.0.1", ports[1]))
    impostor.listen(8)  # accepts (the kernel completes the handshake) and never says anything
    try:
        assert probe(f"127.0.0.1:{ports[1]}", timeout=0.5) == NOT_A_PEER
        start = time.monotonic()
        with pytest.raises(
            wb.WorkerError,
            match=rf"(?s)1 of 1 accepted a connection but did not answer as a TensorFlow peer: worker 1 at "
            rf"127\.0\.0\.1:{ports[1]} \(another program, or a stale or frozen process, holds that port\)"
            r".*Fix: end what holds the port",
        ):
            wait_for_peers(_resolver(ports, 0), timeout=2.0)
        assert time.monotonic() - start < 2.0 + 3
    finally:
        impostor.close()
    assert probe(f"127.0.0.1:{ports[1]}", timeout=0.5) == UNREACHABLE
    spec = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{ports[1]}"]})
    tf.distribute.Server(spec, job_name="worker", task_index=0, start=True)
    assert probe(f"127.0.0.1:{ports[1]}", timeout=2.0) == PEER  # a real TensorFlow server (gRPC)


@pytest.mark.parametrize("run_id", ["../x", "../../etc", "a/b", "..", "/tmp/x"])
def test_load_run_refuses_ids_that_leave_the_runs_folder(tmp_path, run_id):
    runs = tmp_path / "runs"
    runs.mkdir()
    outside = tmp_path / "x"  # a folder that looks like a run, beside the runs folder
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    with pytest.raises(
        wb.ConfigurationError, match=r"A run id is the name of one folder.*received.*Fix: pick an id"
    ):
        wb.load_run(run_id, directory=runs)


def test_a_failing_sink_is_named_in_a_sentence_and_training_goes_on():
    class Broken:
        sink_name = "the broken plot"

        def send(self, event):
            if event.kind == "metrics":
                raise ValueError("no canvas")

    def plain_function_sink(event):
        if event.kind == "metrics":
            raise KeyError("x")

    repl = wb.NonReplicator()
    with repl.context():
        w = tf.Variable(1.0)
    run = repl.train(
        lambda x: {"loss": tf.reduce_sum(x) * w},
        lambda ctx: tf.data.Dataset.from_tensors(tf.ones([2])).repeat(),
        steps=20,
        sinks=[Broken(), plain_function_sink],
    )
    texts = [e.data["text"] for e in run.events if e.kind == "message"]
    assert run.status == "finished" and run.steps == 20
    assert (
        "the broken plot stopped receiving this run's events after an error (ValueError: no canvas); "
        "training goes on without it" in texts
    )
    assert any(t.startswith("the sink test_a_failing_sink") and "KeyError" in t for t in texts), texts
    assert not any("bound method" in t or "<function" in t for t in texts)
