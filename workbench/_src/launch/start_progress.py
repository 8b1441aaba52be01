"""What a pool's start is doing, said while it does it (issue 39: a Ray start showed ~80 s of
"waiting for the run to start" and nothing else).

A placement's start (a local Ray instance's head and node, its actors k/N) calls `say(text)`.
The launcher listens while it checks out and starts a pool (`listening(callback)`: it publishes
each line as the run's "message" event, which the cell, the sidebar and the CLI's "[workbench]"
lines show). A line said while nobody listens (a pool started in the background by the magic or
the panel, before its run exists) is kept, and the next listener hears it first.

Once the members report ready, `startup_phases` tells how long each phase of the start took.
"""

from __future__ import annotations

import contextlib
import threading
import time

# How many lines said with nobody listening are kept for the next listener: a start says a
# handful; older ones are of a start long over.
KEPT_LINES = 20

_lock = threading.Lock()
_listeners: list = []
_unheard: list[str] = []


def say(text: str) -> None:
    """Tells every listener what the start is doing now (or keeps it for the next one)."""
    with _lock:
        listeners = list(_listeners)
        if not listeners:
            _unheard.append(text)
            del _unheard[:-KEPT_LINES]
    for listener in listeners:
        with contextlib.suppress(Exception):  # a view's failure must not fail the start
            listener(text)


@contextlib.contextmanager
def listening(callback):
    """Calls `callback(text)` for each line a start says while the block runs (from any thread:
    a background start's actors count here too); lines kept from before come first."""
    with _lock:
        kept, _unheard[:] = list(_unheard), []
        _listeners.append(callback)
    for text in kept:
        with contextlib.suppress(Exception):
            callback(text)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(callback)


class Phases:
    """Says each phase of a start as it begins (`now(text)`), and while one lasts, says it again
    every `every` seconds with the seconds spent in it: a wait of unknown length shows it goes on.
    Used as a context manager (a daemon thread repeats the phase while the block runs)."""

    def __init__(self, every: float = 5.0):
        self.every = every
        self.text, self.since = "", time.monotonic()
        self._done = threading.Event()
        self._lock = threading.Lock()

    def now(self, text: str) -> None:
        with self._lock:
            if text == self.text:
                return
            self.text, self.since = text, time.monotonic()
        say(text)

    def _repeat(self) -> None:
        while not self._done.wait(self.every):
            with self._lock:
                text, seconds = self.text, time.monotonic() - self.since
            if text and seconds >= self.every:
                say(f"{text} ({seconds:.0f} s)")

    def __enter__(self) -> Phases:
        threading.Thread(target=self._repeat, name="workbench start progress", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()


PHASES = ("spawn", "imports", "servers", "cluster join", "shipping")


def startup_phases(reports, started_wall: float, warm: bool, ahead: float = 0.0) -> dict:
    """run.startup: seconds per phase of the start, each the slowest process's. A process reports
    wall-clock milestones (worker_main): entered (its interpreter runs our code), imported
    (TensorFlow), servers (its own servers listen: async-ps), joined (the strategy is built),
    unpickled (the work is ready to run). Consecutive milestones, so the phases add up to the
    wait. A warm pool's start is one phase, the hand-off. A pool started in the background
    `ahead` seconds before the run: its phases count from its start, and its processes' wait
    for the run's work is not shipping."""
    if warm:
        return {
            "handoff": round(
                max((r.get("unpickled", started_wall) for r in reports), default=started_wall) - started_wall,
                3,
            )
        }
    marks = ("entered", "imported", "servers", "joined", "unpickled")
    out = dict.fromkeys(PHASES, 0.0)
    for report in reports:
        previous = started_wall - ahead
        for phase, mark in zip(PHASES, marks):
            at = report.get(mark, previous)
            if phase == "shipping":
                previous = max(previous, started_wall)  # (the work exists from the run's start)
            out[phase] = max(out[phase], at - previous)
            previous = at
    return {k: round(v, 3) for k, v in out.items()}


def phase_text(startup: dict) -> str:
    """run.startup as one line: "spawn 1.2 s, imports 3.4 s, ..."."""
    return ", ".join(f"{k} {v:.1f} s" for k, v in startup.items())


# startup_timeout bounds a start that has stopped moving, not a slow one: past it, a start goes
# on while the members not yet ready keep starting (on a busy machine each gets a few percent of
# a core: at load 25-65 two workers importing TensorFlow were 0 of 2 ready after 120 s), and
# fails once they show no progress for one `window`, or at STARVED_START_LIMIT startup_timeouts.
# START_CPU_SHARE: the share of one core that members not yet ready must use together, over the
# window, to count as starting. An import or a graph build uses a whole core where it can get
# one; a member blocked on a peer that never comes polls far below it. Lower it if a starved
# start is failed; raise it if a hung one is spared.
START_CPU_SHARE = 0.05
# START_WAIT_SHARE: the share of the window their threads together waited, runnable, for a CPU
# that counts as starved, hence moving; so does a thread runnable when the window ends (a wait is
# added only once the thread gets a CPU back). See watch.STARVED_WAIT_SHARE: a blocked process
# does not wait for a CPU.
START_WAIT_SHARE = 0.25
# STARVED_START_LIMIT: the longest a start may take, in startup_timeouts, however it moves (a
# member stuck in a loop at start uses a core for good); it bounds how long a start that will
# never end takes to be said.
STARVED_START_LIMIT = 4
# START_WINDOW: how long a start past its timeout may show no progress before it fails, where the
# caller has no heartbeat timeout to use instead (async-ps servers, the fork server's import): a
# process importing TensorFlow on a starved machine gets a CPU slice within seconds.
START_WINDOW = 10.0


class StartDeadline:
    """When a start that has not finished has failed: `passed(now, members)` after startup_timeout
    once the members not yet ready stop showing progress (CPU used or waited for, read from /proc
    where they can be: a Ray actor on another node cannot, and keeps the bare timeout)."""

    def __init__(self, startup_timeout: float, window: float = START_WINDOW, started: float | None = None):
        self.timeout, self.window = startup_timeout, window
        self.started = time.monotonic() if started is None else started
        self.mark: tuple[float, float, float] | None = None  # (when, CPU s, CPU wait s) of the members
        self.moving = True  # what the last full window showed

    def passed(self, now: float, members) -> bool:
        elapsed = now - self.started
        if elapsed <= self.timeout:
            return False
        if elapsed > STARVED_START_LIMIT * self.timeout:
            return True
        if self.mark is not None and now - self.mark[0] < self.window:
            return not self.moving  # (/proc is read once a window: every thread of each member)
        cpu, wait, runnable = _progress_counters(members)
        if cpu is None:
            return True
        if self.mark is not None:
            since, cpu_then, wait_then = self.mark
            span = now - since
            self.moving = (
                runnable
                or cpu - cpu_then >= START_CPU_SHARE * span
                or wait - wait_then >= START_WAIT_SHARE * span
            )
        self.mark = (now, cpu, wait)  # (the first, at the timeout: from here on, judged by windows)
        return not self.moving

    def describe(self, now: float) -> str:
        """How long the start was given, for the error ("within ...")."""
        over_limit = now - self.started > STARVED_START_LIMIT * self.timeout
        if self.mark is None and not over_limit:
            return f"startup_timeout={self.timeout:.0f} s"
        why = (
            f"STARVED_START_LIMIT, {STARVED_START_LIMIT} x startup_timeout"
            if over_limit
            else f"no progress for the last {self.window:.0f} s"
        )
        return f"{now - self.started:.0f} s (startup_timeout={self.timeout:.0f} s, then as long as they kept starting; {why})"


def _progress_counters(members) -> tuple[float | None, float, bool]:
    """The members' CPU seconds and CPU wait summed, and whether a thread of one is runnable now
    (CPU None: one cannot be read from here)."""
    cpu_total, wait_total, runnable = 0.0, 0.0, False
    for member in members:
        # (A member's own processes count: an async-ps coordinator waits on its servers' start.)
        cpu = member.cpu_seconds(with_own=True) if member is not None else None
        if cpu is None:
            return None, 0.0, False
        wait = member.cpu_wait(with_own=True)
        cpu_total += cpu
        if wait is not None:
            wait_total += wait[0]
            runnable |= wait[1]
    return cpu_total, wait_total, runnable
