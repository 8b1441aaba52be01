"""The fused loop: the plain `tf.range` loop for infinite input, the checked loop for finite input."""

import pytest
import tensorflow as tf

import workbench as wb


def _op_types(program) -> set:
    """Every op type in the traced fused loop, including its while-loop body functions."""
    concrete = program._fused.get_concrete_function(program.iterator, tf.constant(3))
    graph_def = concrete.graph.as_graph_def()
    types = {node.op for node in graph_def.node}
    for function in graph_def.library.function:
        types |= {node.op for node in function.node_def}
    return types


def _counting(finite: bool):
    def input_fn(ctx):
        data = tf.data.Dataset.range(10).map(lambda i: tf.fill([2], tf.cast(i, tf.float32)))
        return data if finite else data.repeat()

    return input_fn


def step_fn(x):
    return {"x": tf.reduce_mean(x)}


def test_infinite_input_runs_the_plain_loop():
    repl = wb.replicator("mirrored", num_replicas=2)
    input_fn = _counting(finite=False)
    run = repl.train(step_fn, input_fn, steps=13, steps_per_execution=5)
    assert run.history["x"].tolist() == [float(i % 10) for i in range(13)]
    program = repl._program(step_fn, input_fn)
    assert program.infinite_input
    assert "OptionalHasValue" not in _op_types(program)


@pytest.mark.filterwarnings("ignore:.*input exhausted")
def test_finite_input_keeps_the_checked_loop_and_its_clean_end():
    repl = wb.replicator("mirrored", num_replicas=2)
    input_fn = _counting(finite=True)
    run = repl.train(step_fn, input_fn, steps=13, steps_per_execution=5)
    assert run.status == "finished" and run.history["x"].tolist() == [float(i) for i in range(10)]
    program = repl._program(step_fn, input_fn)
    assert not program.infinite_input
    assert "OptionalHasValue" in _op_types(program)
