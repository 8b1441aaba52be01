"""`%replicate --tensorboard [RUN]`: opens TensorBoard on the event files the run store writes.

The run store already writes `<runs dir>/<run id>/tb/` for every recorded run; this points
IPython's `%tensorboard` (from the tensorboard package) at one run's folder, or at the whole
runs directory (`all`) so TensorBoard overlays every run.
"""

from __future__ import annotations

from pathlib import Path

from workbench._src.core.errors import ConfigurationError
from workbench._src.sinks import runstore
from workbench._src.store import runhistory


def logdir_for(which: str | None) -> Path:
    """The event-file folder of run `which` (an id, 'latest', or 'all' for every run)."""

    if which in (None, "", "all"):
        return runstore.runs_dir()
    rec = runhistory.load_run(-1 if which == "latest" else which)
    return rec.path / runstore.TENSORBOARD


def open_tensorboard(shell, which: str | None) -> Path:
    """Runs `%load_ext tensorboard` and `%tensorboard --logdir <folder>` in `shell`."""
    from IPython.core.error import UsageError

    try:
        logdir = logdir_for(which)
    except ConfigurationError as e:
        raise UsageError(str(e)) from None
    if not logdir.exists():
        raise UsageError(
            f"No TensorBoard event files at {logdir} (run {which!r}): they are written when a "
            "recorded run ends. Fix: wait for the run to end, or pick an id from wb.runs()."
        )
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise UsageError(
            f"TensorBoard is not installed in this kernel's environment; the event files are in "
            f"{logdir}. Fix: `pip install tensorboard` (then run this again), or from a terminal "
            f"`tensorboard --logdir {logdir}`."
        ) from None
    shell.run_line_magic("load_ext", "tensorboard")
    shell.run_line_magic("tensorboard", f'--logdir "{logdir}"')
    return logdir
