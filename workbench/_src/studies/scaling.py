"""Scaling studies: the same step at 1, 2, 4, 8 replicas, weak or strong, as a table and a plot.

Each configuration gets a fresh replicator (a new device subset in the same process: the mirrored
backend reduces with ReductionToOneDevice on CPUs, so switching is safe), a fresh model from
`setup` (seeded, so every point starts from the same weights), a warm-up run that absorbs tracing,
then a measured run. Timing: the measured run calls the compiled loop in chunks of
`steps_per_execution` steps; a step's time is its chunk's wall time / chunk length, so the step-time
distribution (median, p90) is over chunks. With steps_per_execution=1 every chunk is one step
(Python dispatch included); larger chunks measure the device work with less Python overhead.

Arithmetic (`scaling_metrics`, pure): throughput = the configuration's run's examples/s
(workbench/_src/core/run_stats.py: global batch x steps/s over the measured run, the figure the
sidebar and the run store show for that run; global batch / median step time where a table has
no run figure, and always as `median_step_examples_per_sec`, the compiled calls' speed);
speed-up = throughput / throughput at the baseline (the fewest replicas, normally 1); ideal
speed-up = replicas / baseline replicas; efficiency = speed-up / ideal. Weak scaling keeps the
per-replica batch (global = per-replica x n), strong scaling keeps the global batch, so in both
modes the speed-up is a ratio of examples per second.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from workbench._src.core import registry
from workbench._src.core.errors import ConfigurationError
from workbench._src.core.run_stats import figures, fmt, median_rate
from workbench._src.core.tf_setup import device_summary
from workbench._src.plots.scaling_plot import draw, png_bytes
from workbench._src.studies.measurements import LoadMeter, breakdown_columns, combine, honesty
from workbench._src.studies.scaling_live import live_sink
from workbench._src.studies.scaling_setup import Build, ScalingContext, measure

__all__ = [
    "ScalingContext",
    "ScalingStudy",
    "batch_sizes",
    "reference_speedup",
    "scaling_metrics",
    "scaling_study",
]

Mode = Literal["weak", "strong"]

# TF-Replicator paper (Buchlovsky et al. 2019), ResNet-50 on ImageNet, minutes to train.
TF_REPLICATOR_RESNET50_MINUTES = {1: 7118.0, 8: 1049.0, 32: 330.0, 64: 182.0}
# The columns a reader looks at first (the table has more: compile, start-up, devices, ...).
SUMMARY_COLUMNS = (
    "replicas",
    "global_batch",
    "per_replica_batch",
    "examples_per_sec",
    "step_time_median_s",
    "step_time_p90_s",
    "speedup",
    "efficiency",
    "spread",
    "input_s",
    "compute_s",
    "communication_s",
    "other_s",
)

REFERENCES = {"tf-replicator-resnet50": ("TF-Replicator ResNet-50 (paper)", TF_REPLICATOR_RESNET50_MINUTES)}


def batch_sizes(mode: Mode, batch_size: int, replicas: int) -> tuple[int, int]:
    """(global, per-replica) batch: weak keeps `batch_size` per replica, strong keeps it global."""
    if mode == "weak":
        return batch_size * replicas, batch_size
    return batch_size, batch_size // replicas


def step_time_stats(global_batch: int, examples_per_sec: Sequence[float]) -> dict[str, float]:
    """Median, p90 and mean step time (seconds) of a run's per-step examples/s. The median step
    is the run's median rate (run_stats.median_rate, as the sidebar and the run store show it):
    global batch / median step time is that figure exactly."""
    import numpy as np

    rates = np.asarray(examples_per_sec, dtype=float)
    rates = rates[np.isfinite(rates) & (rates > 0)]
    if rates.size == 0:
        nan = float("nan")
        return {"step_time_median_s": nan, "step_time_p90_s": nan, "step_time_mean_s": nan}
    t = global_batch / rates
    return {
        "step_time_median_s": global_batch / median_rate(rates),
        "step_time_p90_s": float(np.percentile(t, 90)),
        "step_time_mean_s": float(t.mean()),
    }


def scaling_metrics(points):
    """Adds throughput, speed-up, ideal speed-up and efficiency to a table of measured points.

    Pure arithmetic on columns `replicas`, `global_batch`, `step_time_median_s` (and
    `step_time_mean_s` when present); rows come back sorted by replicas. The baseline is the row
    with the fewest replicas.

    Example:
      >>> import pandas as pd
      >>> t = scaling_metrics(pd.DataFrame({"replicas": [1, 2], "global_batch": [32, 64],
      ...                                   "step_time_median_s": [0.01, 0.0125]}))
      >>> [round(e, 2) for e in t["efficiency"]]
      [1.0, 0.8]
    """
    import pandas as pd

    table = pd.DataFrame(points).sort_values("replicas").reset_index(drop=True)
    if table.empty:
        return table.assign(examples_per_sec=[], speedup=[], ideal_speedup=[], efficiency=[])
    table["median_step_examples_per_sec"] = table["global_batch"] / table["step_time_median_s"]
    if "examples_per_sec" not in table or table["examples_per_sec"].isna().all():
        table["examples_per_sec"] = table["median_step_examples_per_sec"]
    else:  # the run's own figure (run_stats), where a configuration has one
        table["examples_per_sec"] = table["examples_per_sec"].fillna(table["median_step_examples_per_sec"])
    if "step_time_mean_s" in table:
        table["mean_examples_per_sec"] = table["global_batch"] / table["step_time_mean_s"]
    base = table.iloc[0]
    table["speedup"] = table["examples_per_sec"] / base["examples_per_sec"]
    table["ideal_speedup"] = table["replicas"] / base["replicas"]
    table["efficiency"] = table["speedup"] / table["ideal_speedup"]
    return table


def reference_speedup(times: Mapping[int, float]) -> dict[int, float]:
    """Converts {replicas: time to train} into {replicas: speed-up over the fewest replicas}.

    Example:
      >>> round(reference_speedup({1: 7118, 8: 1049})[8], 2)  # the TF-Replicator paper's ResNet-50
      6.79
    """
    if not times:
        return {}
    base = min(times)
    return {int(n): float(times[base]) / float(t) for n, t in sorted(times.items())}


def _check_arguments(replicas, mode, batch_size, steps, warmup, steps_per_execution) -> list[int]:
    if mode not in ("weak", "strong"):
        raise ConfigurationError(
            f"mode must be 'weak' (per-replica batch fixed) or 'strong' (global batch fixed); "
            f"received mode={mode!r}."
        )
    for name, value, low in (
        ("batch_size", batch_size, 1),
        ("steps", steps, 1),
        ("warmup", warmup, 1),
        ("steps_per_execution", steps_per_execution, 1),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigurationError(f"{name} must be an integer >= {low}; received {name}={value!r}.")
    try:
        counts = sorted({int(n) for n in replicas})
    except (TypeError, ValueError):
        counts = []
    if not counts or any(n < 1 for n in counts) or any(isinstance(n, bool) or int(n) != n for n in replicas):
        raise ConfigurationError(
            f"replicas must be a list of positive integers, e.g. [1, 2, 4, 8]; received {replicas!r}."
        )
    if mode == "strong":
        bad = [n for n in counts if batch_size % n]
        if bad:
            raise ConfigurationError(
                f"Strong scaling keeps the global batch ({batch_size}) and splits it over the "
                f"replicas, but it does not divide by {bad}. Fix: use a global batch_size that is a "
                f"multiple of {max(counts)}, e.g. {max(counts) * max(1, batch_size // max(counts))}."
            )
    return counts


class ScalingStudy:
    """The result of `wb.scaling_study`: `.table` (a DataFrame), `.figure`, `.save(path)`.

    `.runs` maps each replica count to its measured `wb.Run` (history, metrics); `.path` is the
    PNG written beside the study (None if none was asked for).
    """

    def __init__(
        self, mode: str, planned: list[int], reference=None, reference_label: str = "", title: str = ""
    ):
        self.mode = mode
        self.planned = planned
        self.reference = dict(reference or {})
        self.reference_label = reference_label
        self.title = title
        self.points: list[dict] = []
        self.runs: dict[int, Any] = {}
        self.path: str | None = None

    @property
    def table(self):
        """One row per finished configuration, sorted by replicas (see `scaling_metrics`)."""
        return scaling_metrics(self.points)

    @property
    def figure(self):
        """The final static matplotlib Figure (Agg canvas; no frontend needed)."""

        return draw(self)

    def save(self, path: str | os.PathLike) -> str:
        """Writes the figure as a PNG at `path` (folders created); returns the path."""

        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "wb") as f:
            f.write(png_bytes(self))
        return path

    def _repr_html_(self) -> str:
        import base64

        table = self.table
        cols = [c for c in SUMMARY_COLUMNS if c in table]
        html = table[cols].to_html(index=False, float_format=fmt)  # 11,050, not 1.105e+04
        img = base64.b64encode(png_bytes(self)).decode()
        notes = "".join(f"<br>{note}" for note in self.notes())
        return (
            f"<b>wb.ScalingStudy</b> ({self.mode})<br><img src='data:image/png;base64,{img}'/>{html}{notes}"
        )

    def forecast(
        self,
        workers: Sequence[int] = (8, 16, 64),
        link_gbps: float = 10.0,
        devices_per_worker: int = 1,
        *,
        latency_us: float = 50.0,
        intra_gbps: float | None = None,
    ):
        """Predicts step time, throughput and efficiency at more workers from this study's
        baseline (its fewest replicas): measured compute, input and other seconds per step and
        the gradient bytes its all-reduce carried, with a ring all-reduce over `link_gbps`
        gigabit/s links. A DataFrame; its printed form ends with the model's assumptions
        (also in `.attrs["assumptions"]`; studies/forecast.py states the model).
        """
        from workbench._src.studies.forecast import forecast

        table = self.table
        if not len(table) or table[["compute_s", "input_s", "other_s"]].iloc[0].isna().any():
            raise ConfigurationError(
                "study.forecast needs the baseline's breakdown (compute, input, other seconds per "
                f"step); received a study with {len(table)} configuration(s) and no breakdown at the "
                "first. Fix: run the study with the breakdown on (the default) and at least one configuration."
            )
        return forecast(
            table.iloc[0].to_dict(), workers, link_gbps, devices_per_worker, latency_us, intra_gbps, self.mode
        )

    def notes(self) -> list[str]:
        """Sentences a reader needs beside the numbers: unreliable figures (machine load) and
        each configuration's breakdown diagnosis."""
        table, out = self.table, []
        for _, row in table.iterrows():
            n = int(row["replicas"])
            if row.get("unreliable"):
                out.append(f"n={n}: unreliable, {row['load_note']}")
            if row.get("breakdown"):
                out.append(f"n={n}: {row['breakdown']}")
        return out

    def __repr__(self) -> str:
        return f"<wb.ScalingStudy {self.mode} replicas={[p['replicas'] for p in self.points]}>"


def scaling_study(
    step_fn: Callable | None = None,
    input_fn: Callable | None = None,
    backend: str = "mirrored",
    replicas: Sequence[int] = (1, 2, 4, 8),
    mode: Mode = "weak",
    steps: int = 50,
    warmup: int = 10,
    setup: Callable | None = None,
    batch_size: int = 32,
    *,
    steps_per_execution: int = 10,
    repeats: int = 1,
    seed: int | None = 0,
    reduce: dict[str, str] | None = None,
    reference: Mapping[int, float] | str | None = None,
    reference_label: str | None = None,
    path: str | os.PathLike | None = None,
    live: bool | None = None,
    **replicator_options,
) -> ScalingStudy:
    """Runs the same step at several replica counts and measures how throughput scales.

    Args:
      step_fn, input_fn: a stateless step and its input (or give `setup`). input_fn(ctx) receives
        a `ScalingContext`: read `ctx.global_batch_size` (PER_WORKER input, the default) or
        `ctx.batch_size_per_replica` (PER_REPLICA) and batch to it.
      backend: a synchronous backend: "mirrored" (devices of this process: GPUs, or virtual
        CPUs), "multi-worker" (one worker process per CPU replica, started on 127.0.0.1 for
        each configuration; setup, step_fn and input_fn travel to the workers by value), "tpu",
        "single" (one replica).
      replicas: replica counts to measure; the fewest is the baseline (normally 1).
      mode: "weak" keeps `batch_size` per replica (global = batch_size x n); "strong" keeps
        `batch_size` as the global batch (each replica gets batch_size / n).
      steps: measured steps per configuration; warmup: steps run first, untimed (tracing).
      setup: setup(repl) or setup(repl, ctx), called inside repl.context() after seeding, returns
        (step_fn, input_fn), a dict with those keys, or step_fn alone (input_fn from the argument).
        It rebuilds model and optimizer so every point starts from the same initial weights.
      steps_per_execution: steps per compiled call; step times are chunk time / chunk length.
      repeats: measure every configuration this many times, interleaved (1, 2, 4, 1, 2, 4, ...,
        so load that comes and goes hits all alike); the table gives the median repeat and the
        `spread` ((max - min) / median of examples/s), and flags (`unreliable`, `load_note`)
        figures measured while other processes kept the cores busy or CPU time was stolen.
      seed: keras.utils.set_random_seed(seed) before each setup (None: leave the seed alone).
      reduce: passed to repl.train (how scalar outputs combine across replicas).
      reference: a curve to overlay, {replicas: time to train} (converted to speed-up), or
        "tf-replicator-resnet50" for the paper's ResNet-50 figures.
      path: where to write the PNG (written after every point, so a partial study leaves one).
      live: update a figure in place in the notebook as points finish; default: when in a kernel.
      **replicator_options: passed to wb.replicator (e.g. input_replication).

    Returns:
      A `wb.ScalingStudy`; `.table` has one row per configuration with throughput, step-time
      median/p90, speed-up, efficiency, spread over repeats and the machine's load, where the
      step's time goes (`input_s`, `compute_s`, `communication_s`, `other_s`: seconds per step
      of the slowest worker, and the `breakdown` sentence), compile (warm-up) and, on
      multi-worker, process start-up seconds, and what the devices really were (`devices_kind`,
      `physical_cores`, `threads_per_replica`, `threads_note`). `study.forecast(...)` predicts
      larger clusters from it.

    Example:
      >>> import workbench as wb, tensorflow as tf
      >>> def input_fn(ctx):
      ...     return tf.data.Dataset.from_tensors(tf.ones([ctx.global_batch_size, 8])).repeat()
      >>> study = wb.scaling_study(lambda x: {"s": tf.reduce_sum(x)}, input_fn, replicas=[1, 2],
      ...                          steps=20, warmup=2, batch_size=16)
      >>> list(study.table["global_batch"])
      [16, 32]
    """
    import time

    counts = _check_arguments(replicas, mode, batch_size, steps, warmup, steps_per_execution)
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ConfigurationError(f"repeats must be an integer >= 1; received repeats={repeats!r}.")
    if setup is None and (step_fn is None or input_fn is None):
        raise ConfigurationError(
            "scaling_study needs step_fn and input_fn, or setup(repl) returning them; received "
            f"step_fn={step_fn!r}, input_fn={input_fn!r}, setup=None. Fix: "
            "wb.scaling_study(step_fn, input_fn, ...) or wb.scaling_study(setup=build, ...)."
        )
    if isinstance(reference, str):
        if reference not in REFERENCES:
            raise ConfigurationError(
                f"Unknown reference {reference!r}; known: {sorted(REFERENCES)}, or pass "
                "{replicas: time to train}, e.g. {1: 7118, 8: 1049}."
            )
        reference_label = reference_label or REFERENCES[reference][0]
        reference = REFERENCES[reference][1]
    if not registry.spec(backend).synchronous:
        raise ConfigurationError(
            f"A scaling study measures synchronous steps (every replica takes one batch per step, "
            f"so a step's time is the cluster's); received backend={backend!r}, whose workers step "
            "independently. Fix: backend='mirrored' (devices of one process) or 'multi-worker' "
            "(processes), or time async training with run.history['examples_per_sec']."
        )
    # Build every replicator first: a device count the process lacks fails now, not after an hour.
    repls = {n: registry.replicator(backend, num_replicas=n, **replicator_options) for n in counts}
    study = ScalingStudy(
        mode,
        counts,
        reference_speedup(reference or {}),
        reference_label or "reference",
        title=f"{mode} scaling, {backend}, batch {batch_size}"
        f"{' per replica' if mode == 'weak' else ' global'}",
    )
    devices = device_summary()
    sink = live_sink(live)
    study_started = time.strftime("%H:%M:%S")
    samples: dict[int, list[dict]] = {n: [] for n in counts}
    with _quiet_retracing():
        for repeat in range(repeats):
            for n in counts:  # interleaved: every configuration once per round
                repl = repls[n]
                global_batch, per_replica = batch_sizes(mode, batch_size, n)
                build = Build(setup, step_fn, input_fn, mode, global_batch, seed)
                options = {"steps_per_execution": steps_per_execution, "reduce": reduce}
                # The name tells the study apart from others (backend, start time): the sidebar
                # groups its runs by it (study_group below).
                again = f" #{repeat + 1}" if repeats > 1 else ""
                name = f"scaling {mode} n={n}{again} \u00b7 {repl.backend} \u00b7 {study_started}"
                with LoadMeter() as load:
                    run, compile_seconds = measure(repl, build, warmup, steps, name, options)
                study.runs[n] = run
                eps = run.history["examples_per_sec"].dropna().to_numpy()  # per step, from chunk times
                run_figures = figures(run.history)  # the run's figures, as the sidebar shows them
                samples[n].append(
                    {"replicas": n, "mode": mode, "global_batch": global_batch, "per_replica_batch": per_replica,
                     "steps": int(run.steps), "steps_per_execution": steps_per_execution,
                     "examples_per_sec": run_figures["examples_per_sec"],
                     "steps_per_sec": run_figures["steps_per_sec"],
                     **step_time_stats(global_batch, eps), "compile_seconds": compile_seconds,
                     # worker processes started and joined (multi-worker); NaN in one process
                     "startup_seconds": getattr(run, "startup_seconds", float("nan")),
                     "backend": repl.backend, **breakdown_columns(run), **load.reading(),
                     **honesty(repl.describe(), devices, getattr(repl, "threads_per_worker", None))}
                )  # fmt: skip
                study.points = [combine(samples[m]) for m in counts if samples[m]]
                if path is not None:
                    study.path = study.save(path)
                if sink is not None:
                    sink.send(study)
    return study


class _quiet_retracing:
    """Drops TensorFlow's "triggered tf.function retracing" warning: a study builds a new compiled
    step per configuration on purpose, so the warning would only alarm the reader."""

    def __enter__(self):
        import logging

        self.logger = logging.getLogger("tensorflow")
        self.filter = lambda record: "triggered tf.function retracing" not in record.getMessage()
        self.logger.addFilter(self.filter)

    def __exit__(self, *exc):
        self.logger.removeFilter(self.filter)
        return False


def study_group(name: str) -> tuple[str | None, bool]:
    """(group, is_warmup) from a run's name: a scaling study's runs ('scaling weak n=2 warm-up ·
    mirrored · 14:02:33', named by studies/scaling.py) share the group 'scaling weak · mirrored
    · 14:02:33' (mode, backend, start time: two studies never merge), shown as one sidebar group
    with a line per configuration; warm-up runs (untimed, they absorb tracing) are not shown once
    they ended. Older names ('scaling weak n=2') group as 'scaling weak'."""
    name = re.sub(r" \(\d+\)$", "", name)  # the store's clash suffix
    match = re.fullmatch(r"(scaling \w+) n=\d+( warm-up)?((?: \u00b7 [^\u00b7]+)*)", name)
    warmup = name == "warm-up" or name.endswith(" warm-up") or bool(match and match.group(2))
    return (match.group(1) + match.group(3) if match else None), warmup
