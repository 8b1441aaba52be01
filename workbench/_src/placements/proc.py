"""What the launch modules ask of this machine's processes and temp folder (/proc, a short path
for a Unix socket). A leaf: it imports nothing of ours, so every launch module may use it."""

from __future__ import annotations

import os
import tempfile


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command's name: [state (field 3 of proc(5)), ppid, ...]; [] when
    the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def process_cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time of `pid` (all its threads; None: gone)."""
    fields = _stat_fields(pid)
    if not fields:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: 14, 15


def process_start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (None: gone). With the pid it names one
    process for good: a pid reused later has another start time."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None  # starttime: field 22


def pid_alive(pid: int) -> bool:
    """pid runs (a zombie, dead but not yet reaped by its parent, does not count)."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] != "Z"


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
    """A new private folder (mkdtemp: 0700, only this user may reach a socket in it) in the temp
    folder, or in /tmp when TMPDIR is so long that a socket's path in it would pass the 107-byte
    limit of a Unix socket address."""
    base = None if len(tempfile.gettempdir()) < 60 else "/tmp"
    return tempfile.mkdtemp(prefix=prefix, dir=base)
