"""The files of a checkpoint folder as tf.train.CheckpointManager keeps them (`ckpt-N` prefixes,
the last few kept, the `checkpoint` state file), and finding the checkpoint of a step."""

from __future__ import annotations

import os

from workbench._src.core.errors import ConfigurationError
from workbench._src.core.tf_setup import tf


class CheckpointFiles:
    """The files of a checkpoint folder, as tf.train.CheckpointManager keeps them: `ckpt-N`
    prefixes, the last MAX_TO_KEEP kept, and the `checkpoint` state file that
    tf.train.latest_checkpoint reads (relative paths: the folder can be moved)."""

    MAX_TO_KEEP = 3
    STATE_FILE = "checkpoint"

    def __init__(self, directory: str):
        self.directory = directory
        state = tf().train.get_checkpoint_state(directory)  # (a run that resumes here keeps these)
        self.kept = list(state.all_model_checkpoint_paths) if state is not None else []
        self.latest: str | None = None

    def path(self, number: int) -> str:
        return os.path.join(self.directory, f"ckpt-{number}")

    def saved(self, path: str) -> None:
        gfile = tf().io.gfile
        self.kept = [p for p in self.kept if os.path.basename(p) != os.path.basename(path)] + [path]
        for old in self.kept[: -self.MAX_TO_KEEP]:
            for file in gfile.glob(f"{old}.*"):
                gfile.remove(file)
        self.kept = self.kept[-self.MAX_TO_KEEP :]
        lines = [f'model_checkpoint_path: "{os.path.basename(path)}"']
        lines += [f'all_model_checkpoint_paths: "{os.path.basename(p)}"' for p in self.kept]
        state = os.path.join(self.directory, self.STATE_FILE)
        with gfile.GFile(state + ".tmp", "w") as f:
            f.write("\n".join(lines) + "\n")
        gfile.rename(state + ".tmp", state, overwrite=True)  # readers never see half a file
        self.latest = path


def checkpoint_of_step(directory: str, step: int) -> str:
    """`directory`/ckpt-<step> (what `resume=step` restores), or a ConfigurationError saying which
    steps are there."""
    path = os.path.join(directory, f"ckpt-{step}")
    if tf().io.gfile.exists(path + ".index"):
        return path
    state = tf().train.get_checkpoint_state(directory)
    there = sorted(
        (os.path.basename(p) for p in (state.all_model_checkpoint_paths if state else ())),
        key=lambda name: int(name.rsplit("-", 1)[1]) if name.rsplit("-", 1)[-1].isdigit() else -1,
    )
    raise ConfigurationError(
        f"resume={step} names no checkpoint in {directory}: there is no ckpt-{step} there (it holds "
        f"{', '.join(there) or 'no checkpoint'}; the last {CheckpointFiles.MAX_TO_KEEP} are kept). "
        "Fix: resume= one of those steps, or resume=True for the latest."
    )
