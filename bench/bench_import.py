"""What importing TensorFlow costs a launched process, against the plain import it replaced.

Run: python bench/bench_import.py [--repeats 5]

Every process the workbench starts (a worker, a coordinator, a TensorFlow server) imports
TensorFlow first; the test suite starts a few hundred. Launched processes import it under
`tf_setup.keras_extras_skipped()`, which leaves out the scikit-learn and matplotlib that Keras
imports for features a worker never uses. Each repeat runs both imports in fresh interpreters,
alternating (the anchor first), and measures the child's wall and CPU seconds (user + system,
from its rusage). Printed: the medians and the ratio launched / plain (lower is better). This
machine may be shared and loaded: read the ratio, not the seconds.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

PLAIN = "from workbench._src.core import tf_setup\ntf_setup.tf()\n"  # what launched processes did before
LAUNCHED = (
    "from workbench._src.core import tf_setup\nwith tf_setup.keras_extras_skipped():\n    tf_setup.tf()\n"
)


def measure(code: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of a fresh interpreter running `code`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", code], check=True, stderr=subprocess.DEVNULL)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float]]] = {"plain": [], "launched": []}
    measure(PLAIN)  # warm the page cache: the first import of a 1 GB library reads it from disk
    for _ in range(args.repeats):
        results["plain"].append(measure(PLAIN))
        results["launched"].append(measure(LAUNCHED))
    medians = {}
    for label, samples in results.items():
        wall = statistics.median(s[0] for s in samples)
        cpu = statistics.median(s[1] for s in samples)
        medians[label] = (wall, cpu)
        print(f"{label:9s} import: wall {wall:5.2f} s   CPU {cpu:5.2f} s   (median of {len(samples)})")
    (plain_wall, plain_cpu), (wall, cpu) = medians["plain"], medians["launched"]
    print(f"launched / plain: wall {wall / plain_wall:.2f}   CPU {cpu / plain_cpu:.2f}")


if __name__ == "__main__":
    main()
