"""How much a warm pool's processes have grown: the rule that renews a pool for its memory.

Every run builds its model and traces its step again, and TensorFlow keeps some native state per
trace for the process's life: a parameter server the part of each function that ran on it, a
multi-worker worker its collective runtime's state for each traced collective and broadcast
variable (docs decision 19). Only a new process frees it, so a pool whose process has grown past
its plan's `memory_growth_limit` is renewed after a run (launch/pool.py).
"""

from __future__ import annotations

import os

# How much a warm pool's process may grow (its RSS after a run over its RSS after the pool's
# first runs) before the pool is renewed: it bounds a warm process's memory to this much above
# what one run needs, at the price of one pool start every (limit / growth per run) runs, about
# every 25 runs of a small model. The default of the replicators' `memory_growth_limit=`: lower
# it on a machine short of memory.
MEMORY_GROWTH_LIMIT = 0.25


class MemoryGrowth:
    """The sizes of one pool's processes, read after each run.

    A process's size swings by a few percent from one run to the next (when Python's and
    TensorFlow's caches are freed), and its second run adds what a first warm run adds once. So
    the growth measured is of its least size after its last two runs over its least after its
    first two: a lasting growth, not a swing, and a small limit can be given."""

    def __init__(self):
        self.baseline: dict[int, int] | None = None  # pid -> least RSS after the first two runs
        self.last: dict[int, int] = {}  # pid -> RSS after the last run

    def after_run(self, processes: list[dict], runs: int, limit: float | None) -> str:
        """'' while every process readable here (by pid: on this machine) has grown by at most
        `limit` (None: any growth); else which one grew and by how much."""
        if limit is None:
            return ""
        here = [p for p in processes if str(p.get("node", "127.")).startswith("127.")]  # (else unread)
        now = {p["pid"]: rss for p in here if (rss := process_rss_bytes(p["pid"]))}
        last, self.last = self.last, now
        if self.baseline is None:  # (one reading shows no growth)
            self.baseline = now
            return ""
        if runs <= 2:
            self.baseline = {pid: min(rss, self.baseline.get(pid, rss)) for pid, rss in now.items()}
        for process in here:
            pid = process["pid"]
            if pid not in now:  # (gone)
                continue
            before, after = self.baseline.get(pid), min(now[pid], last.get(pid, now[pid]))
            if before and after > before * (1 + limit):
                return (
                    f"{process['role']} {process['index']} grew from {before / 2**20:.0f} to "
                    f"{after / 2**20:.0f} MiB over {runs} runs, past memory_growth_limit={limit:g}: "
                    "TensorFlow keeps some state of every run's traced step for the process's life, "
                    "so a warm pool is renewed before it grows without bound"
                )
        return ""


def process_rss_bytes(pid: int) -> int | None:
    """Resident memory of `pid`, a process of this machine, in bytes (None: gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None
