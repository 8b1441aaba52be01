"""One snapshot of a run for every live view: computed once per refresh, kept on the Run.

Every live view of a run (the dashboard's header, progress bar and figure in its cell, the
JupyterLab sidebar and status bar) shows the same snapshot: the Run computes it at most every
REFRESH_SECONDS from its own rows, on the thread that records them, keeps it as `run.snapshot`,
and hands it to its sinks in the "metrics" event that made it (`event.data["snapshot"]`); the
"ended" event carries the final one, over the whole run (what run.summary() and the run store
say). Views that accumulated their own columns and computed the figures on their own clocks
showed, at one instant, steps 195, 300 and 12 for the same run (issue 41).

A snapshot is a plain dict (JSON-able: it goes into events.jsonl and over the lab comm as is):
  seq (1, 2, ... per run), time (epoch s when taken), final (the run has ended), steps,
  target_steps, wall_time_s, steps_per_sec, examples_per_sec, median_examples_per_sec,
  eta_seconds (run_stats.figures' keys and definitions), metrics {name: last value | None}.

While the run goes the figures are updated incrementally (LiveFigures): run_stats.figures over
the whole history sorts every per-step rate for the median and copies every column, 0.2 s at
100,000 steps, too much for the training thread twice a second. LiveFigures gives the same
numbers (tests/test_live_snapshot.py checks it against run_stats.figures).
"""

from __future__ import annotations

import bisect
import heapq
import math
import time

from workbench._src.core.run_stats import RESERVED, WINDOW_SECONDS, figures, round_rate

REFRESH_SECONDS = 0.5


class LiveFigures:
    """run_stats.figures(columns, running=True) kept up to date row by row."""

    def __init__(self):
        self.wall: list[float] = []
        self.examples: list[float] = []  # each row's examples (NaN where a row has none)
        self.first_timed: int | None = None
        self.last_metrics: dict = {}
        # The running median of the finite per-step rates: the lower half in a max-heap (values
        # negated), the upper half in a min-heap; the lower half holds the extra one.
        self._low: list[float] = []
        self._high: list[float] = []

    def add(self, rows: list[dict]) -> None:
        for row in rows:
            rate = _float(row.get("examples_per_sec"))
            if self.first_timed is None and math.isfinite(rate):
                self.first_timed = len(self.wall)
            self.wall.append(float(row["wall_time"]))
            self.examples.append(_float(row.get("examples")))
            if math.isfinite(rate):
                self._push_rate(rate)
        if rows:
            self.last_metrics = {k: _finite(v) for k, v in rows[-1].items() if k not in RESERVED}

    def reset(self, columns: dict) -> None:
        """Starts again from the run's columns (a healed run rewound its history)."""
        self.__init__()
        n = len(columns.get("wall_time", ()))
        names = list(columns)
        self.add([{k: columns[k][i] for k in names} for i in range(n)])

    def figures(self, target_steps: int | None) -> dict:
        """The same dict as run_stats.figures(columns, running=True, target_steps)."""
        wall, n = self.wall, len(self.wall)
        out = {
            "steps": n,
            "wall_time_s": round(wall[-1], 3) if n else None,
            "steps_per_sec": None,
            "examples_per_sec": None,
            "median_examples_per_sec": None,
            "eta_seconds": None,
        }
        if self.first_timed is None:
            return out
        first = self.first_timed
        start = max(first, bisect.bisect_right(wall, wall[-1] - WINDOW_SECONDS, lo=first))
        start = min(start, n - 1)
        t0 = wall[start - 1] if start > 0 else 0.0
        seconds, steps = wall[-1] - t0, n - start
        if steps <= 0 or seconds <= 0:
            return out
        out["steps_per_sec"] = round_rate(steps / seconds)
        counted = self.examples[start:n]
        if all(math.isfinite(v) for v in counted):
            out["examples_per_sec"] = round_rate(sum(counted) / seconds)
        median = self._median()
        if median is not None:
            out["median_examples_per_sec"] = round_rate(median)
        if target_steps is not None:
            out["eta_seconds"] = round(max(0, int(target_steps) - n) * seconds / steps, 1)
        return out

    def _push_rate(self, rate: float) -> None:
        if self._low and rate > -self._low[0]:
            heapq.heappush(self._high, rate)
        else:
            heapq.heappush(self._low, -rate)
        if len(self._low) > len(self._high) + 1:
            heapq.heappush(self._high, -heapq.heappop(self._low))
        elif len(self._high) > len(self._low):
            heapq.heappush(self._low, -heapq.heappop(self._high))

    def _median(self) -> float | None:
        if not self._low:
            return None
        if len(self._low) > len(self._high):
            return -self._low[0]
        return (-self._low[0] + self._high[0]) / 2


def make_snapshot(seq: int, fig: dict, target_steps, metrics: dict, final: bool) -> dict:
    return {
        "seq": seq,
        "time": time.time(),
        "final": final,
        **fig,
        "target_steps": target_steps,
        "metrics": dict(metrics),
    }


def final_figures(columns: dict, target_steps) -> dict:
    """The ended run's figures, over the whole run (run_stats' definition, computed once)."""
    return figures(columns, running=False, target_steps=target_steps)


def _float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _finite(value) -> float | None:
    value = _float(value)
    return value if math.isfinite(value) else None


class Keeper:
    """A run's snapshot (`current`), refreshed at most every REFRESH_SECONDS as rows come in.

    The Run calls it under its lock, with the rows it has just recorded: a snapshot never counts
    rows that its history does not hold yet.
    """

    def __init__(self):
        self.current: dict | None = None
        self._figures = LiveFigures()
        self._taken = -math.inf  # (monotonic)

    def add(self, rows: list[dict], target_steps) -> dict | None:
        """Counts `rows`; returns a new snapshot when one is due, else None."""
        self._figures.add(rows)
        if time.monotonic() - self._taken < REFRESH_SECONDS:
            return None
        return self._take(self._figures.figures(target_steps), target_steps, final=False)

    def rewind(self, columns: dict, target_steps) -> dict:
        """A healed run's history was rewound: a snapshot of what is left, at once."""
        self._figures.reset(columns)
        return self._take(self._figures.figures(target_steps), target_steps, final=False)

    def end(self, columns: dict, target_steps) -> dict:
        """The final snapshot: the figures over the whole run."""
        return self._take(final_figures(columns, target_steps), target_steps, final=True)

    def _take(self, fig: dict, target_steps, final: bool) -> dict:
        self._taken = time.monotonic()
        seq = (self.current or {}).get("seq", 0) + 1
        self.current = make_snapshot(seq, fig, target_steps, self._figures.last_metrics, final)
        return self.current


def shown(columns: dict, snapshot: dict | None, status: str, final: bool, target_steps) -> tuple[dict, dict]:
    """What a view of a run's history shows: (columns, figures).

    With a snapshot, its figures, and the columns cut at its step: the view's figure and its
    metrics are never ahead of the numbers beside them. Without one (a sink fed events by hand,
    or before the first snapshot), the figures of the columns themselves.
    """
    if snapshot is not None:
        n = snapshot["steps"]
        return {k: v[:n] for k, v in columns.items()}, snapshot
    running = not final and status == "running"
    return columns, figures(columns, running=running, target_steps=target_steps)


# What a run that has started but has no step yet is doing, when it has said nothing else: the
# first call of step_fn traces and compiles it (seconds, a minute for a large model).
COMPILING = "compiling step_fn (its first call traces it) and running the first steps"


def doing_now(message: str | None, snapshot: dict | None, status: str) -> str | None:
    """The line every live view shows under a run's numbers (the cell's header, the sidebar's
    card): before step 1, what the run is doing now (its last "message" event: starting N
    processes, starting Ray, placing actors, the processes ready; else compiling step_fn); from
    step 1 on, the last thing it said (a lost worker, a checkpoint), if anything."""
    if status != "running" or (snapshot or {}).get("steps"):
        return message
    if not message:
        return COMPILING
    if " ready in " in message:  # the processes (or the warm pool) are up: step_fn is traced next
        return f"{message}; {COMPILING}"
    return message


def before_the_run() -> str:
    """The dashboard's first line, shown before the run exists (the replicator being built)."""
    import sys

    if "tensorflow" not in sys.modules:
        return "starting the run: importing TensorFlow and building the replicator"
    return "starting the run: building the replicator"
