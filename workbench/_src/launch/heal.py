"""Runs that heal themselves: `max_restarts` for runs on worker processes.

When a member of the pool is lost (killed, frozen, its host gone) or preempted (SIGTERM), the
run does not end: the launcher retires the pool, starts a whole new one, and the run resumes from
its latest checkpoint (core/resume.py makes that exact: the input's position and the run's goal
are in it). The notebook's Run goes on: its history is rewound to the checkpoint's step, so the
stretch lost with the member is re-run, not duplicated, and `run.restarts` gets one dict per heal.
Both go by each row's global step (the program's, which a checkpoint keeps): a row's step in the
run is its global step past the run's first, whichever attempt ran it.

Why a whole new pool rather than one new member: under MultiWorkerMirroredStrategy a survivor
cannot run collectives again after a peer is lost (its collective runtime is aborted: NOTES.md),
and an async-ps cluster that lost its parameter server has lost its variables; both need new
processes. Ray Train's FailureConfig does the same (tear down the worker group, resume from the
last checkpoint). The fork server makes the new processes cheap (TensorFlow is imported once).
With `min_workers`, a new pool the cluster has no room for is launched with fewer workers
(launch/elastic.py); the heal's record then says how many it went on with.

Without checkpoint_dir, a temporary folder holds the checkpoints and is removed when the run
ends (or, if this process was killed, by the next process that makes such a folder); without
checkpoint_every, the run saves every HEAL_CHECKPOINT_EVERY steps (and at its start, so a member
lost before the first periodic save resumes from the start, not from whatever the cell builds
again).
"""

from __future__ import annotations

import os
import re
import shutil
import time

from workbench._src.core.errors import WorkerError
from workbench._src.core.owned_folders import owned_folder
from workbench._src.core.run_stats import heal_line

# How often a healing run saves when checkpoint_every is not given: a lost member costs at most
# this many steps again. A save takes 15-30 ms for a small model here (bench/bench_heal.py): on
# a toy model stepping 1,000 times a second that is a quarter of its time; on a real model
# (0.1 s a step) 0.3%. Give checkpoint_every so that saves are seconds apart.
HEAL_CHECKPOINT_EVERY = 100
_PREEMPTED_MEMBER = re.compile(r"SIGTERM to (\w+ \d+)|(\w+ \d+) was preempted")
_CHECKPOINT_NUMBER = re.compile(r"ckpt-(\d+)$")


class Healing:
    """The heals of one launched run: what each attempt is told, when to heal, and the record."""

    def __init__(self, run, opts, worker_options: dict):
        self.run = run
        self.left = opts.max_restarts
        self.scratch = None
        self.options = dict(worker_options)
        if self.left:
            if not self.options.get("checkpoint_dir"):
                # (named after this process: a killed launcher's goes at the next start of one)
                self.scratch = owned_folder("workbench-heal-")
                self.options["checkpoint_dir"] = self.scratch
            self.options["checkpoint_every"] = self.options.get("checkpoint_every") or HEAL_CHECKPOINT_EVERY
        self.elastic = None  # an elastic run's worker counts (launch/elastic.py), set by the launcher
        # The global step before the run's first row: a row's step is its global step past it,
        # in every attempt (a healed one resumes mid-run). Set by the first attempt's "started".
        self.first_global: int | None = None
        self.continued = False  # the next attempts continue this run (a heal, an elastic grow)
        self._waiting: tuple[float, dict] | None = None  # (when healing began, its record)

    # ----- deciding -----------------------------------------------------------------------------
    def lost_member(self, error: BaseException) -> bool:
        """True when `error` is a lost member this run may still heal from."""
        return (
            self.left > 0
            and isinstance(error, WorkerError)
            and error.cause is not None
            and not self.run.stop_requested
        )

    def preempted_member(self, result: dict) -> bool:
        """True when a member (not this process) was preempted and the run may heal from it."""
        return self.left > 0 and result.get("status") == "preempted" and not self.run._preempted

    # ----- healing ------------------------------------------------------------------------------
    def heal(self, member: str | None, cause: str) -> None:
        """Rewinds the run to its latest checkpoint and records the heal; the next attempt resumes
        there (the caller starts it on a new pool)."""
        run = self.run
        self.left -= 1
        lost_at = run.steps
        global_step = self._latest_checkpoint()
        record = {
            "member": member or "a member",
            "cause": cause,
            "step": global_step,  # the checkpoint's (global) step the run resumes from
            "seconds": None,  # from the loss being known to the next step recorded
            "lost_at": lost_at,  # the run's step when the member was lost
        }
        if self.elastic is not None and self.elastic.enabled:
            record["workers"] = None  # the count it went on with, once its rows arrive
        run.restarts.append(record)
        self._resume_from(global_step, record)
        self._waiting = (time.monotonic(), record)

    def resume_latest(self) -> int | None:
        """The next attempt resumes from the latest checkpoint, without a heal (an elastic run
        growing back, from the save its members made when asked). Returns its global step."""
        global_step = self._latest_checkpoint()
        self._resume_from(global_step, None)
        return global_step

    def _resume_from(self, global_step: int | None, record: dict | None) -> None:
        run = self.run
        run_step = run._rewind(global_step)
        if record is not None:
            run.publish("restart", run_step=run_step, snapshot=run.snapshot, **record)  # (rewound)
        self.continued = True
        if global_step is not None:  # a checkpoint of this run exists: the next attempt resumes it
            self.options["resume"] = self._resume_option(global_step)
        else:  # the next attempt starts the run anew: its "started" says where it begins
            self.first_global = None
        self.options["warmup"] = 0  # (the first attempt's warm-up steps are in the checkpoint)

    def step_of(self, row: dict) -> dict:
        """A relayed row with its step in the run: its global step past the run's first."""
        if self.first_global is None or row.get("global_step") is None:
            return row
        return {**row, "step": int(row["global_step"]) - self.first_global}

    def rows_arrived(self) -> None:
        """Called as the healed attempt's first rows come in: the heal is over; say it once."""
        if self._waiting is None:
            return
        began, record = self._waiting
        self._waiting = None
        record["seconds"] = round(time.monotonic() - began, 2)
        if "workers" in record:  # an elastic run: how many workers it went on with, of how many
            record["workers"], record["of_workers"] = self.elastic.workers, self.elastic.full.num_workers
        self.run.publish("message", text=heal_line(record, self.run.restarts))

    def _latest_checkpoint(self) -> int | None:
        """The global step of this run's latest checkpoint (the last one its events name), or None."""
        saved = [e.data.get("path") or "" for e in self.run.events if e.kind == "checkpoint"]
        numbers = [int(m.group(1)) for m in map(_CHECKPOINT_NUMBER.search, saved) if m]
        return numbers[-1] if numbers else None

    def _resume_option(self, global_step: int) -> int | bool:
        """What the next attempt restores: the checkpoint of `global_step`, the last one this
        process heard of and the step its history is rewound to. Not the latest in the folder: a
        lost member may have saved later ones whose rows never arrived (on a loaded machine the
        rows trail the members' saves). The latest where that checkpoint is not to be seen from
        here (a folder on the members' hosts only), or was removed since (only the last few are
        kept)."""
        path = os.path.join(self.options["checkpoint_dir"], f"ckpt-{global_step}")  # (where it is restored from)
        if os.path.exists(path + ".index"):
            return global_step
        self.run.publish(
            "message",
            text=f"the checkpoint of step {global_step} is not to be seen from here ({path}): the run "
            "resumes from the latest one in its folder; if that is a later one, the steps between have "
            "no rows in its history",
        )
        return True

    def close(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None


def replaced_in_run(run, pool, processes: list[dict], data: dict) -> None:
    """An async-ps worker the coordinator replaced while the others went on (its "restart" event,
    backends/async_coordinator.py): a heal in the notebook's Run with nothing rewound, and the new
    server a process of the pool and of the run, so the pool is whole again and stays warm."""
    record = {k: v for k, v in data.items() if k not in ("run_step", "snapshot", "process")}
    run.restarts.append(record)
    run.publish("restart", run_step=run.steps, snapshot=run.snapshot, **record)
    new = data.get("process")
    if new:
        pool.extra[:] = [p for p in pool.extra if (p["role"], p["index"]) != (new["role"], new["index"])]
        pool.extra.append(new)
        processes.append(new)


def preempted_member_name(reason: str | None) -> str | None:
    """'worker 1' from a preempted run's reason ("(SIGTERM to worker 1)", "(worker 1 was preempted)")."""
    found = _PREEMPTED_MEMBER.search(reason or "")
    return (found.group(1) or found.group(2)) if found else None
