"""NaN and Inf in a run's metrics: where the history ends, and what the run says."""

from __future__ import annotations

import warnings

import numpy as np


def rows_until_nonfinite(rows: np.ndarray) -> int:
    """How many rows to record: up to and including the first with a NaN/Inf metric."""
    bad = ~np.isfinite(rows[:, :-1]).all(axis=1)
    return int(np.argmax(bad)) + 1 if bad.any() else len(rows)


def first_nonfinite(rows: np.ndarray, first_step: int, names, on_nonfinite: str, checkpoint_kept: bool):
    """The message for the first NaN/Inf metric in `rows` (steps x metrics + batch), else None;
    also warned when on_nonfinite="stop"."""
    values = rows[:, :-1]
    bad = ~np.isfinite(values)
    if not bad.any():
        return None
    i, j = map(int, np.argwhere(bad)[0])
    metric = (names or ["?"])[j]
    message = (
        f"Training stopped at step {first_step + i}: metric {metric!r} is {values[i, j]} "
        f"(last finite value at step {first_step + i - 1}). Common causes: a learning rate "
        "too high, a log/division of zero, or the loss summed instead of averaged. The "
        "history up to that step is in run.history"
        + ("; the last checkpoint before it is kept." if checkpoint_kept else ".")
    )
    if on_nonfinite == "stop":
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    return message
