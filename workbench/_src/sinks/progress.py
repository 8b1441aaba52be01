"""The progress a script prints (`workbench run`): a line per second at most."""

from __future__ import annotations

import time

from workbench._src.core.live import COMPILING
from workbench._src.core.run_stats import RESERVED, describe, figures


def say(text: str) -> None:
    """A line saying what a command does next, before seconds without output (an import of
    TensorFlow, processes starting, the first trace), as the progress lines are printed."""
    print(f"[workbench] {text}", flush=True)


class ProgressPrinter:
    """One line per second at most: steps of the run, metrics, and the run's figures.

    The line shows the run's snapshot (core/live.py), the same one the cell, the sidebar and the
    status bar show: the metrics event that made it carries it, and the "ended" event the final
    one (over the whole run: run.summary()'s figures). Events without one (fed by hand, or relayed
    from an older worker) fall back to the figures of the rows seen (run_stats' definitions)."""

    def __init__(self, steps: int):
        self.steps, self.last = steps, 0.0
        self.columns: dict[str, list] = {"wall_time": [], "examples_per_sec": [], "examples": []}
        self.every_row_counted = True  # each row said its examples (as the run's history keeps)
        self.printed_steps = 0  # the steps of the last line printed
        self.printed_seq = None  # the snapshot it showed (None: figures of its own rows)
        self.follows_snapshots = False  # the run's events carry snapshots

    def __call__(self, event) -> None:
        if event.kind == "started" and event.data.get("steps") is not None:
            self.steps = event.data["steps"]  # a resumed run that finishes its goal runs fewer
        if event.kind == "restart":  # a heal: the steps after its checkpoint come again
            for column in self.columns.values():
                del column[event.data["run_step"] :]
        if event.kind == "message":
            say(event.data.get("text"))
        if event.kind == "started":  # the first call traces step_fn: seconds before step 1
            say(COMPILING + "...")
        if event.kind == "ended" and event.data.get("snapshot"):
            snapshot = event.data["snapshot"]
            if snapshot["steps"] and snapshot.get("seq") != self.printed_seq:  # the run's final figures
                self._print(
                    snapshot["steps"], snapshot.get("metrics") or {}, snapshot, seq=snapshot.get("seq")
                )
            return
        if event.kind != "metrics" or not event.data["rows"]:
            return
        self._count(event.data["rows"])
        snapshot = event.data.get("snapshot")
        now = time.monotonic()
        done = len(self.columns["wall_time"])
        if now - self.last < 1.0 and done < self.steps:
            return
        if snapshot is not None:  # the run's own figures, as every other view shows them
            self.follows_snapshots = True
            if snapshot["steps"] < self.steps:  # (the last line: the final snapshot, at the end)
                self._print(
                    snapshot["steps"], snapshot.get("metrics") or {}, snapshot, seq=snapshot.get("seq")
                )
            return
        if self.follows_snapshots:  # a run that takes snapshots: its next one is printed
            return
        # The examples each row counted, as run.summary() reads them from the history: read back
        # from examples_per_sec x a row's time instead, rows that several async-ps workers
        # report in parallel gave 20-50% too few.
        columns = self.columns if self.every_row_counted else {
            k: v for k, v in self.columns.items() if k != "examples"
        }  # fmt: skip
        figs = figures(columns, running=done < self.steps, target_steps=self.steps)
        row = event.data["rows"][-1]
        self._print(done, {k: v for k, v in row.items() if k not in RESERVED}, figs, seq=None)

    def _count(self, rows: list[dict]) -> None:
        for row in rows:
            self.columns["wall_time"].append(row["wall_time"])
            self.columns["examples_per_sec"].append(row.get("examples_per_sec", float("nan")))
            self.columns["examples"].append(row.get("examples", float("nan")))
            self.every_row_counted = self.every_row_counted and "examples" in row

    def _print(self, done: int, metrics: dict, figs: dict, seq) -> None:
        self.last, self.printed_steps, self.printed_seq = time.monotonic(), done, seq
        shown = " ".join(
            f"{k} {v:.4g}"
            for k, v in metrics.items()
            if k not in RESERVED and k != "workers" and v is not None
        )
        print(f"step {done}/{self.steps} {shown} \u00b7 {describe(figs)}", flush=True)
