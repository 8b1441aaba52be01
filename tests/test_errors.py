"""Bad input gets a clear error: what was wrong, what was received, how to fix it."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import workbench as wb


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


def test_bad_train_options():
    repl = wb.replicator("single")
    with pytest.raises(
        wb.ConfigurationError,
        match=r"(?s)steps_per_execution must be a positive integer or 'auto'; received 0",
    ):
        repl.train(lambda b: {}, batches(), steps=1, steps_per_execution=0)
    with pytest.raises(
        wb.ConfigurationError, match=r"(?s)reduce\['loss'\] must be 'mean' or 'sum'; received 'max'"
    ):
        repl.train(lambda b: {}, batches(), steps=1, reduce={"loss": "max"})
