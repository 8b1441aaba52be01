"""A Ray node cut off mid-run, N times: does `run.stop()` return at once afterwards (issue 39: 20
tries, 0 hangs)? Each try makes two hosts (network namespaces joined by a veth pair,
tests/two_hosts.py), a Ray node on each, and runs an async-ps pool (2 workers, 1 ps) with worker 1
alone on the far node; at 50 rows the far host's link is taken down. Printed per try: seconds
from the cut until the run names the lost worker, then until 10 more rows (the other worker's),
the rows trained after the naming, seconds `run.stop()` took, and whether anything of the run
was left on either host. Needs root.

    PYTHONPATH=. python bench/bench_ray_cut.py --tries 20
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

STOP_BOUND_S = 10  # what the issue allows a stop after a fault


def one_try(folder: Path) -> dict:
    from two_hosts import ASYNC_PS_NODE_CUT, ray_on_two_hosts, read_until, start_driver

    with ray_on_two_hosts(folder, cpus=(3, 1)) as (hosts, nodes):
        driver, log = start_driver(hosts, nodes, folder, ASYNC_PS_NODE_CUT)
        try:
            training = read_until(driver, folder, "TRAINING", 600)
            far = [(p["role"], p["index"]) for p in training["processes"] if p["node"] == hosts.addresses[1]]
            hosts.cut()
            driver.stdin.write("cut\n")
            driver.stdin.flush()
            result = read_until(driver, folder, "RESULT", 600)
            exit_code = driver.wait(timeout=120)
            left = hosts.still_running([p["pid"] for p in training["processes"]])
        finally:
            if driver.poll() is None:
                driver.kill()
                driver.wait()
            log.close()
    return {**result, "far": far, "exit_code": exit_code, "left": left}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=20)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_ray_cut needs root (network namespaces)")
    hangs, stops = 0, []
    for attempt in range(1, args.tries + 1):
        began = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="wb-cut-") as folder:
            try:
                result = one_try(Path(folder))
            except AssertionError as error:  # (the driver never said what was expected)
                hangs += 1
                print(f"try {attempt}: FAILED {str(error)[:600]}", flush=True)
                continue
        hung = result["stop_s"] >= STOP_BOUND_S or result["exit_code"] != 0
        hangs += hung
        stops.append(result["stop_s"])
        named = [t for t in result["said"] if t.startswith("worker 1 (")]
        print(
            f"try {attempt}: {'HUNG' if hung else 'ok'} far node held {result['far']}; loss named after "
            f"{result['named_s']:.1f} s; 10 rows {result['resumed_s']:.1f} s after that, {result['rows_after']} "
            f"in all; stop {result['stop_s']:.2f} s; "
            f"status {result['status']}; left {result['left'] or 'nothing'}; try {time.monotonic() - began:.0f} s, "
            f"load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        print(f"    {named[0] if named else 'the loss was never named'}", flush=True)
        for text in result["said"]:  # (what the stop said: a chunk left behind explains a slow one)
            if text.startswith("stopping"):
                print(f"    {text}", flush=True)
    stops.sort()
    print(
        f"\n{args.tries - hangs}/{args.tries} tries stopped within {STOP_BOUND_S} s, {hangs} hung or failed"
    )
    if stops:
        print(f"stop seconds: min {stops[0]:.2f}, median {stops[len(stops) // 2]:.2f}, max {stops[-1]:.2f}")


if __name__ == "__main__":
    main()
