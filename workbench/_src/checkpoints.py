"""Checkpoints of a run: what is saved, where, and how it is restored.

`Saver` is the run loop's tf.train.CheckpointManager over the run's trackables plus the exact
step count; `restore_latest` is `Replicator.restore`.
"""

from __future__ import annotations

import os

from workbench._src.errors import ConfigurationError
from workbench._src.tf_setup import tf


class Saver:
    """tf.train.CheckpointManager over the run's trackables plus the exact step count."""

    def __init__(self, replicator, program, directory, items):
        t = tf()
        self.directory = os.fspath(directory)
        # Under multi-worker every worker saves (the save is collective) but only the chief's
        # copy is kept; every worker restores from the chief's directory.
        write_directory = replicator._checkpoint_write_directory(self.directory)
        self.program = program
        if items is None:
            items = {"variables": list(replicator._created_variables)}
        if isinstance(items, dict):
            items = t.train.Checkpoint(**items)
        self.step = t.Variable(0, dtype=t.int64, trainable=False)
        self.checkpoint = items
        self.step_checkpoint = t.train.Checkpoint(run=items, step=self.step)
        self.manager = t.train.CheckpointManager(self.step_checkpoint, write_directory, max_to_keep=3)

    def restore_if_any(self) -> int | None:
        latest = tf().train.latest_checkpoint(self.directory)
        if self.program.steps_done or not latest:
            return None
        self.step_checkpoint.restore(latest)
        self.program.steps_done = int(self.step.numpy())
        return self.program.steps_done

    def save(self) -> str | None:
        if self.manager.latest_checkpoint and self.step.numpy() == self.program.steps_done:
            return None  # nothing new since the last save
        self.step.assign(self.program.steps_done)
        return self.manager.save(checkpoint_number=self.program.steps_done)


def restore_latest(replicator, directory, items=None) -> int:
    """`Replicator.restore`: the latest checkpoint in `directory` into `items` (default: the
    variables created in repl.context()); returns the step it was saved at."""
    t = tf()
    directory = os.fspath(directory)
    latest = t.train.latest_checkpoint(directory)
    if not latest:
        raise ConfigurationError(
            f"No checkpoint to restore in {directory!r}. Fix: give the folder that "
            "train(checkpoint_dir=...) wrote (it holds a 'checkpoint' file and ckpt-N files)."
        )
    if items is None:
        if not replicator._created_variables:
            raise ConfigurationError(
                "Nothing to restore into: no variable was created in this replicator's context. "
                "Fix: build the model (and optimizer) in `with repl.context():` first, as the run "
                "that saved the checkpoint did, or pass checkpoint={'model': model, ...}."
            )
        items = {"variables": list(replicator._created_variables)}
    if isinstance(items, dict):
        items = t.train.Checkpoint(**items)
    step = t.Variable(0, dtype=t.int64, trainable=False)
    try:
        status = t.train.Checkpoint(run=items, step=step).restore(latest)
        status.expect_partial()  # e.g. an evaluation model without the optimizer's slots
        status.assert_existing_objects_matched()
    except (AssertionError, ValueError) as e:  # ValueError: a variable of another shape
        raise ConfigurationError(
            f"The checkpoint {latest} does not match the variables built here: "
            f"{str(e).rstrip('.')}. Fix: build "
            "the model the same way as the run that saved it (same layers, same order)."
        ) from None
    return int(step.numpy())
