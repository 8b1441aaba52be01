"""What the placements ask of this machine's processes and temp folder (/proc, a short path for
a Unix socket). It imports only core's owned folders (core/owned_folders.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time

from workbench._src.core.owned_folders import owned_folder, pid_alive


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command's name: [state (field 3 of proc(5)), ppid, ...]; [] when
    the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


# A member dumps its Python threads' stacks into a file of its own on this signal (faulthandler,
# registered first thing in the member): the launcher asks for them when it finds it silent.
STACKS_SIGNAL = signal.SIGUSR1
STACKS_FILE = "stacks.txt"  # a Ray member's, in its temp folder (a local member's go to its log)
# How long the launcher waits for that dump: faulthandler writes from its signal handler, without
# the interpreter's lock, so a frozen process writes it too; it bounds a starved one's delay.
STACKS_WAIT = 5.0
# The dump is taken as whole once the file has not grown for this long (it is written in many
# small writes, and a starved process can be descheduled between two of them).
STACKS_SETTLE = 0.3


def dumped_stacks(pid: int, signal_it, path) -> str:
    """What process `pid`'s faulthandler wrote to `path` after `signal_it()` sent it
    STACKS_SIGNAL (False: it could not be sent); "" when nothing came within STACKS_WAIT, or the
    process is stopped (it runs no handler until continued: it is not asked)."""
    try:
        before = os.stat(path).st_size
    except OSError:
        return ""
    if process_stopped(pid) or not signal_it():
        return ""
    size, deadline, settled = before, time.monotonic() + STACKS_WAIT, None
    while time.monotonic() < deadline:
        time.sleep(0.05)
        with contextlib.suppress(OSError):
            grown = os.stat(path).st_size
            settled = settled if grown == size else time.monotonic()
            size = grown
        if size > before and settled is not None and time.monotonic() - settled >= STACKS_SETTLE:
            break
    with contextlib.suppress(OSError), open(path, "rb") as dump:
        dump.seek(before)
        return dump.read(size - before).decode(errors="replace")
    return ""


def process_stopped(pid: int) -> bool:
    """Whether `pid` is stopped (state T: SIGSTOP, or t: a debugger's trace stop): it runs no
    signal handler until continued."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] in ("T", "t")


def process_cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time of `pid` (all its threads; None: gone)."""
    fields = _stat_fields(pid)
    if not fields:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: 14, 15


def _thread_waits(pid: int) -> tuple[dict[str, int], bool] | None:
    """Each live thread's run-queue delay (ns, by thread id) and whether one is runnable now;
    None: gone, or not shown by this kernel."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    waits, runnable = {}, False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                waits[tid] = int(f.read().split()[1])  # on the CPU, waiting to run (ns), timeslices
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                runnable |= f.read().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError, ValueError):  # a thread ended meanwhile
            continue
    return (waits, runnable) if waits else None


class CpuWaitCounter:
    """How one member's processes wait for a CPU: the seconds their threads have waited,
    runnable, on a run queue (the run-queue delay of /proc/PID/task/*/schedstat, summed), and
    whether a thread is runnable now (state R). Both say a busy machine starves them, neither
    grows while they are stopped or asleep; the delay is added only once a thread gets the CPU,
    so a process that gets none shows by its state.

    The waits of threads that have ended are kept: /proc shows live threads only, and TensorFlow
    starts and ends threads all along (tf.data's, a strategy's start), so a sum over live threads
    alone falls when one ends, and a starved member read twice would seem not to have waited at
    all. A thread is counted at its last reading; a process among the pids that ended keeps its
    threads' waits too. One counter per member: it remembers the threads it has read (a new
    counter's first read is the live threads' sum)."""

    def __init__(self):
        self._last: dict[tuple[int, str], int] = {}  # (pid, thread id) -> its delay (ns) at the last read
        self._ended = 0  # ns waited by threads read before and gone since

    def read(self, pids: list[int]) -> tuple[float, bool] | None:
        """(Seconds waited, runnable now) of the pids' threads, summed over every thread ever
        read here; None when the first pid is gone."""
        first = _thread_waits(pids[0])
        if first is None:
            return None
        reads = [(pids[0], first)] + [(pid, r) for pid in pids[1:] if (r := _thread_waits(pid)) is not None]
        now = {(pid, tid): ns for pid, (waits, _) in reads for tid, ns in waits.items()}
        for key, ns in self._last.items():
            if now.get(key, -1) < ns:  # ended (or its id taken by a new thread, whose delay starts at 0)
                self._ended += ns
        self._last = now
        return (self._ended + sum(now.values())) / 1e9, any(runnable for _, (_, runnable) in reads)


class CpuSecondsCounter:
    """The CPU seconds of a process and of its own processes, where one of its own that ended
    keeps the time it had at its last reading. /proc shows running processes only: summed over
    those alone, the total falls when one ends (an async-ps coordinator's server that died), and a
    start judged by its growth (start_progress.py) would seem to stand still. One counter per
    member, as CpuWaitCounter."""

    def __init__(self):
        self._last: dict[int, float] = {}  # own pid -> its CPU seconds at the last read

    def read(self, pids: list[int]) -> float | None:
        """CPU seconds of pids[0] plus those of the others, each at its last reading here; None
        when the first is gone."""
        first = process_cpu_seconds(pids[0])
        if first is None:
            return None
        for pid in pids[1:]:
            seconds = process_cpu_seconds(pid)
            if seconds is not None:
                self._last[pid] = seconds
        return first + sum(self._last.get(pid, 0.0) for pid in pids[1:])


def process_start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (None: gone). With the pid it names one
    process for good: a pid reused later has another start time."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None  # starttime: field 22


def boot_id() -> str | None:
    """This kernel's id for its current boot (None: not shown). Two processes that read the same
    one run on the same machine, whatever Ray calls their nodes."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def same_process_running(pid: int, started: int | None) -> bool:
    """The process that had `pid` and started at `started` (process_start_ticks) still runs: not
    ended, not a zombie, and its pid not handed to another process since."""
    return pid_alive(pid) and process_start_ticks(pid) == started


def pids_naming(text: str) -> list[int]:
    """The pids of the processes (other than this one) whose command line contains `text`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(entry))
        except OSError:  # ended meanwhile
            continue
    return found


def socket_folder(prefix: str) -> str:
    """A new private folder (`owned_folder`: 0700, only this user may reach a socket in it) in the
    temp folder, or in /tmp when TMPDIR is so long that a socket's path in it would pass the 107-byte
    limit of a Unix socket address."""
    base = tempfile.gettempdir() if len(tempfile.gettempdir()) < 60 else "/tmp"
    return owned_folder(prefix, base)


def process_tree(roots: list[int]) -> list[tuple[int, int]]:
    """The processes `roots` and all their descendants, each as (pid, start ticks): what ending
    them later must name, since a pid alone may be another process's by then."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields:
                children.setdefault(int(fields[1]), []).append(int(entry))
    found: dict[int, int] = {}  # pid -> start ticks
    todo = list(roots)
    while todo:
        pid = todo.pop()
        ticks = process_start_ticks(pid)
        if ticks is not None and pid not in found:
            found[pid] = ticks
            todo.extend(children.get(pid, []))
    return list(found.items())


def end_processes(found: list[tuple[int, int]], grace: float) -> None:
    """Waits up to `grace` seconds for the processes of `process_tree` to end by themselves, then
    SIGKILLs those still running as the same process (same pid and start time)."""
    import signal
    import time

    deadline = time.monotonic() + grace
    while any(same_process_running(*p) for p in found) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid, ticks in found:
        if same_process_running(pid, ticks):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
