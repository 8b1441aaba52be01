"""A tiny regression problem as notebook cell source, shared by the notebook-integration tests."""

import contextlib

# What a user types in a %%replicate cell: build in repl.context(), define input_fn and step_fn.
TOY_CELL = """
import tensorflow as tf, keras
w = tf.Variable(tf.zeros([4, 1]))
opt = repl.wrap_optimizer(keras.optimizers.SGD(0.05))

def input_fn(ctx):
    x = tf.random.stateless_normal([64, 4], seed=[1, 2])
    y = x @ tf.constant([[1.0], [2.0], [3.0], [4.0]])
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)

def step_fn(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((x @ w - y) ** 2)
    opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
    return {"loss": loss}
"""


def define_toy(repl, namespace: dict) -> dict:
    """Runs TOY_CELL in repl.context() into `namespace` (what %%replicate does before training)."""
    namespace["repl"] = repl
    with repl.context():
        exec(TOY_CELL, namespace)
    return namespace


@contextlib.contextmanager
def isolated_notebook_state(runs_dir):
    """Runs recorded under runs_dir; session, run store and default sinks restored afterwards."""
    from workbench._src.notebook import session
    from workbench._src.sinks import _default_factories as SINK_FACTORIES
    from workbench._src.sinks import runstore

    factories = list(SINK_FACTORIES)
    override = runstore._override
    session.reset()
    runstore.set_runs_dir(runs_dir)
    try:
        yield
    finally:
        SINK_FACTORIES[:] = factories
        runstore._override = override
        session.reset()


def end_ipython_shell() -> None:
    """Runs the in-process shell's exit hook now, if the shell was started: it ends the history
    session and removes the temporary history file IPython's test shell writes. A test process
    may end by the reaper's early exit (os._exit), which would skip that hook."""
    import atexit

    from IPython.testing import globalipapp

    if getattr(globalipapp.start_ipython, "already_called", False):
        shell = globalipapp.get_ipython()
        atexit.unregister(shell.atexit_operations)
        shell.atexit_operations()


def ipython_shell():
    """The in-process IPython shell (started once per test process), with the extension loaded."""
    from IPython.testing.globalipapp import get_ipython, start_ipython

    from workbench._src.sinks import _default_factories as SINK_FACTORIES

    factories = list(SINK_FACTORIES)
    ip = start_ipython() or get_ipython()
    ip.run_line_magic("load_ext", "workbench")
    SINK_FACTORIES[:] = factories  # recording is turned on per test, by isolated_notebook_state
    return ip
