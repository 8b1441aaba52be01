"""Adding a backend is one module and one registry entry: this file is both, for a toy backend
(two replicas on a fixed pair of virtual CPUs), and the rest of the workbench takes it as it is:
wb.replicator, the conformance checks, the magic, the panel (docs/design-decisions.md)."""

import numpy as np
import pytest

import workbench as wb
from workbench._src.core import registry
from workbench._src.core.replicator import Replicator
from workbench._src.core.tf_setup import tf


class PairReplicator(Replicator):
    """Two synchronous replicas on the first two CPU devices."""

    backend = "pair"

    def _make_strategy(self):
        t = tf()
        return t.distribute.MirroredStrategy(
            ["/cpu:0", "/cpu:1"], cross_device_ops=t.distribute.ReductionToOneDevice()
        )


@pytest.fixture
def pair():
    registry.register(registry.BackendSpec("pair", f"{__name__}:PairReplicator", "two CPUs (a toy)"))
    yield
    registry.unregister("pair")


def test_the_toy_backend_is_a_backend_everywhere(pair):
    repl = wb.replicator("Pair")
    assert repl.num_replicas == 2 and repl.describe() == {"backend": "pair", "num_replicas": 2}
    with repl.context():
        w = tf().Variable(1.0)

    def input_fn(ctx):
        return tf().data.Dataset.from_tensors(tf().ones([4])).repeat()

    def step_fn(x):
        return {"total": repl.all_sum(tf().reduce_sum(x) * w), "rid": repl.replica_id}

    outputs = repl.run(step_fn, input_fn)
    assert [float(o["total"]) for o in outputs] == [4.0, 4.0]
    run = repl.train(step_fn, input_fn, steps=5)
    assert run.status == "finished" and run.config["backend"] == "pair"
    np.testing.assert_allclose(run.history["total"], 4.0)
    with pytest.raises(wb.ConfigurationError, match="chooses its own replica count"):
        wb.replicator("pair", num_replicas=3)


def test_the_magic_and_the_panel_offer_the_toy_backend(pair):
    from workbench._src.notebook import session
    from workbench._src.notebook.panel import Panel

    try:
        assert wb.use("pair").backend == "pair"
        panel = Panel(namespace={})
        assert panel.backend == "pair" and "pair" in panel._backend_buttons
        assert panel._replicas.disabled and panel._workers.disabled and panel._ps.disabled
        assert "--backend pair" in panel.magic_line
    finally:
        session.reset()


def test_an_unknown_backend_lists_the_registered_ones(pair):
    with pytest.raises(
        wb.ConfigurationError, match=r"(?s)Unknown replicator backend 'pear'.*'pair' +two CPUs"
    ):
        wb.replicator("pear")
