"""The run's figures, defined and computed once: what every view shows as steps/s, examples/s, ETA.

Every place that shows a run's throughput (wb.Run.summary and its HTML, the dashboard's title and
progress bar, the JupyterLab sidebar and status bar, the run store's config.json and wb.runs(),
`workbench demo`, compare_runs) calls `figures(columns, running)` on the run's history and
formats with `fmt`, which is the TypeScript `formatNumber` of the extension, digit for digit.

Definitions (the history has one row per step: step, wall_time = seconds since the loop began,
at the end of that step; examples_per_sec = that step's batch / its chunk's time per step, NaN
for the first chunk of a new program, which traced and compiled):

- steps: rows recorded, i.e. steps counted from the run's own start (never a program's absolute
  step: a second run of the same model starts at step 1 again).
- steps_per_sec: timed steps / the wall-clock seconds they took, over the last WINDOW_SECONDS while
  the run goes, over every timed step once it has ended. Wall clock between chunk ends, so the
  loop's own overhead between compiled calls counts: this is the rate at which the run advances.
- examples_per_sec: the examples those same steps trained (the `examples` column: each step's
  global batch) / the same seconds, i.e. global batch x steps_per_sec, on every backend (async-ps
  included, where a step is one worker's batch). Histories written before that column existed
  read the batch back from the rows (examples_per_sec x the step's time).
- median_examples_per_sec: the median of the per-step examples_per_sec column: the speed of the
  compiled calls alone. Always labelled "median" where shown (figure panel).
- eta_seconds: steps still to go / steps_per_sec (None before the first timed chunk).
"""

from __future__ import annotations

import bisect
import math
import re

from workbench._src.core.tracebacks import plain

WINDOW_SECONDS = 10.0
# Columns that are bookkeeping, not metrics (never plotted or listed as a metric).
RESERVED = ("step", "wall_time", "examples_per_sec", "global_step", "examples")


def figures(columns, running: bool = False, target_steps: int | None = None) -> dict:
    """The run's figures from its history (a dict of columns, or a DataFrame).

    Args:
      columns: step, wall_time, examples_per_sec (and metrics) as lists, arrays or a DataFrame.
      running: the run still goes: rates over the last WINDOW_SECONDS (else over the whole run).
      target_steps: steps the run was asked for (for the ETA); None: open-ended.

    Returns:
      {"steps", "wall_time_s", "steps_per_sec", "examples_per_sec", "median_examples_per_sec",
       "eta_seconds"}; a rate is None until a timed chunk exists.
    """
    wall = _column(columns, "wall_time")
    eps = _column(columns, "examples_per_sec")
    n = len(wall)
    out: dict = {
        "steps": n,
        "wall_time_s": round(float(wall[-1]), 3) if n else None,
        "steps_per_sec": None,
        "examples_per_sec": None,
        "median_examples_per_sec": None,
        "eta_seconds": None,
    }
    first_timed = _first_timed(eps)
    if first_timed is None:
        return out
    # The span starts at the end of the row before first_timed (0: the loop's start).
    start = first_timed
    if running:
        start = max(first_timed, bisect.bisect_right(wall, float(wall[-1]) - WINDOW_SECONDS, lo=first_timed))
        start = min(start, n - 1)
    t0 = float(wall[start - 1]) if start > 0 else 0.0
    seconds = float(wall[-1]) - t0
    steps = n - start
    if steps <= 0 or seconds <= 0:
        return out
    out["steps_per_sec"] = round_rate(steps / seconds)
    examples = _column(columns, "examples")
    if examples:  # the same steps over the same seconds as steps_per_sec
        counted = [float(v) for v in examples[start:n] if _finite(v)]
        if len(counted) == steps:
            out["examples_per_sec"] = round_rate(sum(counted) / seconds)
    else:
        batch = _examples_per_step(wall, eps, start, n)
        if batch is not None:
            out["examples_per_sec"] = round_rate(batch * steps / seconds)
    median = median_rate(eps[first_timed:])
    if median is not None:
        out["median_examples_per_sec"] = round_rate(median)
    if target_steps is not None and running:
        out["eta_seconds"] = round(max(0, int(target_steps) - n) * seconds / steps, 1)
    return out


def median_rate(per_step) -> float | None:
    """The median of per-step rates (examples/s of each step; NaN and Inf left out): the middle
    value, or the mean of the two middle ones. The one "median" of the workbench: the run's
    figures (sidebar, summary, run store and compare table), the scaling table's median step
    (global batch / this) and the dashed line of the run's figure. None without a rate."""
    timed = sorted(float(v) for v in per_step if _finite(v))
    if not timed:
        return None
    middle = len(timed) // 2
    return timed[middle] if len(timed) % 2 else (timed[middle - 1] + timed[middle]) / 2


def last_metrics(columns) -> dict:
    """Each metric's last value (the loss first)."""
    names = [c for c in _names(columns) if c not in RESERVED]
    names.sort(key=lambda n: 0 if n == "loss" else 1 if "loss" in n else 2)
    out = {}
    for name in names:
        values = _column(columns, name)
        if len(values):
            out[name] = float(values[-1])
    return out


def round_rate(value: float) -> float:
    """Rates keep 4 significant digits (more than any view shows, fewer than timing noise)."""
    if not value or not math.isfinite(value):
        return value
    digits = 3 - int(math.floor(math.log10(abs(value))))
    return round(value, max(0, digits))


def fmt(value) -> str:
    """1234.5 -> '1,235'; 12.345 -> '12.3'; 0.01234 -> '0.0123'; None -> '–'.

    The same rules as `formatNumber` in extensions/replicator-workbench/src/model.ts, so the
    notebook and the sidebar print a figure identically.
    """
    if value is None:
        return "\u2013"
    try:
        value = float(value)
    except (TypeError, ValueError):
        return "\u2013"
    if not math.isfinite(value):
        return "\u2013"
    size = abs(value)
    if size >= 100:
        return f"{int(_half_up(value, 0)):,}"
    if size >= 10:
        return str(_half_up(value, 1))
    if size >= 0.01 or size == 0:
        text = str(_half_up(value, 0 if size == 0 else 3))
        return (text.rstrip("0").rstrip(".") if "." in text else text) or "0"
    return f"{value:.3g}"


def fmt_duration(seconds) -> str:
    """ETA as the sidebar shows it: '42 s', '3 min 5 s', '2 h 10 min'; None -> '–'."""
    if seconds is None or not math.isfinite(float(seconds)):
        return "\u2013"
    s = int(round(float(seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def describe(fig: dict) -> str:
    """'812 steps/s · 103,936 examples/s' (what the title, demo and summary print)."""
    return f"{fmt(fig.get('steps_per_sec'))} steps/s \u00b7 {fmt(fig.get('examples_per_sec'))} examples/s"


# ----- helpers ----------------------------------------------------------------------------------
def _half_up(value: float, places: int):
    # JavaScript's Math.round and toFixed round a tie up; Python's round() and format to even.
    from decimal import ROUND_HALF_UP, Decimal

    return Decimal(value).quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP)


def _names(columns) -> list[str]:
    return list(columns.columns) if hasattr(columns, "columns") else list(columns)


def _column(columns, name: str) -> list:
    if name not in _names(columns):
        return []
    values = columns[name]
    return values.tolist() if hasattr(values, "tolist") else list(values)


def _finite(value) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _first_timed(eps: list) -> int | None:
    for i, v in enumerate(eps):
        if _finite(v):
            return i
    return None


def _examples_per_step(wall: list, eps: list, lo: int, hi: int) -> float | None:
    """Examples per step over rows lo..hi-1, read back from the rows: a row's examples are its
    examples_per_sec x its step's time. Rows of one compiled chunk are exactly one per-step time
    apart; the gap before a chunk's first row also holds the loop's overhead, so a step's time is
    the smaller of the gaps before and after it (exact for chunks of two steps or more)."""
    total, counted = 0.0, 0
    for i in range(lo, hi):
        before = float(wall[i]) - (float(wall[i - 1]) if i else 0.0)
        after = float(wall[i + 1]) - float(wall[i]) if i + 1 < len(wall) else before
        step_time = min(before, after) if after > 0 else before
        if _finite(eps[i]) and step_time > 0:
            total += float(eps[i]) * step_time
            counted += 1
    return total / counted if counted else None


def shown_reason(status: str | None, reason: str | None) -> str | None:
    """The part of a stop reason that the status and the step count do not already say.

    'stopped at step 8337' beside "stopped · step 8,337" says nothing more (None);
    'interrupted at step 12' -> 'interrupted'; anything else (an error, "input exhausted ...")
    is kept.
    """
    if not reason:
        return None
    reason = plain(reason)  # (no terminal escape codes reach the sidebar or a table)
    match = re.fullmatch(r"(stopped|interrupted) at step [\d,]+", reason.strip())
    if match:
        return None if match.group(1) == status else match.group(1)
    return reason


def heal_line(record: dict, restarts: list) -> str:
    """One line for the dashboard and the sidebar: "worker 1 lost (killed by SIGKILL) at step
    312: restarted from step 300, 6.1 s (restart 1)"; an elastic run that went on with fewer
    workers adds ", continued on 1 of 2 workers". An async-ps worker replaced while the others went
    on (nothing resumed): "worker 1 lost (killed by SIGKILL) at step 312: replaced at step 340, 2.8
    s; the other workers went on (restart 1)"."""
    if record.get("replaced"):
        return (
            f"{record['member']} lost ({record['cause']}) at step {record.get('lost_at')}: replaced at "
            f"step {record['step']}, {record['seconds']:.1f} s; the other workers went on "
            f"(restart {len(restarts)})"
        )
    where = f"step {record['step']}" if record["step"] is not None else "the start"
    seconds = f", {record['seconds']:.1f} s" if record.get("seconds") is not None else ""
    lost_at = record.get("lost_at")
    at = f" at step {lost_at}" if lost_at else ""
    workers, of = record.get("workers"), record.get("of_workers")
    fewer = f", continued on {workers} of {of} workers" if workers and of and workers < of else ""
    return (
        f"{record['member']} lost ({record['cause']}){at}: restarted from {where}{seconds}{fewer} "
        f"(restart {len(restarts)})"
    )
