"""What a member's late heartbeats mean: frozen, or busy, starved or asleep in one long call.

A member whose heartbeats are late but that keeps using CPU is busy: its heartbeat thread cannot
run while another thread holds Python's GIL in one long C call, and a loaded machine delays it
too. A frozen (SIGSTOP) process uses no CPU at all and is stopped. One that uses none but is not
stopped sleeps in a call that holds the GIL (TensorFlow's removal of a function from its remote
workers waits for their answer so). Where a member's process cannot be read (a Ray member on
another node), only its messages tell.
"""

from __future__ import annotations

# BUSY_CPU_SHARE: a silent member that used at least this share of one core since its last sign
# of life is busy, and its silence counts from now. The floor of what /proc can show (one 10-ms
# tick a second); raise it only if a frozen process could use CPU (it cannot), lower it never: a
# busy thread's share falls with the load (two cores shared by ~30 runnable threads give ~7%).
BUSY_CPU_SHARE = 0.01
# STARVED_WAIT_SHARE: a silent member with a thread runnable now, or whose threads waited,
# runnable, for a CPU at least this share of the time since its last sign of life, is starved by
# the machine, not frozen, and its silence counts from now (at load 40-70 a coordinator that got
# almost no CPU for 12 s was named frozen). A stopped or hung process has no runnable thread: its
# wait does not grow, apart from a waking thread's milliseconds. Raise it if a hung member is
# spared; a starved one waits nearly all the time.
STARVED_WAIT_SHARE = 0.25
# BUSY_SILENCE_LIMIT: how many heartbeat timeouts one call holding the GIL may take before its
# silent member is named all the same: of CPU time if it is busy (building a big graph: seconds;
# CPU time, so that a loaded machine stretches the bound instead of breaking it), of wall time if
# it sleeps in the call without being stopped (measured: TensorFlow's removal of a function from
# its remote workers, 2-16 s after one of them was replaced). A stopped member is named after one
# timeout. Raise it if such calls are named.
BUSY_SILENCE_LIMIT = 6


class Liveness:
    """The signs of life of a launch's members besides their messages: per member, its CPU time
    and its threads' wait for a CPU at its last sign of life."""

    def __init__(self, timeout: float):
        self.timeout = timeout  # the heartbeat timeout
        # task -> (last sign of life, its CPU s then, its threads' wait for a CPU then)
        self.cpu_seen: dict[str, tuple[float, float | None, float | None]] = {}
        self.cpu_at_message: dict[str, float | None] = {}  # task -> its CPU s when its last message came

    def idle_for(self, task: str, child, heard: float, now: float) -> float:
        """Seconds since `task` (its member `child`, last heard at `heard`) last showed it is
        alive: a message from it, or, while its heartbeats were late, CPU time it used
        (BUSY_CPU_SHARE of a core since the last sign) or time its threads waited for a CPU
        (STARVED_WAIT_SHARE: a busy machine starves it), asked when the silence reaches the
        timeout. A process that cannot be read from here has its messages only."""
        mark = self.cpu_seen.get(task)
        if mark is None or mark[0] < heard:  # a message since the last look: its CPU time now
            # (Its wait for a CPU is read only once it is late: that reads every thread of the
            # process, milliseconds for a TensorFlow process, too much for every message.)
            self.cpu_seen[task] = (now, child.cpu_seconds(), None)
            self.cpu_at_message[task] = self.cpu_seen[task][1]
            # Looked at late (a loaded launcher), nothing has been measured since its message: its
            # silence counts at most a timeout, and it is judged by its CPU time and wait from here
            # (a loaded CI run named a worker asleep in its strategy's start "frozen" so).
            return min(now - heard, self.timeout)
        since, cpu_then, wait_then = mark
        if cpu_then is None or now - since <= self.timeout:
            return now - since
        cpu, wait = child.cpu_seconds(), child.cpu_wait()
        busy = cpu is not None and cpu - cpu_then >= BUSY_CPU_SHARE * (now - since)
        starved = wait is not None and (
            wait[1] or (wait_then is not None and wait[0] - wait_then >= STARVED_WAIT_SHARE * (now - since))
        )
        if busy or starved:
            self.cpu_seen[task] = (now, cpu, None if wait is None else wait[0])  # the silence counts from now
            return 0.0
        if wait_then is None and wait is not None:  # its wait from here on (measured against the
            self.cpu_seen[task] = (since, cpu_then, wait[0])  # whole silence: on the safe side)
        return now - since

    def silence(self, task: str, child, silent: float, idle: float) -> tuple[str, str] | None:
        """What `task`'s silence of `silent` s (idle for `idle`, idle_for) says once it is too
        long: (how it was silent, for the error; the cause), or None while it may go on."""
        limit = BUSY_SILENCE_LIMIT * self.timeout
        if idle > self.timeout:
            mark, cause = self.cpu_seen.get(task, (0, None, None)), f"no heartbeat for {silent:.0f} s"
            if mark[2] is None and mark[1] is None:  # (nothing of it can be read: another node)
                return " (frozen, stopped, starved or cut off)", cause
            if mark[2] is None:  # (its CPU time alone can be read)
                return " and almost no CPU time used (frozen, stopped or starved)", cause
            if child.stopped():
                return " while it neither ran nor waited for a CPU (frozen or stopped)", cause
            if silent > limit:
                how = " while it neither ran nor waited for a CPU, asleep in one call that did not return"
                return how, f"asleep and silent for {silent:.0f} s"
            return None  # (asleep in one call that holds the GIL: BUSY_SILENCE_LIMIT)
        then = self.cpu_at_message.get(task)
        cpu = child.cpu_seconds() if then is not None and silent > limit else None
        if cpu is not None and cpu - then > limit:
            how = (
                f" while it kept a CPU busy ({cpu - then:.0f} CPU-seconds: one call holding Python's GIL "
                "that long, or a loop that never returns)"
            )
            return how, f"busy and silent for {silent:.0f} s"
        return None
