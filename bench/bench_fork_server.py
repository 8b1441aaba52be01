"""Cold starts with and without the fork server (workbench/_src/placements/local/fork_server.py).

Run: python bench/bench_fork_server.py [--repeats 3] [--steps 50]

Each configuration is a whole `workbench run examples/train.py` command, as a user types it: a
2-worker multi-worker run and a 2-worker, 1-ps async-ps run, each from nothing (no warm pool, no
fork server), once with the fork server (the default) and once with WORKBENCH_FORK_SERVER=off
(every worker, parameter server and coordinator a fresh interpreter, as before), alternating so
that the machine's state weighs on both alike. Measured: wall time of the command, and the CPU
time of every process it started (this process is their subreaper, so each one, the fork server
and its children included, is reaped here and counted in RUSAGE_CHILDREN). Printed: the medians
and the ratio fork server / fresh interpreters (below 1: the fork server is cheaper).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = {
    "multi-worker x2": ["--backend", "multi-worker", "--workers", "2"],
    "async-ps 2w+1ps": ["--backend", "async-ps", "--workers", "2", "--ps", "1"],
}


def _reap_all() -> None:
    """Waits for every descendant that was handed to us (the fork server outlives the command by
    a moment: it exits after its last child)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.05)


def one_run(args: list[str], fork_server: bool, steps: int) -> tuple[float, float]:
    env = {**os.environ, "WORKBENCH_FORK_SERVER": "on" if fork_server else "off"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "workbench.cli",
            "run",
            str(REPO / "examples" / "train.py"),
            *args,
            "--steps",
            str(steps),
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    wall = time.perf_counter() - started
    _reap_all()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50)
    opts = parser.parse_args()
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: count them all
    print(f"cores: {os.cpu_count()}, repeats: {opts.repeats}, steps: {opts.steps}")
    for name, args in CONFIGS.items():
        results = {True: [], False: []}
        for _ in range(opts.repeats):
            for fork_server in (True, False):
                results[fork_server].append(one_run(args, fork_server, opts.steps))
        (wall_on, cpu_on), (wall_off, cpu_off) = (
            [statistics.median(x) for x in zip(*results[flag])] for flag in (True, False)
        )
        print(
            f"{name:17s} wall {wall_on:5.1f} s vs {wall_off:5.1f} s (ratio {wall_on / wall_off:.2f}), "
            f"CPU {cpu_on:5.1f} s vs {cpu_off:5.1f} s (ratio {cpu_on / cpu_off:.2f})  "
            "[fork server vs fresh interpreters]"
        )


if __name__ == "__main__":
    main()
