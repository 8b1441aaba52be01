"""A local Ray instance's sentinel: a small process that ends the whole instance when the process
that owns it dies without shutting it down (a kernel SIGKILLed, os._exit, the machine's memory).

Why. Ray ties the GCS and the raylet to the thread that started them (PR_SET_PDEATHSIG), so they
die with their owner; their actors follow the raylet. The raylet's agents (ray::DashboardAgent,
ray::RuntimeEnvAgent) do not: they notice their raylet is gone only after their own check gives
up, and outlived a SIGKILLed owner by 40 s to minutes, holding ports, memory and the instance's
folder. A normal shutdown ends them by pid (cluster.end_local_instance); a dead owner runs no code.

How. The owner thread starts the sentinel right after entering the instance's private network
(instance_owner.py), so the sentinel runs inside it, and every process of the instance is born
there after it. The sentinel waits on a pipe from its owner and on its parent's pid: "q" on the
pipe (the owner shut the instance down itself) ends it quietly; the pipe closed or its parent gone
without "q" means the owner died, and it SIGKILLs every other process in its network namespace
(a namespace of the instance's alone: nothing else lives there) and removes the instance's
folder. Where the instance shares the owner's network (namespaces refused, or the owner already
in a private one), the instance's processes are found by the Ray root: in their command line, in
their environment (RAY_TMPDIR, which every process of the instance inherits), or among their open
files (each holds its log there). All three, since an agent that retitles itself (setproctitle)
writes its title over its command line and, when that is long, over its environment too.

It runs as `python -I -S instance_sentinel.py OWNER_PID` with only the standard library: no
workbench import, so it starts in milliseconds and holds ~10 MiB. The root comes as the first line
on its stdin, not in its command line: the end paths that kill what names the root
(local_start.end_failed_start between tries) must not end the sentinel too.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import time

QUIT = "q"
# How often the sentinel checks that its parent is still the owner, besides the pipe (a process
# forked from the owner without exec would hold the pipe's write end open past the owner's death).
PARENT_CHECK_SECONDS = 1.0
# How many passes a sweep makes (a process may start another between a pass's look and its kill).
SWEEP_PASSES = 20


def start(root: str):
    """Starts the sentinel of the instance in `root`, from the calling thread (so in its network);
    returns its Popen. Call on the instance's owner thread before the instance starts."""
    import subprocess

    sentinel = subprocess.Popen(
        [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # (an interrupt meant for the kernel must not end it)
        text=True,
    )
    sentinel.stdin.write(root + "\n")
    sentinel.stdin.flush()
    return sentinel


def stop(sentinel) -> None:
    """The owner shut its instance down (or its start failed, its processes ended): the sentinel
    exits without sweeping, and is reaped."""
    import subprocess

    try:
        sentinel.stdin.write(QUIT + "\n")
        sentinel.stdin.close()
    except OSError:  # (it had ended: a broken pipe)
        pass
    try:
        sentinel.wait(timeout=5)
    except subprocess.TimeoutExpired:
        sentinel.kill()
        sentinel.wait()


def _watch(owner: int) -> None:
    root = sys.stdin.readline().strip()
    if not root:
        return
    network = _network(os.getpid())
    private = network is not None and network != _network(owner)
    while os.getppid() == owner:
        if select.select([sys.stdin], [], [], PARENT_CHECK_SECONDS)[0]:
            line = sys.stdin.readline()
            if line.strip() == QUIT:
                return
            if not line:  # the owner's end of the pipe closed without a word: it died
                break
    _sweep(root, network if private else None)


def _sweep(root: str, network: str | None) -> None:
    """SIGKILLs every other process of the instance, then removes its folder."""
    me = os.getpid()
    for _ in range(SWEEP_PASSES):
        found = [
            pid for pid in _pids() if pid != me and (_network(pid) == network if network else _uses(pid, root))
        ]
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.1)
    shutil.rmtree(root, ignore_errors=True)


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _network(pid: int) -> str | None:
    """The network namespace of pid ("net:[<inode>]"); None when it is gone (or a zombie)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _uses(pid: int, root: str) -> bool:
    """Whether pid names the Ray root in its command line or its environment, or holds a file
    open inside it."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if root.encode() in f.read():
                return True
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"RAY_TMPDIR={root}".encode() in f.read().split(b"\0"):
                return True
        inside = root.rstrip("/") + "/"
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(inside):
                    return True
            except OSError:
                continue
    except OSError:  # (gone, or not ours to read)
        pass
    return False


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch(int(sys.argv[1]))
