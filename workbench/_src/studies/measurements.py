"""A study you can trust on a shared machine: how busy the machine was while a configuration was
measured, and one row per configuration from its repeated, interleaved measurements.

Two runs of the same `workbench scale` line once gave speed-ups 3.56 / 4.0 / 2.95 and then
0.83 / 0.41 / 0.52: other work on the machine's two cores. A figure is therefore reported with
its spread over `repeats` (configurations interleaved, so a burst of load hits all of them alike)
and flagged when, during its measurement, processes outside the study used a noticeable share of
the cores or the hypervisor stole CPU time (Linux's /proc/stat; elsewhere nothing is flagged).
"""

from __future__ import annotations

import os
import time

from workbench._src.core import registry

# Flag a measurement when others used more than this share of the machine's cores, or the
# hypervisor stole more than this share of CPU time, during it.
OTHERS_SHARE_LIMIT = 0.25
STEAL_SHARE_LIMIT = 0.05
BREAKDOWN_PARTS = ("input", "compute", "communication", "other")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_ticks() -> tuple[float, float, float] | None:
    """(busy, steal, total) jiffies of the whole machine since boot, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [float(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0.0] * 8)[:8]
    busy = user + nice + system + irq + softirq
    return busy, steal, busy + idle + iowait + steal


def _tree_cpu_seconds() -> float:
    """CPU seconds of this process and its descendants (live ones, and those already waited for):
    the study's own work, worker processes included."""
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return sum(os.times()[:4])
    parent, cpu = {}, {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parent[pid] = int(fields[1])
        cpu[pid] = sum(float(v) for v in fields[11:15]) / _TICK  # utime stime cutime cstime
    mine, total = {os.getpid()}, 0.0
    grew = True
    while grew:
        grew = False
        for pid, ppid in parent.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                grew = True
    for pid in mine:
        total += cpu.get(pid, 0.0)
    return total


class LoadMeter:
    """`with LoadMeter() as load: ...measure...`; then `load.reading()`: a dict of
    load_average (1 min), others_cores (cores busy with work outside this process tree),
    steal_share, cores, and `unreliable` with a sentence saying why."""

    def __enter__(self):
        self.ticks0, self.own0, self.wall0 = _cpu_ticks(), _tree_cpu_seconds(), time.monotonic()
        return self

    def __exit__(self, *exc):
        self.ticks1, self.own1, self.wall1 = _cpu_ticks(), _tree_cpu_seconds(), time.monotonic()
        return False

    def reading(self) -> dict:
        cores = os.cpu_count() or 1
        out = {"load_average": _load_average(), "others_cores": float("nan"), "steal_share": float("nan"),
               "unreliable": False, "load_note": ""}  # fmt: skip
        if self.ticks0 is None or self.ticks1 is None:
            return out
        busy, steal, total = (b - a for a, b in zip(self.ticks0, self.ticks1))
        wall = max(self.wall1 - self.wall0, 1e-9)
        busy_cores = busy / _TICK / wall
        own_cores = max(0.0, self.own1 - self.own0) / wall
        others = max(0.0, busy_cores - own_cores)
        steal_share = steal / total if total > 0 else 0.0
        out.update(others_cores=round(others, 2), steal_share=round(steal_share, 3))
        reasons = []
        if others > OTHERS_SHARE_LIMIT * cores:
            reasons.append(f"other processes kept {others:.1f} of {cores} cores busy")
        if steal_share > STEAL_SHARE_LIMIT:
            reasons.append(f"the hypervisor stole {steal_share:.0%} of CPU time")
        if reasons:
            out["unreliable"] = True
            out["load_note"] = "; ".join(reasons) + " during this measurement"
        return out


def _load_average() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return float("nan")


def combine(samples: list[dict]) -> dict:
    """One configuration's row from its repeated measurements: the median repeat's figures (by
    examples/s), the spread (max - min) / median of examples/s, and the load flags of all."""
    import statistics

    ordered = sorted(samples, key=lambda s: s["examples_per_sec"])
    row = dict(ordered[(len(ordered) - 1) // 2])  # the median repeat (the lower one of two)
    rates = [s["examples_per_sec"] for s in samples]
    median = statistics.median(rates)
    row["examples_per_sec"] = median
    row["repeats"] = len(samples)
    row["examples_per_sec_min"], row["examples_per_sec_max"] = min(rates), max(rates)
    row["spread"] = (max(rates) - min(rates)) / median if median else float("nan")
    notes = [s["load_note"] for s in samples if s.get("unreliable")]
    row["unreliable"] = bool(notes)
    row["load_note"] = f"{len(notes)} of {len(samples)} repeat(s): {notes[0]}" if notes else ""
    row["others_cores"] = max((s.get("others_cores", 0.0) for s in samples), default=float("nan"))
    return row


def breakdown_columns(run) -> dict:
    """Where the measured run's step time went: the slowest worker's seconds per step (the one
    the others wait for), the run's diagnosis sentence, and the gradient bytes a step reduces."""
    table = run.breakdown()
    if table.empty:
        nan = float("nan")
        return {**{f"{p}_s": nan for p in BREAKDOWN_PARTS}, "breakdown": "", "gradient_bytes": nan}
    slowest = table.loc[table["step"].idxmax()]
    return {
        **{f"{p}_s": float(slowest[p]) for p in BREAKDOWN_PARTS},
        "breakdown": table.attrs.get("diagnosis", ""),
        "gradient_bytes": float(table.attrs.get("collective_bytes") or 0),
    }


def honesty(described: dict, devices: dict, threads_per_worker: int | None = None) -> dict:
    """What the replicas really ran on: replicas sharing CPU cores are not independent devices.

    One process with virtual CPUs: the replicas share that process's thread pool. Worker
    processes on one machine without GPUs: each worker has its own pool (`threads_per_worker`,
    else TensorFlow's default of one thread per core), so together they oversubscribe the cores.
    """
    cores = devices.get("physical_cores") or 0
    replicas = int(described.get("num_replicas") or 1)
    workers = int(described.get("num_workers") or 1)
    if registry.spec(described["backend"]).in_processes:
        kind = "GPU" if devices.get("gpus") else "CPU process"
        threads = threads_per_worker or cores
        total = threads * workers
        note = ""
        if kind == "CPU process" and workers > 1 and total > cores:
            note = (
                f"{workers} worker processes x {threads} TensorFlow thread(s) share {cores} core(s) of "
                "one machine: the workers compete for the same cores, so this measures the cost of "
                "distribution (processes, gRPC all-reduce), not speed-up"
            )
        return {
            "devices_kind": kind,
            "devices": f"{workers} worker(s) x {described.get('devices_per_worker', 1)}",
            "physical_cores": cores,
            "threads_per_replica": threads / max(1, replicas // workers),
            "shared_cores": bool(note),
            "threads_note": note,
        }
    used = described.get("devices", [])
    kind = "GPU" if any("GPU" in d for d in used) else "TPU" if any("TPU" in d for d in used) else "CPU"
    pool = devices.get("intra_op_threads") or cores
    if kind == "CPU" and devices.get("virtual_cpus", 1) > 1:
        kind = "virtual CPU"
        note = (
            f"{len(used)} virtual CPU device(s) share {cores} physical core(s) and one TensorFlow "
            "thread pool: replicas compete for the same cores, so this measures overhead, not speed-up"
        )
    else:
        note = ""
    return {
        "devices_kind": kind,
        "devices": ",".join(d.split("device:")[-1] for d in used),
        "physical_cores": cores,
        "threads_per_replica": pool / max(1, len(used)) if kind in ("CPU", "virtual CPU") else float("nan"),
        "shared_cores": kind == "virtual CPU",
        "threads_note": note,
    }
