"""Resuming a run where its checkpoint left it: the input's position and the run's goal.

A checkpoint holds the variables and the step count; to make a resumed run *the run it
continues*, it also holds (under the reserved name `workbench`):
  input_position  batches the run's input had given when it was saved (one per step, warm-up
                  and `repl.run` steps included). A resumed run re-opens input_fn's pipeline and
                  skips that many batches (tf.data's `skip`, before the split across replicas), so
                  step N+1 sees the batch it would have seen uninterrupted.
  goal_step       the step the saving run was asked to reach, while it had not reached it (a
                  periodic save, a preemption, a failure); 0 once it finished or a user stopped
                  it. With asked_steps, a resumed run given the same `steps` finishes that run
                  (trains only the missing steps) instead of training `steps` more.
  asked_steps     the `steps` that run was given.

Why a fast-forward and not TensorFlow's iterator checkpoint: tf.train.Checkpoint saves a plain
tf.data iterator's position, but tf.distribute's distributed iterators are not trackable (2.21:
"Checkpoint was expecting iterator to be a trackable object ... DistributedIterator"). A skip
re-reads the skipped batches (about 0.2 ms each for an in-memory pipeline) and reproduces them
exactly when the pipeline is deterministic; `pipeline_notes` says when it is not.
"""

from __future__ import annotations

from workbench._src import compat
from workbench._src.core.tf_setup import tf

STATE_NAME = "workbench"  # the checkpoint's top-level entry holding the run state

# Ops that make a pipeline's batches differ from one reading to the next.
_PYTHON_OPS = {"PyFunc", "PyFuncStateless", "EagerPyFunc", "GeneratorDataset"}
_SHUFFLE_OPS = ("ShuffleDataset", "ShuffleAndRepeatDataset")
_RANDOM_OPS = ("RandomUniform", "RandomStandardNormal", "RandomShuffle", "TruncatedNormal", "Multinomial")


class RunState:
    """The run state a checkpoint keeps beside the variables (three int64 scalars)."""

    def __init__(self):
        t = tf()
        self.input_position = t.Variable(0, dtype=t.int64, trainable=False)
        self.goal_step = t.Variable(0, dtype=t.int64, trainable=False)
        self.asked_steps = t.Variable(0, dtype=t.int64, trainable=False)
        self.trackable = t.train.Checkpoint(
            input_position=self.input_position, goal_step=self.goal_step, asked_steps=self.asked_steps
        )

    def set(self, input_position: int, goal_step: int = 0, asked_steps: int = 0) -> None:
        self.input_position.assign(input_position)
        self.goal_step.assign(goal_step)
        self.asked_steps.assign(asked_steps)

    def read(self) -> tuple[int, int, int]:
        return int(self.input_position.numpy()), int(self.goal_step.numpy()), int(self.asked_steps.numpy())


def steps_to_run(asked: int, restored_step: int, goal_step: int, saved_asked: int) -> tuple[int, str | None]:
    """How many steps a resumed run trains: the missing ones of an unfinished run given the same
    `steps` (the same command run again), else `asked` more. Returns (steps, what to say)."""
    if goal_step > restored_step and saved_asked == asked:
        left = goal_step - restored_step
        return left, (
            f"finishing the unfinished run of {asked} steps: {left} step(s) left, to step {goal_step} "
            f"(give another steps= to train that many more instead)"
        )
    return asked, None


def pipeline_notes(dataset, where: str = "input_fn") -> list[str]:
    """Why a fast-forward of `dataset` may not give the batches an uninterrupted run would have
    seen ([] when its pipeline is deterministic, as far as its graph tells)."""
    if getattr(dataset, "_workbench_from_callable", False):
        return [
            f"{where} returns a callable, not a dataset: a resumed run cannot skip what it already "
            "yielded, so it goes on with what it yields now"
        ]
    graph = compat.dataset_graph_def(dataset)
    if graph is None:
        return []
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    consts = {n.name: n for n in graph.node if n.op == "Const"}
    found = []
    for node in nodes:
        if node.op in _PYTHON_OPS:
            found.append(
                "it runs Python code (from_generator or py_function): a resumed run re-reads the "
                "skipped batches through it, exact only if it yields the same data every time"
            )
        elif node.op.startswith(_SHUFFLE_OPS) and _unseeded(node, consts):
            found.append(
                "it shuffles without a seed: a resumed run sees other batches than the uninterrupted "
                "run would. Fix: .shuffle(buffer, seed=0), or tf.random.set_seed(0) before input_fn runs"
            )
        elif (
            node.op.startswith(_RANDOM_OPS) and _attr_int(node, "seed") == 0 and _attr_int(node, "seed2") == 0
        ):
            found.append(
                "it draws unseeded random numbers (e.g. augmentation): a resumed run draws others. "
                "Fix: the tf.random.stateless_* ops, or tf.random.set_seed(0) before input_fn runs"
            )
    return [f"{where}'s pipeline cannot resume exactly: {text}" for text in dict.fromkeys(found)]


def _unseeded(node, consts: dict) -> bool:
    """A shuffle op whose seed inputs (its 3rd and 4th) are both constant zeros."""
    seeds = []
    for name in list(node.input)[2:4]:  # (input dataset, buffer size, seed, seed2, ...)
        const = consts.get(name.split(":")[0].lstrip("^"))
        if const is None:
            return False
        seeds.append(int(tf().make_ndarray(const.attr["value"].tensor)))
    return seeds == [0, 0]


def _attr_int(node, name: str) -> int | None:
    return node.attr[name].i if name in node.attr else None
