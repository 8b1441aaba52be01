"""Following one launch: hand out the work, relay the chief's events into the notebook's Run,
notice deaths, freezes and stalls, and name the culprit rather than a witness.

Written once against the placement's interface (launch/placement.py): the members (`group`),
the link to them (`channel`), and each member's pid, exit, log and CPU time.
"""

from __future__ import annotations

import queue
import time

from workbench._src.core import errors as workbench_errors
from workbench._src.core.errors import WorkerError
from workbench._src.core.tf_messages import unhealthy_task
from workbench._src.core.tracebacks import frames_named, full_tracebacks, heartbeat_stack, work_stack
from workbench._src.launch.heal import replaced_in_run
from workbench._src.launch.liveness import BUSY_SILENCE_LIMIT, Liveness
from workbench._src.launch.start_progress import StartDeadline, phase_text, startup_phases

# After a member reports an error, how long the watch collects the others' reports and the
# process table before it names a culprit: a witness's report arrives first, the culprit's death
# or silence within a moment. It bounds how long a failure takes to be said; it must exceed the
# time a dead member's exit takes to show in the process table.
WITNESS_WINDOW = 0.7
# The same when a member's exit is seen first: the reports of the members it took down.
EXIT_WINDOW = 0.5
# A member silent this long when another reports a collective failure is the culprit (a frozen
# peer): four heartbeats missed. Shorter would blame a member whose heartbeat is merely queued.
PEER_SILENCE = 2.0
# After a member's link closes, how long to wait for its exit status, so the error says how it
# ended ("killed by SIGKILL"): a status is there within milliseconds unless the machine is starved.
EXIT_STATUS_WAIT = 0.3
# TensorFlow's errors for a collective whose peer is gone (host down, link cut), when no process
# of ours was seen to die: a member lost, not a mistake in the run's code.
_PEER_LOST_ERRORS = ("UnavailableError", "AbortedError", "DeadlineExceededError")
# After such an error, how many heartbeat periods of silence the watch waits for before it names
# a peer as lost: a peer on another node (a raylet killed, a link cut) falls silent at once, but
# its silence shows only after PEER_SILENCE. The wait ends early when a peer is reported dead or
# falls silent; it bounds how long a collective failure with every peer alive takes to be said.
PEER_LOST_WAIT = 3 * PEER_SILENCE


class Watch:
    """Follows one launch: hands out work, relays events, notices deaths, freezes and stalls."""

    def __init__(self, launcher, pool, run, payload, timeout):
        self.launcher, self.pool, self.run = launcher, pool, run
        self.group, self.channel = pool.group, pool.channel
        self.payload, self.timeout = payload, timeout
        self.tasks = [t.name for t in pool.tasks]
        self.chief = self.tasks[0]
        self.heard: dict[str, float] = {}
        self.liveness = Liveness(launcher.heartbeat_timeout)  # (what late heartbeats mean)
        self.ready: set[str] = set()
        self.results: dict = {}
        self.stop_sent = False
        self.started = time.monotonic()
        self.started_wall = time.time()  # the processes report wall-clock milestones
        self.start_deadline = StartDeadline(launcher.startup_timeout, launcher.heartbeat_timeout)
        self.phases: dict[str, dict] = {}
        self.warm = not pool.fresh
        # A pool started in the background when its backend was chosen: its start's phases
        # count from then, and the wait is what was left of it when the run asked.
        self.ahead = (
            self.started_wall - pool.started_at if pool.started_in_background and not self.warm else 0.0
        )
        self.number = pool.runs + 1  # this run's number in the pool: its stop requests carry it
        if self.warm:  # connected long ago: their heartbeats count from now
            self.heard = {task: self.started for task in self.tasks}

    def follow(self) -> dict:
        while len(self.results) < len(self.tasks):
            try:
                task, message = self.channel.messages.get(timeout=0.1)
                while True:  # every message that waits, before silences are judged: this thread
                    self._handle(task, message)  # may itself have been held up on a busy machine
                    if len(self.results) == len(self.tasks):
                        break
                    task, message = self.channel.messages.get_nowait()
            except queue.Empty:
                pass
            self._check()
        return self.results

    def _handle(self, task: str, message: dict) -> None:
        kind = message.get("type")
        self.heard[task] = time.monotonic()
        if kind == "hello":
            # "last": a pool that is not kept (pool=False) runs one work item and exits, the
            # path from before pools.
            work = {"type": "work", "payload": self.payload, "run": self.number, "last": not self.pool.keep}
            self.channel.send(task, work)
            if self.stop_sent:  # a stop asked for before this process connected
                self.channel.send(task, self._stop_message())
        elif kind == "ready":
            self.ready.add(task)
            self.phases[task] = message.get("phases") or {}
            if len(self.ready) == len(self.tasks) and self.run is not None:
                seconds = time.monotonic() - self.started
                self.run.startup_seconds = seconds
                self.run.startup = startup_phases(
                    self.phases.values(), self.started_wall, self.warm, ahead=self.ahead
                )
                backend, phases = self.launcher.backend, phase_text(self.run.startup)
                if self.warm:
                    text = f"{backend} warm pool (run {self.pool.runs}) ready in {seconds:.1f} s"
                elif self.ahead:
                    self.run.startup["in background"] = round(self.ahead, 3)
                    text = (
                        f"{backend} processes ready in {seconds:.1f} s (started in the background "
                        f"{self.ahead:.1f} s before this run: {phases})"
                    )
                else:
                    text = f"{backend} processes ready in {seconds:.1f} s ({phases})"
                self.run.publish("message", text=text)
        elif kind == "processes":  # what a coordinator started itself (async-ps servers)
            self._child(task).own_pids = [c["pid"] for c in message["children"]]  # (its start counts theirs)
            self.pool.extra.extend(message["children"])  # (a warm pool's runs list them too)
            self.launcher.last_processes.extend(message["children"])
        elif kind == "event":
            self._relay(task, message)
        elif kind == "result":  # its work is delivered: however it exits now, it is not a fault
            self.results[task] = message["value"]
            self._child(task).expected_exit = True
        elif kind == "error":
            self._fail_after_error(task, message)
        elif kind == "disconnected" and task not in self.results:
            time.sleep(EXIT_STATUS_WAIT)
            self._check()

    def _relay(self, task: str, message: dict) -> None:
        run, event_kind, data = self.run, message["kind"], message["data"]
        if data.get("worker_unreachable") is not None:  # the pool is not whole any more
            self.pool.lost = self.pool.lost or f"worker {data['worker_unreachable']} (unreachable)"
        if run is None:
            return
        if event_kind == "breakdown":  # every worker's own: one row each in run.breakdown()
            for row in data.get("rows", ()):
                run.record_breakdown(row)
            return
        if task != self.chief:  # every worker computes the same reduced metrics: the chief's suffice
            if event_kind == "message":
                run.publish("message", text=f"{_label(task)}: {data.get('text')}")
            return
        if event_kind == "metrics":
            healing = self.launcher.healing
            rows = data["rows"]
            if healing is not None:  # (any attempt: the first one's steps are unchanged by it)
                rows = [healing.step_of(row) for row in rows]
                healing.rows_arrived()
            run.record_rows(rows)
        elif event_kind == "started":
            healing = self.launcher.healing
            if healing is not None and healing.first_global is None:
                healing.first_global = data.get("first_step", 1) - 1
            if run.restarts or (healing is not None and healing.continued):
                return  # a healed or grown attempt: the run started long ago, and its goal stays
            steps = data.get("steps", run.config.get("steps"))
            run.config["steps"] = steps  # (a resumed run that finishes its goal runs fewer)
            run.publish(
                "started", name=run.name, config=run.config, first_step=data.get("first_step", 1), steps=steps
            )
        elif event_kind == "restart" and data.get("replaced"):  # an async-ps worker replaced, no rewind
            replaced_in_run(run, self.pool, self.launcher.last_processes, data)
        elif event_kind in ("checkpoint", "message"):
            run.publish(event_kind, **data)
            elastic = self.launcher.elastic
            if event_kind == "checkpoint" and elastic is not None:  # on fewer workers: room again?
                elastic.at_checkpoint(self.pool, self._ask_to_stop)

    def _ask_to_stop(self, cause: str) -> None:
        """Every member saves at the next step boundary and ends "preempted" (`cause` says why)."""
        self.channel.broadcast({"type": "stop", "run": self.number, "preempt": cause})

    def _check(self) -> None:
        now = time.monotonic()
        dead = self.group.unexpected_exits()
        if dead:
            # A witness that reported the collective failure and exited is not the culprit:
            # collect pending reports first, then prefer a process killed by a signal.
            errors = self._drain_errors(EXIT_WINDOW)
            dead = self.group.unexpected_exits()
            if not dead:
                if errors:
                    self._report_errors(errors)
                return
            child = next((c for c in dead if c.killed), dead[0])
            self._raise(
                f"{_label(f'{child.role}:{child.index}')} ({child.where}) {child.exit_description()}"
                f"{self._at_step()}; every process of the run was stopped.",
                f"{child.role}:{child.index}",
                cause=child.exit_description(),
            )
        timeout = self.launcher.heartbeat_timeout
        for task in self.tasks:
            last = self.heard.get(task)
            if last is None or task in self.results:
                continue
            child = self._child(task)
            silent, idle = now - last, self.liveness.idle_for(task, child, last, now)
            if (idle > timeout or silent > BUSY_SILENCE_LIMIT * timeout) and self.channel.unread(task):
                self.heard[task] = now  # it spoke: its words wait for our reader (a busy launcher)
                continue
            said = self.liveness.silence(task, child, silent, idle)
            if said is not None:
                how, cause = said
                self._raise(
                    f"{_label(task)} ({child.where}) stopped responding: no heartbeat for {silent:.0f} s"
                    f"{how}{self._at_step()}; every process of the run was stopped.",
                    task,
                    cause=cause,
                    stacks=True,
                )
        missing = [t for t in self.tasks if t not in self.ready]
        if missing and self.start_deadline.passed(now, [self._child(t) for t in missing]):
            self._raise(
                f"{', '.join(_label(t) for t in missing)} did not start within "
                f"{self.start_deadline.describe(now)} ({len(self.ready)} of {len(self.tasks)} ready). "
                "Fix: a busy machine needs a longer startup_timeout; otherwise see the log below.",
                missing[0],
            )
        if self.timeout is not None and now - self.started > self.timeout:
            self._raise(f"the workers did not finish within timeout={self.timeout} s.", None)
        if self.run is not None and self.run.stop_requested and not self.stop_sent:
            self.channel.broadcast(self._stop_message())
            self.stop_sent = True

    def _stop_message(self) -> dict:
        """This run's stop; a preemption of this process (SIGTERM to `workbench run`) asks every
        member to save at the next step boundary and end preempted."""
        return {"type": "stop", "run": self.number, "preempt": self.run._preempted if self.run else None}

    def _fail_after_error(self, task: str, message: dict) -> None:
        # A worker whose peer died or froze reports the collective failure first; give the
        # process table, heartbeats and the other workers' reports a moment, then name the
        # culprit rather than the witness.
        self._child(task).expected_exit = True  # it exits after reporting
        errors = {task: message, **self._drain_errors(WITNESS_WINDOW)}
        self._check()  # a worker that died without reporting is the culprit
        if message.get("summary", "").startswith(_PEER_LOST_ERRORS):
            self._await_lost_peer(errors)
        else:
            self._await_chiefs_report(errors)
        unhealthy = unhealthy_task(message.get("summary", ""))
        if unhealthy in self.tasks and unhealthy != task and unhealthy not in errors:
            # TensorFlow's coordination service saw the peer's heartbeats stop before ours did
            # (a busy machine can delay our heartbeats' handling): it names the frozen one.
            self._raise(
                f"{_label(unhealthy)} ({self._child(unhealthy).where}) stopped responding (TensorFlow's "
                f"coordination service stopped hearing from it){self._at_step()}; {_label(task)} then "
                "failed, its collective aborted; every process of the run was stopped.",
                unhealthy,
                cause="stopped responding",
            )
        now = time.monotonic()
        for other in self.tasks:
            silent = now - self.heard.get(other, now)
            if other not in errors and other not in self.results and silent > PEER_SILENCE:
                self._raise(
                    f"{_label(other)} ({self._child(other).where}) stopped responding (no heartbeat "
                    f"for {silent:.0f} s){self._at_step()}; {_label(task)} then failed: "
                    f"{message['summary']}",
                    other,
                    cause=f"no heartbeat for {silent:.0f} s",
                )
        self._report_errors(errors)

    def _await_lost_peer(self, errors: dict) -> None:
        """A collective failed because a peer went away: the peer (its actor's death, Ray's
        report; its silence) is named rather than the member that saw the connection reset.
        Waits up to PEER_LOST_WAIT for a peer to be reported dead (`_check` raises) or silent."""

        def peer_known(now: float) -> bool:
            peers = [t for t in self.tasks if t not in errors and t not in self.results]
            # (a silent peer is named by the caller, with how long it was silent)
            return not peers or any(now - self.heard.get(t, now) > PEER_SILENCE for t in peers)

        self._collect_reports(errors, until=peer_known, seconds=PEER_LOST_WAIT)

    def _await_chiefs_report(self, errors: dict) -> None:
        """A mistake in the run's code is usually made by every worker: the error is reported as
        the first worker's, as an in-process run would raise it, whichever report came first (on
        a loaded machine the chief's may come seconds after a peer's). Waits up to the heartbeat
        timeout for the chief's report; ends early once it reports, finishes, or falls silent
        (a chief that only waits for the failed peer: the peer's error is reported)."""
        first = min(self.tasks, key=task_order)

        def chief_known(now: float) -> bool:
            return first in errors or first in self.results or now - self.heard.get(first, now) > PEER_SILENCE

        self._collect_reports(errors, until=chief_known, seconds=self.launcher.heartbeat_timeout)

    def _collect_reports(self, errors: dict, until, seconds: float) -> None:
        """Adds the members' error reports to `errors` until `until(now)` holds or `seconds` have
        passed, the process table checked between reads (a member found dead is raised)."""
        deadline = time.monotonic() + seconds
        while not until(time.monotonic()) and time.monotonic() < deadline:
            errors.update(self._drain_errors(0.1))
            self._check()

    def _drain_errors(self, seconds: float) -> dict:
        """Reads the channel for `seconds`; returns the error reports (task -> message)."""
        errors = {}
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                task, message = self.channel.messages.get(timeout=0.05)
            except queue.Empty:
                continue
            kind = message.get("type")
            if kind == "error":
                self.heard[task] = time.monotonic()
                errors[task] = message
                self._child(task).expected_exit = True
            elif kind != "disconnected":  # (handling that would check again, from within a check)
                # Everything else as usual: the history up to the failure, and the "result" of a
                # worker that finished cleanly just before the process table showed its exit
                # (dropping what came with it once named a finished worker as the culprit).
                self._handle(task, message)
        return errors

    def _report_errors(self, errors: dict) -> None:
        # The same mistake on every worker: the chief's report. A peer's mistake rather than the
        # collective failure it caused in the others.
        mistakes = {t: e for t, e in errors.items() if not e.get("summary", "").startswith(_PEER_LOST_ERRORS)}
        first = min(mistakes or errors, key=task_order)
        error = errors[first]
        kind = getattr(workbench_errors, error.get("error_class") or "", None)
        if kind is not None and kind is not WorkerError:
            # The user's mistake (a bad cell, a wrong batch): the same error class and message
            # as on an in-process backend, not a wrapper around it; the process named after it.
            raise kind(f"{error['message']}\n(raised in {_label(first)})")
        if kind is WorkerError:  # e.g. the async coordinator lost its parameter server
            raise WorkerError(
                error["message"],
                task=error.get("task") or _label(first),
                cause="its server stopped answering",
            )
        summary = error["summary"]
        if summary.startswith(_PEER_LOST_ERRORS):
            # A collective that failed with no member seen to die: its peer's host or link is gone.
            self._raise(
                f"{_label(first)} failed{self._at_step()}: {summary}\n--- its traceback ---\n"
                f"{_trim_traceback(error.get('traceback', ''))}",
                None,
                cause=summary.split(":")[0],
            )
        # Any other error of the user's code: the process and the cause's own sentence first,
        # then the frames of their code in that process (every frame under WORKBENCH_TRACEBACKS=full).
        full = full_tracebacks() or not error.get("shown")
        shown = frames_named(_trim_traceback(error.get("traceback", "")) if full else error["shown"].strip())
        raise WorkerError(
            f"{_label(first)}: {error.get('cause') or summary}\n--- {_label(first)}'s traceback ---\n"
            f"{shown}\n(The {self.launcher.backend} run failed{self._at_step()}"
            f"{'' if full else '; WORKBENCH_TRACEBACKS=full shows every frame'}.)",
            task=_label(first),
        )

    def _at_step(self) -> str:
        return f" at step {self.run.steps}" if self.run is not None and self.run.steps else ""

    def _child(self, task: str):
        role, index = task.split(":")
        return next((c for c in self.group.children if c.role == role and c.index == int(index)), None)

    def _raise(self, text: str, task: str | None, cause: str | None = None, stacks: bool = False) -> None:
        """Fails the launch; `cause`: how a member was lost (None: no member was lost); `stacks`:
        the member is silent, and where its threads are now says why (asked before it is ended)."""
        log = ""
        if task is not None:
            tail = self._child(task).log_tail()  # (before the stacks, which go to the same log)
            if tail:
                log = f"\n--- last lines of {_label(task)}'s log ---\n{tail}"
            dump = self._child(task).stacks() if stacks else ""
            if where := work_stack(dump):
                log += f"\n--- where {_label(task)}'s work was (most recent call first) ---\n{where}"
            if held := heartbeat_stack(dump):
                log += f"\n--- where its heartbeat was held (most recent call first) ---\n{held}"
        backend = self.launcher.backend
        raise WorkerError(
            f"{backend} run failed: {text}{log}", task=_label(task) if task else None, cause=cause
        )


def task_order(task: str):
    """Workers first, in index order (the chief is worker 0)."""
    role, index = task.split(":")
    return (role != "worker", role, int(index))


def _label(task: str) -> str:
    return task.replace(":", " ")


def _trim_traceback(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
