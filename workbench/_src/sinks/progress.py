"""The progress a script prints (`workbench run`): a line per second at most."""

from __future__ import annotations

import time

from workbench._src.core.run_stats import RESERVED, describe, figures


def say(text: str) -> None:
    """A line saying what a command does next, before seconds without output (an import of
    TensorFlow, processes starting, the first trace), as the progress lines are printed."""
    print(f"[workbench] {text}", flush=True)


class ProgressPrinter:
    """One line per second at most: steps of the run, metrics, and the run's figures (the same
    definitions as every other view: workbench/_src/core/run_stats.py)."""

    def __init__(self, steps: int):
        self.steps, self.last = steps, 0.0
        self.columns: dict[str, list] = {"wall_time": [], "examples_per_sec": [], "examples": []}
        self.every_row_counted = True  # each row said its examples (as the run's history keeps)

    def __call__(self, event) -> None:
        if event.kind == "started" and event.data.get("steps") is not None:
            self.steps = event.data["steps"]  # a resumed run that finishes its goal runs fewer
        if event.kind == "restart":  # a heal: the steps after its checkpoint come again
            for column in self.columns.values():
                del column[event.data["run_step"] :]
        if event.kind == "message":
            say(event.data.get("text"))
        if event.kind == "started":  # the first call traces step_fn: seconds before step 1
            say("compiling step_fn (its first call traces it) and running the first steps...")
        if event.kind != "metrics" or not event.data["rows"]:
            return
        for row in event.data["rows"]:
            self.columns["wall_time"].append(row["wall_time"])
            self.columns["examples_per_sec"].append(row.get("examples_per_sec", float("nan")))
            self.columns["examples"].append(row.get("examples", float("nan")))
            self.every_row_counted = self.every_row_counted and "examples" in row
        now = time.monotonic()
        done = len(self.columns["wall_time"])
        if now - self.last < 1.0 and done < self.steps:
            return
        self.last = now
        row = event.data["rows"][-1]
        metrics = " ".join(f"{k} {v:.4g}" for k, v in row.items() if k not in RESERVED and k != "workers")
        # The examples each row counted, as run.summary() reads them from the history: read back
        # from examples_per_sec x a row's time instead, rows that several async-ps workers
        # report in parallel gave 20-50% too few.
        columns = self.columns if self.every_row_counted else {
            k: v for k, v in self.columns.items() if k != "examples"
        }  # fmt: skip
        figs = figures(columns, running=done < self.steps, target_steps=self.steps)
        print(f"step {done}/{self.steps} {metrics} \u00b7 {describe(figs)}", flush=True)
