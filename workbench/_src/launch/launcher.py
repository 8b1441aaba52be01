"""The launcher: a process backend's runs seen from the notebook (or script) that starts them.

A process backend (multi-worker, async-ps) with no cluster given is, in the notebook, a
RemoteReplicator (backends/remote.py) holding a Launcher. Nothing TensorFlow-distributed happens
in this process: the launcher takes a pool for the run (launch/pool.py: a warm one of the same
shape, or one placed now, locally or on Ray), hands it the work, and a Watch (launch/watch.py)
relays the events of the chief's run into a wb.Run here (so the live dashboard, the run store and
the JupyterLab sidebar work unchanged), notices deaths, freezes and stalls, and stops every
process whatever happens. The backend's LaunchPlan says which processes to start; the rest is
the same for every backend and every placement.
"""

from __future__ import annotations

import contextlib

from workbench._src.core.checkpoints import checkpoint_hint
from workbench._src.core.errors import CapacityError, WorkerError
from workbench._src.core.run_loop import drive, new_run
from workbench._src.core.run_options import options_from
from workbench._src.launch import pool as pools
from workbench._src.launch import shipping, start_progress
from workbench._src.launch.elastic import Elastic
from workbench._src.launch.heal import Healing, preempted_member_name
from workbench._src.launch.placement import Task
from workbench._src.launch.watch import Watch, task_order

__all__ = ["Launcher", "Task", "task_order"]


class Launcher:
    """Starts, follows and stops the processes of one backend's local runs.

    Args:
      backend: the backend's name (process labels, messages).
      plan: its LaunchPlan: the members' roles and environments (placed by launch/placement.py),
        `startup_timeout`, `heartbeat_timeout`.
    """

    def __init__(self, backend: str, plan):
        self.backend = backend
        self.plan = plan
        self.last_processes: list[dict] = []  # role/index/pid of every process of the last launch
        self.pool = None  # the pool of the last launch (launch/pool.py)
        self.healing = None  # the heals of the run going on (launch/heal.py)
        self.elastic = None  # its worker count, when it may change (launch/elastic.py)

    @property
    def startup_timeout(self) -> float:
        return self.plan.launch_timeout

    @property
    def heartbeat_timeout(self) -> float:
        return self.plan.heartbeat_timeout

    # ----- a launched run -------------------------------------------------------------------
    def train(self, replicator, work, steps, options: dict, local_variables):
        """Trains `work` (a shipping.TrainWork) in the processes; returns the notebook's wb.Run
        (configured from `replicator`), with the chief's events relayed into it. The chief's
        trained weights come back into `local_variables` (the variables a cell made here)."""
        opts = options_from(steps, options)
        run = new_run(replicator, work.step_fn, work.input_fn, opts)
        elastic = Elastic(self.plan, run, opts, replicator)  # (checks min_workers against opts)
        healing = Healing(run, opts, opts.for_workers())
        healing.elastic = elastic
        work.steps = steps

        def attempt(run):
            """One launch of the run; with max_restarts, a lost or preempted member heals it;
            with min_workers, a pool the cluster has no room for is tried with fewer workers."""
            while True:
                work.options = dict(healing.options)
                try:
                    results = self.launch(work, run, plan=elastic.plan)
                except CapacityError as error:
                    if elastic.shrink(error):
                        continue  # (nothing of the pool was placed: no restart is used)
                    raise
                except WorkerError as error:
                    if healing.lost_member(error):
                        healing.heal(error.task, error.cause)
                        continue  # (the failed pool was retired: the next launch starts a new one)
                    if healing.scratch is None and "checkpoint" not in error.args[0]:
                        # (an async coordinator's names it already; a temporary one is gone)
                        saved = [e.data.get("path") for e in run.events if e.kind == "checkpoint"]
                        error.args = (error.args[0] + checkpoint_hint(saved[-1] if saved else None),)
                    raise
                chief = results[self.chief]
                if elastic.growing and chief["status"] == "preempted" and not run.stop_requested:
                    healing.resume_latest()  # (from the save every member made when asked)
                    elastic.grow()
                    continue
                if healing.preempted_member(chief):
                    self.shutdown()  # the preempted member's machine is going away: new processes
                    healing.heal(preempted_member_name(chief["reason"]), "preempted (SIGTERM)")
                    continue
                return chief

        def body(run):
            self.healing = healing
            self.elastic = elastic if elastic.enabled else None
            try:
                chief = attempt(run)
            finally:
                self.healing = self.elastic = None
                healing.close()
            run.compile_seconds = chief.get("compile_seconds")
            startup = getattr(run, "startup", None)
            if startup is not None:  # the rest of the start, measured in the chief
                startup["build"] = round(chief.get("build_seconds") or 0.0, 3)
                startup["first trace"] = round(chief.get("compile_seconds") or 0.0, 3)
            if chief.get("executed_steps") is not None:
                run.executed_steps = chief["executed_steps"]
            status, reason = chief["status"], chief["reason"]
            if status == "stopped" and run._interrupted and reason:
                reason = reason.replace("stopped at", "interrupted at", 1)
            if local_variables and chief.get("weights"):
                shipping.load_weights(local_variables, chief["weights"], run)
            return status, reason

        return drive(run, body, opts.background, opts.on_nonfinite)

    def launch(self, work, run=None, timeout: float | None = None, plan=None) -> dict:
        """Hands `work` to the processes of a pool (a warm one of the same shape, or one started
        now), follows them to the end; returns task -> result. A run that ended cleanly leaves
        the pool warm for the next; anything else retires it (launch/pool.py). `plan`: another
        worker count of this plan (an elastic run's)."""
        payload = shipping.dumps_for_workers(work)
        # What a placement's start does (a Ray instance's head and node, its actors k/N) is said
        # in the run while it does it (launch/start_progress.py): the cell, the sidebar, the CLI.
        with _start_said_in(run):
            pool, notes = pools.checkout(self.backend, plan or self.plan)
        self.pool = pool
        for note in notes:
            if run is not None:
                run.publish("message", text=note)
        self.chief = pool.tasks[0].name  # whose run events and result are the run's
        watch = Watch(self, pool, run, payload, timeout)
        healthy, reason = False, ""
        try:
            if not pool.fresh:
                pool.send_work(payload, watch.number)
            elif not pool.started_in_background:  # (if it was, its processes' hellos are queued)
                if run is not None:  # (the cell and the sidebar say it until the processes are up)
                    run.publish("message", text=_starting_text(self.backend, pool))
                with _start_said_in(run):
                    pool.start()
            pool.runs += 1
            self.last_processes = pool.processes
            if run is not None:
                run.processes = self.last_processes  # the same list: a coordinator's servers join it
            results = watch.follow()
            healthy = True
            return results
        except BaseException as error:
            reason = (
                f"the last run failed: {str(error).splitlines()[0][:120]}"
                if str(error)
                else "the last run failed"
            )
            raise
        finally:
            # A run can finish with a member gone (async-ps survives a dead worker): that pool
            # is not whole any more, so it is not kept either.
            lost = pool.dead_member() if healthy else ""
            pools.checkin(
                pool, healthy and not lost, reason or (f"{lost} during the last run" if lost else "")
            )

    def prestart(self) -> bool:
        """Starts this plan's pool in the background (launch/pool.py `prestart`)."""
        return pools.prestart(self.backend, self.plan)

    def shutdown(self) -> None:
        """Ends this plan's warm pool (an idle one now; a busy one when its run ends), and the
        last one it ran on when that had fewer workers (an elastic run's)."""
        pools.shutdown(self.plan.shape())
        if self.pool is not None and self.pool.shape != self.plan.shape():
            pools.shutdown(self.pool.shape)


def _starting_text(backend: str, pool) -> str:
    """'starting 3 multi-worker processes (each imports TensorFlow, then they form the cluster)':
    every process of the pool (async-ps: 4 for a coordinator that starts 2 workers and 1 ps)."""
    count = pool.process_count
    on = " on Ray" if type(pool.placement).__name__.startswith("Ray") else ""
    return f"starting {count} {backend} process{'es' if count != 1 else ''}{on} (each imports TensorFlow, then they form the cluster)"


def _start_said_in(run):
    """A start's progress lines become the run's "message" events (without a run, they are kept
    for the next run that listens)."""
    if run is None:
        return contextlib.nullcontext()
    return start_progress.listening(lambda text: run.publish("message", text=text))
