"""How the suite's `-n 3` run uses the machine: a pytest plugin that records when each test ran on
which xdist worker, and how busy the machine's cores were meanwhile (/proc/stat, every 2 s).

Run (the suite's own command, on an otherwise idle machine: the core usage is machine-wide):

    PYTHONPATH=bench python -m pytest -n 3 -p suite_timeline

Printed at the end: the share of the cores used over the run and per minute (below 100%: time that
a cheaper test cannot win back, only a better order or fewer waits can), each worker's busy time
and the moment it ran out of files (the tail), and each file's span per worker. Written as JSON to
$SUITE_TIMELINE_JSON when set. Where a test's CPU goes is bench/suite_cpu.py's (serial).
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time

from suite_cpu import machine_cpu_seconds

_tests: list[dict] = []  # one per test phase: nodeid, phase, worker, start, stop (epoch seconds)
_samples: list[tuple[float, float]] = []  # (epoch seconds, machine CPU seconds)
_stop = threading.Event()


def _sample() -> None:
    while not _stop.is_set():
        _samples.append((time.time(), machine_cpu_seconds()))
        _stop.wait(2)


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist)
        threading.Thread(target=_sample, daemon=True, name="suite_timeline").start()


def pytest_runtest_logreport(report):
    node = getattr(report, "node", None)  # xdist: the worker that ran it
    worker = node.gateway.id if node is not None else "main"
    _tests.append(
        {
            "nodeid": report.nodeid,
            "phase": report.when,
            "worker": worker,
            "start": report.start,
            "stop": report.stop,
        }
    )


def pytest_terminal_summary(terminalreporter):
    if hasattr(terminalreporter.config, "workerinput") or not _tests:
        return
    _stop.set()
    _samples.append((time.time(), machine_cpu_seconds()))
    say = terminalreporter.write_line
    cores = os.cpu_count() or 1
    begin, end = _samples[0][0], _samples[-1][0]
    used = _samples[-1][1] - _samples[0][1]
    say(
        f"suite_timeline: {end - begin:.0f} s; the machine's {cores} cores {used / (cores * (end - begin)):.0%} used"
    )
    minutes = []
    for (t0, c0), (t1, c1) in zip(_samples, _samples[1:]):
        index = int((t0 - begin) // 60)
        while len(minutes) <= index:
            minutes.append([0.0, 0.0])
        minutes[index][0] += c1 - c0
        minutes[index][1] += (t1 - t0) * cores
    say("  per minute: " + " ".join(f"{c / max(w, 1e-9):.0%}" for c, w in minutes))
    by_worker = collections.defaultdict(list)
    for row in _tests:
        by_worker[row["worker"]].append(row)
    say("suite_timeline: workers (busy s, ran out of files at s, its last file)")
    for worker, rows in sorted(by_worker.items()):
        busy = sum(r["stop"] - r["start"] for r in rows)
        last = max(rows, key=lambda r: r["stop"])
        say(f"  {worker}: {busy:6.0f} {last['stop'] - begin:6.0f}  {last['nodeid'].split('::')[0]}")
    say("suite_timeline: files (worker, from s, to s, span s)")
    spans = {}
    for row in _tests:
        name = row["nodeid"].split("::")[0]
        first, last, worker = spans.get(name, (row["start"], row["stop"], row["worker"]))
        spans[name] = (min(first, row["start"]), max(last, row["stop"]), worker)
    for name, (first, last, worker) in sorted(spans.items(), key=lambda kv: kv[1][0]):
        if last - first >= 10:
            say(f"  {worker} {first - begin:6.0f} {last - begin:6.0f} {last - first:6.0f}  {name}")
    if os.environ.get("SUITE_TIMELINE_JSON"):
        with open(os.environ["SUITE_TIMELINE_JSON"], "w") as f:
            json.dump({"tests": _tests, "samples": _samples, "cores": cores}, f)
