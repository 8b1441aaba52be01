"""Elastic worker counts for sync runs (issue 40, item 3): `min_workers`.

A pool the Ray cluster has no room for is launched with fewer workers, keeping the global batch,
so the weights stay those of one device on it; a heal that cannot replace a lost member goes on
with fewer; a run on fewer workers grows back at a checkpoint once room returns. Nothing is
mocked: the lack of room is Ray's own (a one-node instance cannot place two workers one per
node; a node removed from a multi-node cluster on this machine takes its worker with it). Each
test starts its own Ray processes and ends them by their handles (never `ray stop`).
"""

import cloudpickle
import pytest
import toy_models
from helpers import assert_same_checkpoints, wait_for, wait_for_steps
from toy_models import gated_mlp_setup, mlp_setup

import workbench as wb
from workbench._src.core.run_stats import heal_line

pytest.importorskip("ray", reason='Ray is an optional extra: pip install -e ".[ray,test]"')
cloudpickle.register_pickle_by_value(toy_models)  # setup= travels to the Ray actors


def _messages(run, words: str) -> list[str]:
    return [e.data["text"] for e in run.events if e.kind == "message" and words in e.data.get("text", "")]


def _story(run) -> str:
    """What a failed elastic run went through: its restarts, checkpoints and messages, in order,
    and the global steps of its history where they do not follow on from the row before."""
    lines = [f"{e.kind} at {e.step}: {e.data.get('text') or e.data.get('path') or e.data}"
             for e in run.events if e.kind in ("restart", "checkpoint", "message")]  # fmt: skip
    g = run.history["global_step"].tolist()
    jumps = [(i + 1, a, b) for i, (a, b) in enumerate(zip(g, g[1:])) if b != a + 1]
    return "\n".join(lines + [f"history rows {len(g)}; global_step jumps (row, from, to): {jumps}"])


def _one_device(folder, steps: int) -> None:
    """The reference: one device on the global batch, saved at the same steps."""
    wb.replicator("single").train(setup=mlp_setup, steps=steps, checkpoint_dir=folder, checkpoint_every=25)


def test_min_workers_is_checked_where_it_is_given():
    with pytest.raises(wb.ConfigurationError, match="cannot exceed num_workers"):
        wb.MultiWorkerReplicator(num_workers=2, min_workers=3)
    with pytest.raises(wb.ConfigurationError, match="min_workers must be a positive integer"):
        wb.MultiWorkerReplicator(num_workers=2, min_workers=0)
    with pytest.raises(wb.ConfigurationError, match="synchronous multi-worker runs"):
        wb.MultiWorkerAsyncReplicator(num_workers=2, min_workers=1)
    with pytest.raises(wb.ConfigurationError, match="its own scheduler restarts"):
        wb.MultiWorkerReplicator(
            num_workers=2,
            min_workers=1,
            cluster={"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}},
        )
    repl = wb.MultiWorkerReplicator(num_workers=2, min_workers=1)
    with pytest.raises(wb.ConfigurationError, match="max_restarts=0, so it never heals"):
        repl.train(setup=mlp_setup, steps=3)
    from workbench._src.core import registry

    with pytest.raises(wb.ConfigurationError, match="--min-workers .* multi-worker"):
        registry.check_counts(registry.spec("async-ps"), num_workers=2, min_workers=1)
    with pytest.raises(wb.ConfigurationError, match="--workers 2 \\(the default\\), --min-workers 3"):
        registry.check_counts(registry.spec("multi-worker"), min_workers=3)


def test_the_heal_line_says_how_many_workers_it_went_on_with():
    record = {"member": "worker 1", "cause": "its node died", "step": 100, "seconds": 31.24, "lost_at": 120}
    assert heal_line({**record, "workers": 1, "of_workers": 2}, [record]) == (
        "worker 1 lost (its node died) at step 120: restarted from step 100, 31.2 s, "
        "continued on 1 of 2 workers (restart 1)"
    )
    assert "continued" not in heal_line({**record, "workers": 2, "of_workers": 2}, [record])


@pytest.mark.slow
def test_a_pool_one_node_cannot_place_starts_on_fewer_workers_and_equals_one_device(tmp_path):
    # spread: one worker per node; a local Ray instance is one node, so 2 workers never fit.
    cluster = wb.RayCluster(address=None, resources_per_worker={"CPU": 1}, placement="spread")
    try:
        repl = wb.MultiWorkerReplicator(num_workers=2, min_workers=1, cluster=cluster)
        run = repl.train(
            setup=mlp_setup, steps=100, checkpoint_dir=tmp_path / "elastic", checkpoint_every=25,
            max_restarts=1, steps_per_execution=5,
        )  # fmt: skip
        assert run.status == "finished", run.stop_reason
        assert run.history["step"].tolist() == list(range(1, 101))
        assert run.restarts == []  # no member was lost: a start on fewer workers is no heal
        assert [p["role"] for p in run.processes] == ["worker"]
        [said] = _messages(run, "going on with")
        assert "cannot place this multi-worker pool" in said and "1 of 2 workers (min_workers=1)" in said
        assert not _messages(run, "growing back")  # the probe at each checkpoint found no room
        repl.shutdown()
    finally:
        cluster.shutdown()
    _one_device(tmp_path / "one", 100)
    assert_same_checkpoints(tmp_path / "elastic", tmp_path / "one", atol=1e-5)


def _two_ray_nodes():
    """A Ray cluster of two nodes of this machine's own (ray.cluster_utils: a head and a second
    node, 1 CPU each), and the second node. Tried twice: Ray gives a raylet a fixed 30 s to
    register, which a loaded machine can miss (NOTES.md); a failed try's nodes are ended."""
    from ray.cluster_utils import Cluster

    for attempt in (1, 2):
        nodes = Cluster()
        try:
            nodes.add_node(num_cpus=1)  # (the first is the head)
            return nodes, nodes.add_node(num_cpus=1)
        except Exception as error:
            nodes.shutdown()
            if attempt == 2 or "timed out during startup" not in str(error):
                raise


@pytest.mark.slow
def test_a_lost_node_heals_on_fewer_workers_and_grows_back_when_a_node_joins(tmp_path, monkeypatch):
    import shutil
    import tempfile

    import ray

    # Ray's files (sessions, the address file) in a folder of this test's own, not the machine's
    # /tmp/ray; short, as its Unix socket paths must stay under 108 bytes.
    root = tempfile.mkdtemp(prefix="wbray", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", root)
    try:
        nodes, second = _two_ray_nodes()
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    try:
        cluster = wb.RayCluster(address=nodes.address, resources_per_worker={"CPU": 1}, placement="spread")
        repl = wb.MultiWorkerReplicator(num_workers=2, min_workers=1, cluster=cluster, startup_timeout=90)
        flag = tmp_path / "hold"  # while it exists each step waits: the run cannot end before it grows
        run = repl.train(
            setup=gated_mlp_setup(str(flag)), steps=400, checkpoint_dir=tmp_path / "elastic",
            checkpoint_every=25, max_restarts=1, background=True, steps_per_execution=5,
        )  # fmt: skip
        wait_for_steps(run, 120)
        flag.touch()
        nodes.remove_node(second)  # the node and the worker on it are gone; the other node is full
        wait_for(lambda: run.restarts and run.restarts[0].get("workers"), 300, "the heal on fewer workers")
        assert run.restarts[0]["workers"] == 1 and run.restarts[0]["of_workers"] == 2
        print("heal:", run.restarts[0])  # (pytest -rP shows it: the heal's seconds)
        assert _messages(run, "continued on 1 of 2 workers")
        nodes.add_node(num_cpus=1)  # room again: the run grows back at a checkpoint
        wait_for(lambda: _messages(run, "growing back"), 300, "the run growing back")
        flag.unlink()
        run.wait(600)
        assert run.status == "finished", run.stop_reason
        assert run.history["step"].tolist() == list(range(1, 401)), _story(run)  # each step once
        assert len(run.restarts) == 1  # growing back is no heal
        assert _messages(run, "growing back from 1 to 2 workers")
        assert [p["role"] for p in run.processes] == ["worker", "worker"]
        repl.shutdown()
    finally:
        ray.shutdown()
        nodes.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    _one_device(tmp_path / "one", 400)
    assert_same_checkpoints(tmp_path / "elastic", tmp_path / "one", atol=1e-5)


def _per_replica_weights(replicas: int, shape: str, data) -> list:
    """50 steps of a linear model on `replicas` mirrored replicas, PER_REPLICA input of `shape`."""
    import keras
    import numpy as np
    import tensorflow as tf

    x, _ = data
    y = x @ np.linspace(-1, 1, x.shape[1], dtype="float32")[:, None]
    repl = wb.replicator("mirrored", num_replicas=replicas, input_replication=wb.InputReplication.PER_REPLICA)
    with repl.context():
        model = keras.Sequential(
            [keras.Input((x.shape[1],)), keras.layers.Dense(1, kernel_initializer="zeros")]
        )
        optimizer = repl.wrap_optimizer(keras.optimizers.SGD(0.05))

    def input_fn(ctx):
        shard = tf.data.Dataset.from_tensor_slices((x, y)).repeat().shard(ctx.num_replicas, ctx.replica_id)
        return (
            shard.batch(32 // ctx.num_replicas)
            if shape == "global batch over the replicas"
            else shard.batch(16)
        )

    def step_fn(features, targets):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(features) - targets) ** 2)
        optimizer.minimize(loss, model.trainable_variables, tape=tape)
        return {"loss": loss}

    repl.train(step_fn, input_fn, steps=50)
    return model.get_weights()


def test_the_per_replica_pipeline_shape_that_stays_exact_when_the_count_changes(data):
    # shard(n, i).batch(GLOBAL // n): step k's replicas take examples k*GLOBAL .. (k+1)*GLOBAL - 1
    # between them on any count (what README and launch/elastic.py document); a fixed per-replica
    # batch makes the global batch change with the count.
    import numpy as np

    def largest_difference(shape):
        one, two = (_per_replica_weights(n, shape, data) for n in (1, 2))
        return max(float(np.max(np.abs(a - b))) for a, b in zip(one, two))

    assert largest_difference("global batch over the replicas") < 1e-6
    assert largest_difference("fixed per-replica batch") > 1e-4


def test_min_workers_reaches_the_replicator_from_the_magic_and_the_command_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from workbench._src.core import current
    from workbench._src.notebook import session

    before = current.current_or_none(), current.current_choice()
    try:
        repl = session.choose("multi-worker", num_workers=3, min_workers=2)  # what %replicate does
    finally:
        current.set_current(*before)  # (the session's replicator, for the tests after this one)
    assert (repl.plan.num_workers, repl.plan.min_workers) == (3, 2)
    assert repl.plan.shape() == wb.MultiWorkerReplicator(num_workers=3).plan.shape()  # (no new pool shape)
    example = Path(__file__).resolve().parent.parent / "examples" / "train.py"
    wrong = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "run", str(example), "--backend", "async-ps", "--min-workers", "1",
         "--steps", "3"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert wrong.returncode == 2, wrong.stderr
    assert "--min-workers (elastic worker counts) applies to synchronous runs" in wrong.stderr
