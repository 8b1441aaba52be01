"""run.breakdown(): where each step's time goes, per worker, and one sentence on what to do.

Every timed chunk of the fused loop brings back four clock readings per step (step_clock.py).
Together with the host's own clock around the call they tile the chunk's time:

  other   the run loop between chunks (recording rows, sinks, the chunk agreement), dispatching
          the compiled call and fetching its results, and the fused loop's bookkeeping between a
          step's end and the next step's call to the iterator
  input   from that call (or the previous step's end, when the call came earlier) until the
          batch is ready: waiting for input_fn's pipeline
  compute the rest of the step, less the collectives: step_fn's own work
  communication  the collectives step_fn issued (gradient all-reduce, repl.all_sum, ...) and the
          metric reduction, peers' delays included

so the parts add up to the measured time per step (`step`) up to the two clocks' agreement.
A run of up to EVERY_STEP_UP_TO steps times every step; a longer one about a fifth of them
(SAMPLE_SHARE: whole chunks, the first one after tracing always). Figures are seconds per step
over about the last WINDOW_STEPS timed steps of one worker; each worker publishes its row as a
"breakdown" event (a launched run relays every worker's).
"""

from __future__ import annotations

import collections
import time

import numpy as np

PARTS = ("input", "compute", "communication", "other")
COLUMNS = (*PARTS, "step", "steps")
WINDOW_STEPS = 2000  # the breakdown follows the run's present, not its start
# The share of steps whose chunk reads the clock: a sample, so the readings' cost (a few
# microseconds per step) is a fifth of itself; the first chunk after tracing is always one.
SAMPLE_SHARE = 0.2
# A run of at most this many steps reads the clock in every step and never runs the untimed
# variant of the loop. The readings cost up to ~50 us a step (4% of the 1-ms steps of
# bench/bench_breakdown.py's digits MLP, the worst case; a sampled run pays a fifth of that); the
# second variant costs its trace, its instantiation (~0.1 s for that model) and, in a warm pool,
# the native memory TensorFlow's collective runtime keeps for every function that ran
# collectives, run after run (decision 19: 1.2 points of a worker's growth over 90 runs). So up
# to ~2,000 steps every reading costs less; this keeps on the safe side of that. Lower it if
# the readings get dearer (bench_breakdown with --steps at most this many prints them).
EVERY_STEP_UP_TO = 1_000
PUBLISH_EVERY = 1.0  # seconds between a worker's breakdown events (the last one always goes)


def chunk_parts(began: float, ended: float, previous_end: float | None, marks) -> dict:
    """Seconds spent in each part over one chunk (not per step), and its step count.

    began/ended: the host clock (time.time) around the compiled call; previous_end: when the
    previous call ended (None: the time between calls is not known and left out); marks: the
    chunk's [steps, 4] readings (begin, ready, end, comm) in seconds.
    """
    marks = np.asarray(marks, dtype=np.float64)
    begin, ready, end, comm = marks[:, 0], marks[:, 1], marks[:, 2], marks[:, 3]
    # Steps tile the chunk end to end (the next step's iterator call overlaps the previous
    # step's tail, step_clock.py): each from the previous step's end (the first: its begin).
    previous = np.concatenate([begin[:1], end[:-1]])
    span = np.maximum(end - previous, 0.0)
    # The loop's bookkeeping before a step asks for its batch (when it did not ask early) is
    # not waiting for input: `other`.
    bookkeeping = np.clip(begin - previous, 0.0, span)
    waiting = np.clip(ready - np.maximum(begin, previous), 0.0, span - bookkeeping)
    communication = np.clip(comm, 0.0, span - bookkeeping - waiting)
    between_calls = began - previous_end if previous_end is not None else 0.0
    outside = (begin[0] - began) + (ended - end[-1])  # dispatch and fetch around the loop
    return {
        "input": float(np.sum(waiting)),
        "compute": float(np.sum(span - bookkeeping - waiting - communication)),
        "communication": float(np.sum(communication)),
        "other": float(max(0.0, between_calls + outside + np.sum(bookkeeping))),
        "step": (ended - began) + between_calls,  # the host's measure of the same time
        "steps": len(marks),
    }


class BreakdownRecorder:
    """One worker's breakdown: fed each chunk by the executor, publishes its row on the run."""

    def __init__(self, run, worker: int = 0):
        self.run = run
        self.worker = worker
        self.chunks: collections.deque = collections.deque()
        self.window_steps = 0
        self.previous_end: float | None = None
        self.seen_steps = 0  # steps of every chunk after tracing
        self.sampled_steps = 0  # of those, the steps of timed chunks
        self.published_at = 0.0
        self.unpublished = False
        self.collective_bytes = 0  # per replica and step (step_clock.CollectiveTimer.bytes)
        # (every worker of a run reads the same goal: they agree on it, as their chunks must)
        goal = run.config.get("steps")
        self.every_step = isinstance(goal, int) and goal <= EVERY_STEP_UP_TO

    def run_chunk(self, program, k: int):
        """Runs a chunk of `program` (timed when the sample wants one) and records it."""
        # A sampled run's first call compiles (untimed; it traces the timed variant too:
        # Program.run_fused); a variant's first run instantiates it: neither is a step's time.
        timed = self.every_step or (bool(program.traced_variants) and self.wants_sample())
        traces = timed not in program.executed_variants
        began = time.time()  # the wall clock, as the loop's tf.timestamp readings
        result = program.run_fused(k, timed=timed, trace_other=not self.every_step)
        self.chunk(began, time.time(), result[1], program.last_marks, traced=traces)
        self.collective_bytes = program.collective_bytes
        return result

    def wants_sample(self) -> bool:
        """Whether the next chunk should read the clock (keeps timed steps near SAMPLE_SHARE)."""
        return self.sampled_steps <= SAMPLE_SHARE * self.seen_steps

    def chunk(self, began: float, ended: float, steps: int, marks, traced: bool) -> None:
        """A chunk of `steps` ran between began and ended (time.time); marks: its clock readings
        (None: not a timed chunk); `traced`: its call compiled or instantiated the loop."""
        previous, self.previous_end = self.previous_end, ended
        if traced:
            # Tracing is not a step's time (run.compile_seconds has it), and neither is the run
            # loop's first bookkeeping after it: the next chunk's time between calls is left out.
            self.previous_end = None
            return
        self.seen_steps += steps
        if marks is None or not len(marks):
            return
        self.sampled_steps += len(marks)
        self.chunks.append(chunk_parts(began, ended, previous, marks))
        self.window_steps += len(marks)
        while self.window_steps - self.chunks[0]["steps"] >= WINDOW_STEPS:
            self.window_steps -= self.chunks.popleft()["steps"]
        self.unpublished = True
        if time.monotonic() - self.published_at >= PUBLISH_EVERY:
            self.publish()

    def row(self) -> dict | None:
        """Seconds per step of each part over the window, `step`, `steps`, `worker`."""
        steps = sum(c["steps"] for c in self.chunks)
        if not steps:
            return None
        row = {"worker": self.worker}
        for key in (*PARTS, "step"):
            row[key] = sum(c[key] for c in self.chunks) / steps
        row["steps"] = steps
        row["collective_bytes"] = self.collective_bytes
        return row

    def publish(self) -> None:
        row = self.row()
        self.published_at = time.monotonic()
        self.unpublished = False
        if row is not None:
            self.run.record_breakdown(row)

    def close(self) -> None:
        if self.unpublished:
            self.publish()


def rows_diagnosis(rows: list[dict], backend: str | None) -> str:
    """run.diagnosis(): the sentence for a run of `backend` (async backends: parameter servers)."""
    from workbench._src.core.registry import spec

    try:
        asynchronous = not spec(backend).synchronous
    except Exception:  # noqa: BLE001 - a backend this process does not know: say all-reduce
        asynchronous = False
    return diagnosis(rows, asynchronous=asynchronous)


def frame(rows: list[dict], backend: str | None = None):
    """The DataFrame run.breakdown() returns: one row per worker (index `worker`);
    `.attrs["diagnosis"]` is the sentence, `.attrs["collective_bytes"]` the forecast's bytes."""
    import pandas as pd

    table = pd.DataFrame(
        [{k: r.get(k) for k in ("worker", *COLUMNS)} for r in rows], columns=["worker", *COLUMNS]
    )
    table = table.set_index("worker")
    table.attrs["diagnosis"] = rows_diagnosis(rows, backend)
    # what a step's collectives carry per replica (the gradients): the forecast's message size
    table.attrs["collective_bytes"] = max((r.get("collective_bytes") or 0 for r in rows), default=0)
    return table


def shares(row: dict) -> dict:
    """Each part's share of the row's parts (they add up to 1)."""
    total = sum(max(0.0, row.get(k) or 0.0) for k in PARTS)
    return {k: (max(0.0, row.get(k) or 0.0) / total if total else 0.0) for k in PARTS}


FIXES = {
    "input": (
        "input-bound: {share:.0%} of each step waits for input_fn; add .prefetch(tf.data.AUTOTUNE), "
        "num_parallel_calls=tf.data.AUTOTUNE in its map calls, or .cache() what does not change"
    ),
    "compute": (
        "compute-bound: {share:.0%} of each step is step_fn's own work; more replicas, or faster "
        "devices, are what speed it up"
    ),
    "communication": (
        "communication-bound: {share:.0%} in {what} (waiting for peers included); larger batches "
        "per worker, or fewer, larger workers"
    ),
    "other": (
        "overhead-bound: {share:.0%} of each step is host and Python overhead outside the step; "
        "more work per step (a larger batch) or more steps per call (steps_per_execution)"
    ),
}


def diagnosis(rows: list[dict], asynchronous: bool = False) -> str:
    """One sentence: the part that dominates (over all workers) and its likely fix, and the
    slowest worker when it holds the others back."""
    rows = [r for r in rows if r and r.get("step")]
    if not rows:
        return ""
    total = {k: sum(r.get(k) or 0.0 for r in rows) for k in PARTS}
    share = shares(total)
    top = max(PARTS, key=share.get)
    what = "parameter-server traffic" if asynchronous else "all-reduce"
    sentence = FIXES[top].format(share=share[top], what=what)
    if share[top] < 0.5:
        ranked = sorted(PARTS, key=share.get, reverse=True)
        sentence = "mixed (no part takes half a step): " + ", ".join(f"{k} {share[k]:.0%}" for k in ranked)
    slow = slowest_worker(rows)
    if slow is not None:
        sentence += f"; {slow}"
    return sentence


def slowest_worker(rows: list[dict], margin: float = 1.2) -> str | None:
    """'worker 1 holds the others back (...)' when one worker's own time per step (all but
    communication, where the others wait for it) is `margin` times the others' median."""
    if len(rows) < 2:
        return None
    own = {r["worker"]: r["step"] - (r.get("communication") or 0.0) for r in rows}
    worst = max(own, key=own.get)
    others = sorted(v for w, v in own.items() if w != worst)
    median = others[len(others) // 2]
    if median <= 0 or own[worst] < margin * median:
        return None
    row = next(r for r in rows if r["worker"] == worst)
    part = max(("input", "compute", "other"), key=lambda k: row.get(k) or 0.0)
    return (
        f"worker {worst} holds the others back: its own work takes {own[worst] / median:.1f}x the "
        f"others' ({part} {row[part] * 1e3:.1f} ms per step)"
    )
