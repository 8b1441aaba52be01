"""Where the test suite's CPU goes: a pytest plugin that charges each test the machine's CPU time
(all processes: the test's own, its kernels, workers, Ray daemons and browsers) while it runs.

Run (serially, on an otherwise idle machine: the figure is machine-wide):

    PYTHONPATH=bench python -m pytest -p suite_cpu [-m "not slow"] [tests/...]

Printed at the end: the CPU seconds and wall seconds of the heaviest files and tests, and the
total against the wall time (above 1.0: the tests' own processes ran in parallel). The suite's
command runs `-n 3` on 2 cores, where it is CPU-bound: its wall time follows this total.
Written as JSON to $SUITE_CPU_JSON when set. (Module-scoped fixtures are charged to the first
test that uses them, and a background process a test leaves running to the tests after it.)
"""

from __future__ import annotations

import collections
import json
import os
import time

_started: dict[str, tuple[float, float]] = {}
_rows: list[tuple[str, float, float]] = []  # (test id, CPU seconds, wall seconds)


def machine_cpu_seconds() -> float:
    """CPU time used by the whole machine since boot: every state of /proc/stat's first line but
    idle and iowait."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def pytest_runtest_logstart(nodeid, location):
    _started[nodeid] = (machine_cpu_seconds(), time.monotonic())


def pytest_runtest_logfinish(nodeid, location):
    cpu, wall = _started.pop(nodeid)
    _rows.append((nodeid, machine_cpu_seconds() - cpu, time.monotonic() - wall))


def pytest_terminal_summary(terminalreporter):
    say = terminalreporter.write_line
    cpu, wall = sum(r[1] for r in _rows), sum(r[2] for r in _rows)
    say(
        f"suite_cpu: {len(_rows)} tests, {cpu:.0f} CPU-s in {wall:.0f} s of tests (ratio {cpu / max(wall, 1e-9):.2f})"
    )
    files_cpu, files_wall = collections.Counter(), collections.Counter()
    for test, c, w in _rows:
        files_cpu[test.split("::")[0]] += c
        files_wall[test.split("::")[0]] += w
    say("suite_cpu: heaviest files (CPU-s, wall s)")
    for name, c in files_cpu.most_common(12):
        say(f"  {c:7.1f} {files_wall[name]:7.1f}  {name}")
    say("suite_cpu: heaviest tests (CPU-s, wall s)")
    for test, c, w in sorted(_rows, key=lambda r: -r[1])[:20]:
        say(f"  {c:7.1f} {w:7.1f}  {test}")
    if os.environ.get("SUITE_CPU_JSON"):
        with open(os.environ["SUITE_CPU_JSON"], "w") as f:
            json.dump(_rows, f)
