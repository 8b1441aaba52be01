"""`workbench` CLI loose ends (issue 41): the progress line's figures are the summary's, every
option's help says what it does and its default, and a long command says what it is doing."""

import contextlib
import io
import re
import subprocess
import sys

import pytest

from workbench._src.core.run import Event
from workbench._src.core.run_stats import describe, figures
from workbench._src.sinks.progress import ProgressPrinter


def _async_ps_rows(steps: int = 200, step_seconds: float = 0.01, workers: int = 2):
    """Rows as an async-ps run relays them: each worker takes `step_seconds` a step and reports
    its own examples/s; with two workers, rows arrive twice as often as one worker steps."""
    rows, done = [], [0.0] * workers
    for i in range(steps):
        w = i % workers
        done[w] += step_seconds
        rows.append({"step": i + 1, "wall_time": round(done[w] + w * step_seconds / workers, 6),
                     "examples_per_sec": 128 / step_seconds, "examples": 128, "loss": 1.0})  # fmt: skip
    rows.sort(key=lambda r: r["wall_time"])
    return rows


def test_the_final_progress_line_says_the_summarys_examples_per_second():
    rows = _async_ps_rows()
    printer = ProgressPrinter(len(rows))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for start in range(0, len(rows), 20):
            printer(Event("metrics", "r", 0.0, start, {"rows": rows[start : start + 20]}))
    last = out.getvalue().strip().splitlines()[-1]
    history = {k: [r[k] for r in rows] for k in ("wall_time", "examples_per_sec", "examples")}
    summary = figures(history, running=False, target_steps=len(rows))
    assert last.endswith(describe(summary)), (last, summary)
    assert summary["examples_per_sec"] == pytest.approx(summary["steps_per_sec"] * 128, rel=1e-3)
    assert " examples 128" not in last  # bookkeeping columns are not metrics
