"""Validates study.forecast's model on two hosts: predicts the 2-worker step time from a one-worker
measurement, then measures it, over a tc-limited link (100 Mbit/s and 1 Gbit/s by default).

Run (root, iproute2 and tc; ~2 min): python bench/validate_forecast.py [--rates 100mbit,1gbit]

Two network namespaces joined by a veth pair (tests/two_hosts.py, NOTES.md) stand for two
machines; `tc qdisc ... tbf` limits each end's egress. The model is bench/forecast_mlp.py (a
256-wide 4-layer MLP on batches of 16: 1 MB of gradients per step). One worker (`workbench run
--backend single` on host 0) gives the baseline's breakdown and gradient bytes; the forecast for
2 workers (studies/forecast.py: ring all-reduce, 50 us per hop) is compared with `workbench run
--backend multi-worker --cluster TF_CONFIG`, one task per host: the breakdown's time per step of
each worker (sampled chunks) and the chief's median step from its history. Both hosts share this
machine's cores: say the load (printed) with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
MODEL = os.path.join(HERE, "forecast_mlp.py")
WORKBENCH = [sys.executable, "-m", "workbench.cli", "run", MODEL]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rates", default="100mbit,1gbit", help="tc rates of the link, comma-separated")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--latency-us", type=float, default=50.0, help="the forecast's per-hop latency")
    args = parser.parse_args()
    from two_hosts import TwoHosts

    from workbench._src.studies.forecast import forecast

    hosts = TwoHosts()
    tmp = tempfile.mkdtemp(prefix="validate-forecast-")
    rows = []
    try:
        print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
        base = run_tasks(hosts, tmp, "base", [["--backend", "single"]], args.steps * 2)[0]
        (worker,) = base["breakdown_ms"].values()
        baseline = {
            "replicas": 1, "per_replica_batch": 16, "gradient_bytes": base["collective_bytes"],
            **{f"{k}_s": worker[k] / 1e3 for k in ("input", "compute", "communication", "other")},
        }  # fmt: skip
        print(f"one worker: {worker} ms per step; {base['collective_bytes']} gradient bytes", flush=True)
        for port, rate in enumerate(args.rates.split(",")):
            limit(hosts, rate)
            gbps = parse_rate(rate)
            predicted = forecast(baseline, [2], link_gbps=gbps, latency_us=args.latency_us).iloc[0]
            cluster = {"worker": [f"{a}:{23130 + 2 * port + i}" for i, a in enumerate(hosts.addresses)]}
            options = [["--backend", "multi-worker", "--cluster", "TF_CONFIG"]] * 2
            envs = [
                {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})}
                for i in (0, 1)
            ]
            results = run_tasks(hosts, tmp, rate, options, args.steps, envs)
            per_worker = [next(iter(r["breakdown_ms"].values())) for r in results]
            median_step = chief_median_step_ms(os.path.join(tmp, f"{rate}-0.csv"))
            rows.append((rate, predicted, per_worker, median_step))
            print(
                f"{rate}: predicted {predicted['step_ms']:.2f} ms; measured {per_worker} (median history step {median_step:.2f} ms)",
                flush=True,
            )
    finally:
        hosts.close()
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    print(
        "link     predicted step (comm)   measured step per worker (comm share)     chief median   predicted/measured"
    )
    for rate, predicted, per_worker, median_step in rows:
        measured = statistics.mean(w["step"] for w in per_worker)
        shares = ", ".join(f"{w['step']:.2f} ms ({w['communication'] / w['step']:.0%})" for w in per_worker)
        print(
            f"{rate:8s} {predicted['step_ms']:8.2f} ms ({predicted['communication_ms']:.2f})   {shares:40s}"
            f"  {median_step:8.2f} ms   {predicted['step_ms'] / measured:.2f}"
        )


def parse_rate(rate: str) -> float:
    """'100mbit' -> 0.1, '1gbit' -> 1.0 (Gbit/s)."""
    for unit, scale in (("gbit", 1.0), ("mbit", 1e-3), ("kbit", 1e-6)):
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise SystemExit(f"a tc rate such as 100mbit or 1gbit; received {rate!r}")


def limit(hosts, rate: str) -> None:
    """tbf on both ends of the veth pair (each end limits what it sends); a 10 ms burst."""
    burst = max(64_000, int(parse_rate(rate) * 1e9 / 8 / 100))
    for name, link in zip(hosts.names, hosts.links):
        subprocess.run(
            ["ip", "netns", "exec", name, "tc", "qdisc", "replace", "dev", link, "root", "tbf", "rate", rate,
             "burst", str(burst), "latency", "200ms"],
            check=True, capture_output=True, text=True,
        )  # fmt: skip


def run_tasks(hosts, tmp, tag, options, steps, envs=None) -> list[dict]:
    """`workbench run` on host 0 (and 1 when two option lists are given); their JSON summaries."""
    processes, logs = [], []
    for index, extra in enumerate(options):
        log_path = os.path.join(tmp, f"{tag}-{index}.log")
        logs.append(log_path)
        argv = [
            *WORKBENCH,
            *extra,
            "--steps",
            str(steps),
            "--history",
            os.path.join(tmp, f"{tag}-{index}.csv"),
        ]
        env = {"PYTHONUNBUFFERED": "1", **((envs or [{}] * len(options))[index])}
        processes.append(hosts.popen(index, argv, env, open(log_path, "w")))
    deadline = time.monotonic() + 600
    for process in processes:
        process.wait(timeout=max(1, deadline - time.monotonic()))
    out = []
    for process, log_path in zip(processes, logs):
        text = open(log_path).read()
        if process.returncode != 0:
            raise SystemExit(f"{log_path} exited {process.returncode}:\n{text[-3000:]}")
        out.append(json.loads(next(line for line in reversed(text.splitlines()) if line.startswith("{"))))
    return out


def chief_median_step_ms(csv_path: str) -> float:
    import pandas as pd

    history = pd.read_csv(csv_path)
    rates = history["examples_per_sec"].dropna()
    return float((history.loc[rates.index, "examples"] / rates).median() * 1e3)


if __name__ == "__main__":
    main()
