"""The progress a script prints (`workbench run`): a line per second at most."""

from __future__ import annotations

import time

from workbench._src.core.run_stats import describe, figures


class ProgressPrinter:
    """One line per second at most: steps of the run, metrics, and the run's figures (the same
    definitions as every other view: workbench/_src/core/run_stats.py)."""

    def __init__(self, steps: int):
        self.steps, self.last = steps, 0.0
        self.columns: dict[str, list] = {"wall_time": [], "examples_per_sec": []}

    def __call__(self, event) -> None:
        if event.kind == "started" and event.data.get("steps") is not None:
            self.steps = event.data["steps"]  # a resumed run that finishes its goal runs fewer
        if event.kind == "restart":  # a heal: the steps after its checkpoint come again
            for column in self.columns.values():
                del column[event.data["run_step"] :]
        if event.kind == "message":
            print(f"[workbench] {event.data.get('text')}", flush=True)
        if event.kind != "metrics" or not event.data["rows"]:
            return
        for row in event.data["rows"]:
            self.columns["wall_time"].append(row["wall_time"])
            self.columns["examples_per_sec"].append(row.get("examples_per_sec", float("nan")))
        now = time.monotonic()
        done = len(self.columns["wall_time"])
        if now - self.last < 1.0 and done < self.steps:
            return
        self.last = now
        row = event.data["rows"][-1]
        metrics = " ".join(
            f"{k} {v:.4g}"
            for k, v in row.items()
            if k not in ("step", "wall_time", "examples_per_sec", "workers")
        )
        figs = figures(self.columns, running=done < self.steps, target_steps=self.steps)
        print(f"step {done}/{self.steps} {metrics} \u00b7 {describe(figs)}", flush=True)
