"""The owned run loop behind `repl.train`: fused steps, metrics, checkpoints, stops.

Each loop iteration calls the fused tf.function for a chunk of k steps. k is either fixed
(`steps_per_execution=k`) or "auto": after the first call (which traces), k grows until a chunk
takes about CHUNK_SECONDS, long enough that Python overhead vanishes, short enough that stop
requests, Ctrl-C and live plots are served within a fraction of a second.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from typing import Literal

import numpy as np

from workbench._src.errors import ConfigurationError, NonFiniteError
from workbench._src.checkpoints import Saver
from workbench._src.run import Run
from workbench._src.tf_setup import tf

CHUNK_SECONDS = 0.2
MAX_STEPS_PER_EXECUTION = 1000


def train(
    replicator,
    step_fn: Callable,
    input_fn: Callable,
    steps: int,
    *,
    steps_per_execution: int | Literal["auto"] = "auto",
    reduce: dict[str, Literal["mean", "sum"]] | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint=None,
    checkpoint_every: int | None = None,
    resume: bool = True,
    on_nonfinite: Literal["stop", "raise", "ignore"] = "stop",
    background: bool = False,
    sinks=(),
    name: str | None = None,
) -> Run:
    """Trains step_fn on input_fn for `steps` steps; returns the wb.Run.

    Args:
      steps: steps to run (each step: every replica takes one batch).
      steps_per_execution: steps fused into one compiled call, or "auto".
      reduce: how each scalar output is combined across replicas, e.g. {"correct": "sum"};
        the default for every scalar is "mean". Non-scalar outputs are not recorded.
      checkpoint_dir: where to save checkpoints (at the end, every `checkpoint_every` steps, and
        when the run is stopped, interrupted or fails); with resume=True an existing checkpoint
        there is restored first and the step count continues from it.
      checkpoint: what to save: a tf.train.Checkpoint or a dict of trackables (e.g.
        {"model": model, "optimizer": opt}); default: every variable created in repl.context().
      on_nonfinite: a NaN/Inf metric "stop"s the run with a warning, "raise"s NonFiniteError
        (the partial run in `err.run`), or is "ignore"d.
      background: return at once and train in a thread; use run.stop() / run.wait().
      sinks: callables (or objects with send) that receive the run's events.
    """
    _check_options(steps, steps_per_execution, reduce, on_nonfinite, checkpoint_every, checkpoint_dir)
    program = replicator._program(step_fn, input_fn)
    run = new_run(replicator, step_fn, input_fn, steps, steps_per_execution, sinks, name)
    saver = Saver(replicator, program, checkpoint_dir, checkpoint) if checkpoint_dir else None
    loop = _Loop(
        run, program, steps, steps_per_execution, reduce or {}, saver, checkpoint_every, on_nonfinite
    )
    return drive(run, loop.run_catching, background, on_nonfinite)


def new_run(replicator, step_fn, input_fn, steps, steps_per_execution, sinks=(), name=None) -> Run:
    """A Run configured from the replicator and the functions, subscribed to every registered
    sink (workbench._src.sinks: the run store, the lab watcher) and to the caller's `sinks`."""
    config = {
        **replicator.describe(),
        "step_fn": function_name(step_fn, "step_fn"),
        "input_fn": function_name(input_fn, "input_fn"),
        "steps": steps,
        "steps_per_execution": steps_per_execution,
    }
    run = Run(config, name=name)
    from workbench._src.sinks import attach_default_sinks

    attach_default_sinks(run)
    for sink in sinks:
        run.subscribe(sink)
    return run


def drive(run: Run, body: Callable[[], None], background: bool, on_nonfinite: str = "stop") -> Run:
    """Runs body(), which trains and finishes `run`: in a thread (background=True: returns at
    once), or here with Ctrl-C stopping at a step boundary, then raises what the run failed with."""
    if background:
        run._thread = threading.Thread(target=body, name=f"workbench {run.name}", daemon=True)
        run._thread.start()
        return run
    with _stop_on_sigint(run):
        body()
    if run.status == "failed":
        raise run.error
    if run.status == "non-finite" and on_nonfinite == "raise":
        raise NonFiniteError(run.stop_reason, run=run)
    return run


def function_name(fn, default: str) -> str:
    """How a run's config names step_fn / input_fn (`default` when the worker builds them)."""
    if fn is None:
        return default
    return getattr(fn, "__name__", None) or repr(fn)


class _Loop:
    def __init__(
        self, run, program, steps, steps_per_execution, reduce, saver, checkpoint_every, on_nonfinite
    ):
        self.run, self.program, self.steps = run, program, steps
        self.fixed_k = None if steps_per_execution == "auto" else steps_per_execution
        self.reduce, self.saver, self.checkpoint_every = reduce, saver, checkpoint_every
        self.on_nonfinite = on_nonfinite
        self.num_replicas = program.replicator.num_replicas

    def run_catching(self) -> None:
        run = self.run
        run.status = "running"
        run.started_at = time.time()
        try:
            begin(run, self.saver, self.program)
            status, reason = self._loop()
        except BaseException as e:  # noqa: BLE001 - recorded, then re-raised by the caller
            run.error = e
            status, reason = "failed", f"{type(e).__name__}: {e}"
        if self.saver and status != "non-finite":
            self._save_checkpoint(final=True)
        run._finish(status, reason)

    def _loop(self):
        run, program = self.run, self.program
        target = program.steps_done + self.steps
        start = time.perf_counter()
        k = self.fixed_k or 1
        first_call = True
        # The first call of a program's fused loop traces and compiles it: not a throughput. A
        # later run of the same program (e.g. after a warm-up run) is timed from its first step.
        compiling = not program.fused_traced
        while program.steps_done < target:
            k = min(k, target - program.steps_done, self._steps_to_next_checkpoint())
            # Multi-worker replicas must run chunks of the same length and stop together; the
            # replicator agrees on both across workers (a no-op on one process).
            k, stop = program.replicator._agree_on_chunk(k, run.stop_requested)
            if stop:
                return (
                    "interrupted" if getattr(run, "_interrupted", False) else "stopped"
                ), f"stopped at step {program.steps_done}"
            first = program.steps_done + 1
            t0 = time.perf_counter()
            rows, done = program.run_fused(k)
            t1 = time.perf_counter()
            if first_call:
                run.compile_seconds = t1 - t0 if compiling else 0.0
            self._record(rows, first, t0 - start, t1 - start, timed=not (first_call and compiling))
            bad = self._first_nonfinite(rows, first)
            if bad and self.on_nonfinite != "ignore":
                return "non-finite", bad
            if done < k:
                return "finished", f"input exhausted after step {program.steps_done}"
            if self.checkpoint_every and program.steps_done % self.checkpoint_every == 0:
                self._save_checkpoint()
            if self.fixed_k is None and not first_call:
                per_step = (t1 - t0) / done
                k = int(min(MAX_STEPS_PER_EXECUTION, k * 10, max(1, CHUNK_SECONDS / max(per_step, 1e-9))))
            first_call = False
        return "finished", None

    def _steps_to_next_checkpoint(self) -> int:
        if not self.checkpoint_every:
            return MAX_STEPS_PER_EXECUTION
        return self.checkpoint_every - self.program.steps_done % self.checkpoint_every

    def _record(self, rows: np.ndarray, first_step: int, t0: float, t1: float, timed: bool) -> None:
        names = self.program.metric_names or []
        n = len(rows)
        if not n:
            return
        per_step = (t1 - t0) / n
        batch = rows[:, -1]
        out = []
        for i in range(n):
            row = {
                "step": first_step + i,
                "wall_time": t0 + per_step * (i + 1),
                "examples_per_sec": batch[i] / per_step if timed else float("nan"),
            }
            for j, metric in enumerate(names):
                value = float(rows[i, j])
                row[metric] = value if self.reduce.get(metric, "mean") == "sum" else value / self.num_replicas
            out.append(row)
        self.run.record_rows(out)

    def _first_nonfinite(self, rows: np.ndarray, first_step: int) -> str | None:
        names = self.program.metric_names
        return first_nonfinite(rows, first_step, names, self.on_nonfinite, self.saver is not None)

    def _save_checkpoint(self, final: bool = False) -> None:
        path = self.saver.save()
        if path:
            self.run.publish("checkpoint", path=path, final=final)


def begin(run: Run, saver, program) -> None:
    """A run's first events: the checkpoint it resumes from, if any, then "started"."""
    if saver:
        restored = saver.restore_if_any()
        if restored is not None:
            run.publish("message", text=f"resumed from checkpoint at step {restored}: {saver.directory}")
    run.publish("started", name=run.name, config=run.config, first_step=program.steps_done + 1)


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


class _stop_on_sigint:
    """First Ctrl-C (or a Jupyter interrupt): stop at the next step boundary. Second: abort."""

    def __init__(self, run: Run):
        self.run = run
        self.previous = None

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        self.previous = signal.getsignal(signal.SIGINT)

        def handler(signum, frame):
            if self.run.stop_requested:
                signal.signal(signal.SIGINT, self.previous)
                raise KeyboardInterrupt
            self.run._interrupted = True
            self.run.stop()

        signal.signal(signal.SIGINT, handler)
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
        return False


def _check_options(steps, steps_per_execution, reduce, on_nonfinite, checkpoint_every, checkpoint_dir):
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ConfigurationError(f"steps must be a non-negative integer; received steps={steps!r}.")
    if steps_per_execution != "auto" and (
        not isinstance(steps_per_execution, int)
        or isinstance(steps_per_execution, bool)
        or steps_per_execution < 1
    ):
        raise ConfigurationError(
            f"steps_per_execution must be a positive integer or 'auto'; received {steps_per_execution!r}."
        )
    for metric, op in (reduce or {}).items():
        if op not in ("mean", "sum"):
            raise ConfigurationError(
                f"reduce[{metric!r}] must be 'mean' or 'sum'; received {op!r}. For max/min, "
                "reduce inside step_fn with repl.all_reduce(x, 'max') and return the result."
            )
    if on_nonfinite not in ("stop", "raise", "ignore"):
        raise ConfigurationError(
            f"on_nonfinite must be 'stop', 'raise' or 'ignore'; received {on_nonfinite!r}."
        )
    if checkpoint_every is not None and (
        not checkpoint_dir or not isinstance(checkpoint_every, int) or checkpoint_every < 1
    ):
        raise ConfigurationError(
            f"checkpoint_every needs a positive step count and a checkpoint_dir; received "
            f"checkpoint_every={checkpoint_every!r}, checkpoint_dir={checkpoint_dir!r}."
        )
