"""A local Ray instance's start (`--cluster ray=local`) on a busy machine: two TensorFlow jobs of
this script's own keep the cores busy while it starts and stops a local instance N times, each in
a fresh interpreter (as a kernel would). Prints each try's result, its start time and what the
start said, then the count of successes; checks that nothing of a try is left (no process naming
its Ray root, no root folder).

    PYTHONPATH=. python bench/bench_ray_start.py            # 10 tries beside 2 busy TF jobs
    PYTHONPATH=. python bench/bench_ray_start.py --tries 3 --busy 0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

# A TensorFlow job that keeps its threads busy until killed (matrix products, as training does).
BUSY_JOB = """
import tensorflow as tf
x = tf.random.normal([512, 512])
while True:
    for _ in range(50):
        x = tf.tanh(tf.matmul(x, x) * 1e-3)
    x.numpy()
"""

# One try: start the local instance, say what the start said and how long it took, stop it.
ONE_START = """
import json, os, time
started = time.monotonic()
import workbench as wb
from workbench._src.launch import start_progress
said = []
result = {"ok": False}
with start_progress.listening(lambda text: said.append([round(time.monotonic() - started, 1), text])):
    try:
        cluster = wb.RayCluster(address=None, placement="pack")
        ray = cluster.connect()
        result["start_seconds"] = round(time.monotonic() - started, 1)
        result["answer"] = ray.get(ray.remote(lambda: 41 + 1).remote())
        result["ok"] = result["answer"] == 42
        result["root"] = cluster.local_root
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"[:400]
result["said"] = said
print("RESULT " + json.dumps(result), flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=10)
    parser.add_argument("--busy", type=int, default=2, help="TensorFlow jobs running beside the starts")
    args = parser.parse_args()
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    busy = [
        subprocess.Popen(
            [sys.executable, "-c", BUSY_JOB], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for _ in range(args.busy)
    ]
    try:
        if busy:
            time.sleep(15)  # (their TensorFlow imported, their loops running)
            print(
                f"{len(busy)} busy TensorFlow jobs: pids {[p.pid for p in busy]}; load {os.getloadavg()[0]:.1f}"
            )
        successes, seconds = 0, []
        for attempt in range(1, args.tries + 1):
            began = time.monotonic()
            done = subprocess.run(
                [sys.executable, "-c", ONE_START], env=env, capture_output=True, text=True, timeout=900
            )
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            result = (
                json.loads(lines[-1][len("RESULT ") :])
                if lines
                else {"ok": False, "error": done.stderr[-400:]}
            )
            left = _left_behind(result.get("root"))
            ok = result["ok"] and done.returncode == 0 and not left
            successes += ok
            if ok:
                seconds.append(result["start_seconds"])
            print(
                f"try {attempt}: {'ok' if ok else 'FAILED'} start {result.get('start_seconds', '-')} s, "
                f"whole try {time.monotonic() - began:.0f} s, load {os.getloadavg()[0]:.1f}"
                + (f", left behind: {left}" if left else "")
                + (f", error: {result.get('error')}" if not result["ok"] else "")
            )
            for at, text in result.get("said", []):
                print(f"    [{at:6.1f} s] {text}")
        print(f"\n{successes}/{args.tries} starts succeeded beside {len(busy)} busy TensorFlow jobs")
        if seconds:
            seconds.sort()
            print(f"start seconds: min {seconds[0]}, median {seconds[len(seconds) // 2]}, max {seconds[-1]}")
    finally:
        for job in busy:  # ours, by pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(job.pid, signal.SIGKILL)
            job.wait()


def _left_behind(root: str | None) -> list:
    """What a finished try left: processes naming its Ray root, and the root folder."""
    from workbench._src.placements.proc import pids_naming

    if not root:
        return []
    return [f"pid {pid}" for pid in pids_naming(root)] + ([root] if os.path.exists(root) else [])


if __name__ == "__main__":
    main()
