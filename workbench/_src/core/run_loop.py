"""The one run loop behind `repl.train`: chunks of fused steps, metrics, checkpoints, stops.

Whatever executes the steps, a run goes through the same loop:

  - `drive` owns the lifecycle: starts the run, runs it here (Ctrl-C stops at a step boundary)
    or in a background thread, and ends it whatever happens; an error carries `.run`.
  - `ChunkLoop` sizes the chunks, keeps an executor busy, records the rows, stops on NaN/Inf, a
    stop request or an exhausted dataset, and saves checkpoints. An *executor* runs the chunks:
      InProcessExecutor   the fused tf.function of a Program, here (single, mirrored, tpu, and
                          each worker of a multi-worker run);
      CoordinatorExecutor chunks scheduled on parameter-server workers (backends/async_ps.py).
    A third way to execute a run, in worker processes started here, has no loop of its own in
    this process: the launcher (launch/launcher.py) relays the loop that runs in the processes.

Chunk length k is either fixed (`steps_per_execution=k`) or "auto": after the first call (which
traces), k grows until a chunk takes about CHUNK_SECONDS, long enough that Python overhead
vanishes, short enough that stop requests, Ctrl-C and live plots are served within a fraction
of a second.
"""

from __future__ import annotations

import collections
import threading
import time
import warnings
from collections.abc import Callable

from workbench._src.core.checkpoints import with_checkpoint_hint
from workbench._src.core.default_sinks import attach_default_sinks
from workbench._src.core.errors import InputError, NonFiniteError
from workbench._src.core.executors import Executor, InProcessExecutor, no_agreement
from workbench._src.core.nonfinite import first_nonfinite, rows_until_nonfinite
from workbench._src.core.resume import steps_to_run
from workbench._src.core.run import NO_STOP, PREEMPT, Run
from workbench._src.core.run_options import RunOptions
from workbench._src.core.run_signals import PreemptOnSigterm, _stop_on_sigint

__all__ = [
    "ChunkLoop",
    "Executor",
    "InProcessExecutor",
    "PreemptOnSigterm",
    "drive",
    "new_run",
    "no_agreement",
    "train",
]

CHUNK_SECONDS = 0.2
MAX_STEPS_PER_EXECUTION = 1000


def train(replicator, program, executor: Executor, saver, opts: RunOptions) -> Run:
    """Trains `program` with `executor` for opts.steps steps; returns the wb.Run.

    The replicator hands in everything the loop needs (its program, the executor that runs it,
    the checkpoint Saver or None); the loop itself only asks it to describe itself.
    """
    run = new_run(replicator, program.step_fn, program.input_fn, opts)
    program.timing = opts.breakdown  # the fused loop reads the clock in each step (step_clock.py)
    loop = ChunkLoop(run, program, executor, opts, saver)
    return drive(run, loop.execute, opts.background, opts.on_nonfinite)


def new_run(replicator, step_fn, input_fn, opts: RunOptions) -> Run:
    """A Run configured from the replicator and the functions, subscribed to every default sink
    (workbench._src.sinks: the run store, the lab watcher) and to the caller's `sinks`."""

    config = {
        **replicator.describe(),
        "step_fn": function_name(step_fn, "step_fn"),
        "input_fn": function_name(input_fn, "input_fn"),
        "steps": opts.steps,
        "steps_per_execution": opts.steps_per_execution,
    }
    run = Run(config, name=opts.name, tags=opts.tags, hparams=opts.hparams)
    attach_default_sinks(run)
    for sink in opts.sinks:
        run.subscribe(sink)
    return run


def function_name(fn, default: str) -> str:
    """How a run's config names step_fn / input_fn (`default` when a worker builds them)."""
    if fn is None:
        return default
    return getattr(fn, "__name__", None) or repr(fn)


def drive(run: Run, body: Callable[[Run], tuple[str, str | None]], background: bool, on_nonfinite="stop"):
    """Starts `run`, calls body(run) -> (status, reason) and ends the run with it, or failed with
    what body raised. In a daemon thread (background=True: returns at once), or here with Ctrl-C
    stopping at a step boundary; then raises what the run failed with (carrying `.run`)."""

    def execute():
        try:
            status, reason = body(run)
        except BaseException as error:  # noqa: BLE001 - the run records it; re-raised below
            run._fail(error)
        else:
            run._end(status, reason)

    run._start()
    if background:
        run._thread = threading.Thread(target=execute, name=f"workbench {run.name}", daemon=True)
        run._thread.start()
        return run
    with _stop_on_sigint(run):
        execute()
    if run.status == "failed":
        raise run.error
    if run.status == "non-finite" and on_nonfinite == "raise":
        raise NonFiniteError(run.stop_reason, run=run)
    return run


class ChunkLoop:
    """Keeps the executor busy with chunks until `steps` steps have run or the run must stop."""

    def __init__(self, run: Run, program, executor, opts: RunOptions, saver):
        self.run, self.program, self.executor, self.opts, self.saver = run, program, executor, opts, saver
        self.fixed_k = None if opts.steps_per_execution == "auto" else opts.steps_per_execution
        self.reduce = opts.reduce or {}
        self.recent: collections.deque = collections.deque()  # (time, examples) for windowed rates
        self.steps = opts.steps  # fewer when a resumed run finishes the run it continues

    def execute(self, run: Run) -> tuple[str, str | None]:
        try:
            restored = self._restore()
            self._warm_up()
            if self.opts.max_restarts and not restored:
                # A run that heals itself keeps its start too: a member lost before the first
                # periodic save resumes from here, not from weights the setup builds again.
                self._save()
            self.run.publish(
                "started",
                name=self.run.name,
                config=self.run.config,
                first_step=self.program.steps_done + 1,
                steps=self.steps,  # (fewer than asked when it finishes a resumed run)
            )
            status, reason = self._loop()
        except BaseException as error:  # noqa: BLE001 - save what we have, then fail the run
            error = self.executor.explain(error)
            # A save now holds whatever the failed chunk had applied before it failed, under the
            # step count before it: a run that heals itself resumes from its last clean one.
            if self.executor.healthy() and not self.opts.max_restarts:
                self._save(final=True, failing=True)
            raise with_checkpoint_hint(error, self.saver) from None
        finally:
            if self.saver:  # (a periodic save still being written: its event comes before the end)
                self.saver.wait()
            self.executor.close()
        if self.saver and status != "non-finite":
            if status != "preempted":  # (a preempted run's checkpoint keeps its goal: it is resumed)
                self.saver.goal_step = 0
            self._save(final=True)
        return status, reason

    def _restore(self) -> bool:
        """Restores the latest checkpoint when there is one to resume; True if it did."""
        run, saver = self.run, self.saver
        self.executor.start(run)
        if not saver:
            return False
        restored = saver.restore_if_any()
        if restored is None:
            return False
        run.publish("message", text=f"resumed from checkpoint at step {restored.step}: {saver.directory}")
        for note in restored.notes:  # said once, where the resume happens
            warnings.warn(f"{run.name}: {note}.", RuntimeWarning, stacklevel=2)
            run.publish("message", text=note)
        self.steps, said = steps_to_run(
            self.opts.steps, restored.step, restored.goal_step, restored.asked_steps
        )
        if said:
            run.config["steps"] = self.steps
            run.publish("message", text=said)
        return True

    def _warm_up(self) -> None:
        """`opts.warmup` steps before the recorded ones: the first call (one step) traces and is
        timed as compile_seconds; the rest run in one chunk. Workers agree on both, as always."""
        remaining, first = self.opts.warmup, True
        while remaining:
            k, _ = self.executor.agree(1 if first else remaining, NO_STOP)
            started = time.perf_counter()
            result = self.executor.collect(self.executor.submit(k))
            if result is None:  # lost with a dead worker: run it again
                continue
            if first:
                self.run.compile_seconds = time.perf_counter() - started
            done = result[1]
            remaining, first = remaining - done, False
            if done < k:
                raise InputError(
                    f"input_fn's dataset ran out during the {self.opts.warmup} warm-up steps. Fix: add "
                    ".repeat() to the dataset (before .batch)."
                )

    def _loop(self) -> tuple[str, str | None]:
        run, program, executor = self.run, self.program, self.executor
        first_step = program.steps_done
        target = first_step + self.steps
        if self.saver:  # a checkpoint says what this run is training towards (core/resume.py)
            self.saver.goal_step, self.saver.asked_steps = target, self.opts.steps
        scheduled = first_step
        in_flight: collections.deque = collections.deque()  # (handle, chunk, submitted at)
        k = self.fixed_k or 1
        start = last = time.perf_counter()
        paced_from = None  # (time, steps done) after the first call: the pace excludes tracing
        first_call = True
        # The first call of a program's fused loop traces and compiles it: not a throughput. A
        # later run of the same program (e.g. after a warm-up run) is timed from its first step.
        compiling = not program.fused_traced
        status, reason = "finished", None
        stopping = False
        while True:
            while not (stopping or reason) and scheduled < target and len(in_flight) < executor.max_in_flight:
                chunk = min(k, target - scheduled, self._steps_to_next_checkpoint(scheduled))
                # The stop request goes through the agreement too: every worker of a multi-worker
                # run must make the same number of agreements and stop at the same step.
                chunk, stop_kind = executor.agree(chunk, run.stop_kind)
                stopping = stop_kind != NO_STOP
                if stopping:
                    if stop_kind == PREEMPT and not run._preempted:
                        who = getattr(program.replicator, "preempted_workers", None)
                        run.preempt(
                            f"worker {who[0]} was preempted" if who else "another process was preempted"
                        )
                    run.stop()  # (another worker may have asked: stop here too)
                    break
                submitted = time.perf_counter()  # before: an in-process submit runs the chunk
                in_flight.append((executor.submit(chunk), chunk, submitted))
                scheduled += chunk
                if first_call:
                    break  # the first chunk traces: wait for it before scheduling more
            if not in_flight:
                break
            handle, chunk, submitted = in_flight.popleft()
            result = executor.collect(handle)
            if result is None and run.stop_requested:
                continue  # left behind on a worker that does not answer: the run is stopping
            if result is None:  # lost with a dead worker and not re-run by TensorFlow: run it again
                submitted = time.perf_counter()
                in_flight.append((executor.submit(chunk), chunk, submitted))
                run.publish(
                    "message", text=f"a chunk of {chunk} steps was lost with a worker; scheduled again"
                )
                continue
            rows, done = result
            if status == "non-finite":
                # A chunk that was in flight when a metric went non-finite (async-ps): its steps
                # ran, but the history ends at the reported step.
                continue
            now = time.perf_counter()
            if first_call and run.compile_seconds is None:  # (a warm-up has set it already)
                run.compile_seconds = now - start if compiling else 0.0
            t0 = max(submitted, last)
            kept = rows if self.opts.on_nonfinite == "ignore" else rows[: rows_until_nonfinite(rows)]
            self._record(
                kept,
                program.steps_done - done + 1,
                t0 - start,
                now - start,
                timed=not (first_call and compiling),
                chunk_rows=len(rows),
            )
            last = now
            bad = first_nonfinite(
                rows,
                program.steps_done - done + 1 - first_step,  # counted from the run's start
                program.metric_names,
                self.opts.on_nonfinite,
                self.saver is not None,
            )
            if bad and self.opts.on_nonfinite != "ignore" and not reason:
                status, reason = "non-finite", bad
            if done < chunk and not reason:
                reason = self._exhausted(program.steps_done - first_step)
            if (
                self.opts.checkpoint_every
                and program.steps_done % self.opts.checkpoint_every == 0
                and status != "non-finite"  # (never save the non-finite weights)
            ):
                if program.steps_done >= target:  # the goal is reached: nothing left unfinished
                    self.saver.goal_step = 0
                self._save()
            if self.fixed_k is None and not first_call and done:
                if executor.max_in_flight > 1:
                    # Chunks overlap and return in bursts: pace by the run's average time per
                    # step and worker, not by the gap since the last result (which would grow
                    # chunks far past CHUNK_SECONDS, and then a worker's whole chunk runs beside
                    # another's on older weights: the history's step order would mislead). The
                    # average starts after the first call: counting its tracing kept chunks at
                    # a fraction of their length for a whole short run.
                    paced_time, paced_steps = paced_from
                    per_step = (
                        (now - paced_time) / (program.steps_done - paced_steps) * executor.parallelism()
                    )
                else:
                    per_step = (now - t0) / done
                k = int(min(MAX_STEPS_PER_EXECUTION, k * 10, max(1, CHUNK_SECONDS / max(per_step, 1e-9))))
            if first_call:
                paced_from = (now, program.steps_done)
            first_call = False
        if status == "finished" and not reason and stopping and program.steps_done < target:
            status, reason = "stopped", run.stopped_reason(program.steps_done - first_step)
            if run._preempted:
                status = "preempted"
                reason = f"preempted at step {program.steps_done - first_step} ({run._preempted})" + (
                    "; its checkpoint keeps the run's goal: run it again with the same steps to finish it"
                    if self.saver
                    else "; no checkpoint_dir was given, so nothing was saved"
                )
        return status, reason

    def _exhausted(self, ran: int) -> str:
        reason = (
            f"input exhausted after {ran} of {self.opts.steps} steps: input_fn's dataset ran out. "
            "Fix: add .repeat() to the dataset (before .batch) to train for as many steps as asked."
        )
        warnings.warn(f"{self.run.name}: {reason}", RuntimeWarning, stacklevel=2)
        return reason

    def _steps_to_next_checkpoint(self, scheduled: int) -> int:
        every = self.opts.checkpoint_every
        return every - scheduled % every if every else MAX_STEPS_PER_EXECUTION

    def _record(self, rows, first_step: int, t0: float, t1: float, timed: bool, chunk_rows=None) -> None:
        """Records `rows` (the first of them step `first_step`), run between t0 and t1; when only
        the first rows of a chunk are kept, `chunk_rows` is the chunk's length (its time per step)."""
        names = self.program.metric_names or []
        n = len(rows)
        if not n:
            return
        per_step = (t1 - t0) / (chunk_rows or n)
        if not timed:
            rates = [float("nan")] * n
        elif self.executor.rate_window_seconds:
            rates = [self._windowed_rate(rows, t1)] * n
        else:  # each step's batch over its share of the chunk's time
            rates = list(rows[:, -1] / per_step)
        extra = self.executor.extra_columns()
        out = []
        for i in range(n):
            row = {
                "step": first_step + i,  # the program's; wb.Run counts from the run's start
                "wall_time": t0 + per_step * (i + 1),
                "examples_per_sec": rates[i],
                "examples": float(rows[i, -1]),  # this step's global batch (run_stats' examples/s)
                **extra,
            }
            for j, metric in enumerate(names):
                value = float(rows[i, j])
                summed = self.reduce.get(metric, "mean") == "sum"
                row[metric] = value if summed else value / self.executor.replicas_per_step
            out.append(row)
        self.run.record_rows(out)

    def _windowed_rate(self, rows, t1: float) -> float:
        """Examples/s over the last `rate_window_seconds` of results: they return in bursts
        (several async workers finish together), so one chunk's own time says little."""
        examples = float(rows[:, -1].sum())
        window = self.executor.rate_window_seconds
        self.recent.append((t1, examples))
        while len(self.recent) > 2 and t1 - self.recent[1][0] >= window:
            self.recent.popleft()
        span = t1 - self.recent[0][0]
        if len(self.recent) < 2 or span <= 0:
            return float("nan")
        return sum(e for _, e in list(self.recent)[1:]) / span

    def _save(self, final: bool = False, failing: bool = False) -> None:
        if not self.saver:
            return
        try:
            # A periodic save is written on the saver's thread while training goes on; its event
            # comes once it is whole (a heal resumes from what the events name). The final one is
            # written here, after any still being written.
            path = self.saver.save(background=not final, on_saved=self._saved_in_background)
        except BaseException as error:  # noqa: BLE001
            if failing:  # the run is failing already: its own error is the one to show
                self.run.publish(
                    "message", text=f"the checkpoint could not be saved: {type(error).__name__}: {error}"
                )
                return
            raise self.executor.explain(error) from None
        if path:
            self.run.publish("checkpoint", path=path, final=final)

    def _saved_in_background(self, path: str) -> None:
        self.run.publish("checkpoint", path=path, final=False)
