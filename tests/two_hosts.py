"""Two test hosts on one machine: two network namespaces joined by a veth pair (NOTES.md).

`TwoHosts()` makes them with names and a 10.x.y.0/24 subnet unique to this test process, so two
runs on one machine never meet; `close()` ends every process started in them (by the pids
`ip netns pids` lists for its own namespaces) and deletes the namespaces. Tests that need it skip
with the reason where namespaces cannot be made (not root, no iproute2). `RayNodes(hosts)` starts a
Ray node on each (test_ray_two_nodes.py, test_breakdown.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class TwoHosts:
    def __init__(self):
        if shutil.which("ip") is None or os.geteuid() != 0:
            pytest.skip("two test hosts need root and iproute2 (ip netns) to make network namespaces")
        # The hosts' processes write their temp files (AutoGraph's, TensorFlow's) here, removed at
        # close(): processes the tests kill cannot remove their own.
        self.tmp = tempfile.mkdtemp(prefix="wb-two-hosts-")
        tag = f"wb{os.getpid() % 100000}"
        self.names = [f"{tag}a", f"{tag}b"]
        subnet = f"10.{os.getpid() % 200 + 20}.{(os.getpid() // 200) % 250}"
        self.addresses = [f"{subnet}.1", f"{subnet}.2"]
        self.links = [f"{tag}va", f"{tag}vb"]
        try:
            for name in self.names:
                _ip("netns", "add", name)
            _ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
            for name, link, address in zip(self.names, self.links, self.addresses):
                _ip("link", "set", link, "netns", name)
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
                _ip("-n", name, "link", "set", link, "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as e:
            self.close()
            pytest.skip(f"network namespaces cannot be made here: {e.stderr.strip()}")

    def popen(self, host: int, argv: list[str], env: dict, log) -> subprocess.Popen:
        """Starts argv on host 0 or 1 with `env` added to this environment, output into `log`."""
        # As from a fresh shell: not the log level this test process's TensorFlow import set.
        inherited = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
        return subprocess.Popen(
            ["ip", "netns", "exec", self.names[host], *argv],
            env={**inherited, "TMPDIR": self.tmp, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def cut(self) -> None:
        """Takes the link between the hosts down (both ends)."""
        for name, link in zip(self.names, self.links):
            _ip("-n", name, "link", "set", link, "down", check=False)

    def heal(self) -> None:
        """Brings the link between the hosts up again (after cut())."""
        for name, link in zip(self.names, self.links):
            _ip("-n", name, "link", "set", link, "up", check=False)

    def pids(self, host: int | None = None) -> list[int]:
        """The processes in both namespaces (or in host 0's or 1's)."""
        found = []
        for name in self.names if host is None else [self.names[host]]:
            out = _ip("netns", "pids", name, check=False).stdout.split()
            found += [int(p) for p in out if p.isdigit()]
        return found

    def still_running(self, pids: list[int], timeout: float = 120) -> list[int]:
        """Those of `pids` still in either namespace after waiting up to `timeout` s for them all to
        end (a cut-off node's actors end once its raylet gives up on the head)."""
        deadline = time.monotonic() + timeout
        while (left := [pid for pid in pids if pid in self.pids()]) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left

    def kill_all(self, host: int | None = None) -> None:
        """SIGKILLs every process in both namespaces (or in one), by pid; waits up to 10 s."""
        for pid in self.pids(host):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while self.pids(host) and time.monotonic() < deadline:
            time.sleep(0.1)

    def close(self) -> None:
        self.kill_all()
        for name in self.names:
            _ip("netns", "del", name, check=False)
        shutil.rmtree(self.tmp, ignore_errors=True)


WORKBENCH = [sys.executable, "-m", "workbench.cli"]


class RayNodes:
    """`ray start` on each of the two hosts, with a token; ended with the hosts (TwoHosts.close).
    `cpus`: the CPUs each node declares to Ray (its `--num-cpus`), which decide what fits where."""

    def __init__(self, hosts: TwoHosts, cpus: tuple[int, int] = (1, 1)):
        self.hosts, self.cpus = hosts, cpus
        self.head = f"{hosts.addresses[0]}:6379"
        self.env = {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(16),
            "RAY_USAGE_STATS_ENABLED": "0",
            # Ray's node health check, as the README advises for a cluster the workbench runs on
            # (GCS side): a node cut off is declared dead within ~10 s, not ~a minute, so the
            # next run on the same replicator is told at once that the cluster cannot hold it.
            "RAY_health_check_period_ms": "1000",
            "RAY_health_check_timeout_ms": "1000",
            "RAY_health_check_failure_threshold": "5",
        }
        # Ray's files of its own (not the machine's /tmp/ray, which other clusters may use); short,
        # as its Unix socket paths must stay under 108 bytes.
        self.temp_dirs = [tempfile.mkdtemp(prefix="wbray", dir="/tmp") for _ in range(2)]

    def start(self, log_dir: Path) -> None:
        ray = [sys.executable, "-m", "ray.scripts.scripts", "start", "--disable-usage-stats"]
        self._start(
            0,
            [
                *ray,
                f"--num-cpus={self.cpus[0]}",
                "--head",
                f"--node-ip-address={self.hosts.addresses[0]}",
                "--port=6379",
                "--include-dashboard=false",
                f"--temp-dir={self.temp_dirs[0]}",
            ],
            log_dir / "ray-head.log",
        )
        self._start(
            1,
            [
                *ray,
                f"--num-cpus={self.cpus[1]}",
                f"--address={self.head}",
                f"--node-ip-address={self.hosts.addresses[1]}",
                f"--temp-dir={self.temp_dirs[1]}",
            ],
            log_dir / "ray-node.log",
        )

    def _start(self, host: int, argv: list[str], log_path: Path) -> None:
        # Ray gives a node's raylet a fixed 30 s to register: under `-n 3` a start once took
        # longer ("timed out during startup"). Tried twice, as the workbench's local start is,
        # the first try's processes ended first (by pid: the namespace holds only Ray's yet).
        for attempt in (1, 2):
            with open(log_path, "w") as log:
                code = self.hosts.popen(host, argv, self.env, log).wait(timeout=120)
            if code == 0 or attempt == 2 or "timed out during startup" not in log_path.read_text():
                break
            self.hosts.kill_all(host)
            shutil.rmtree(self.temp_dirs[host], ignore_errors=True)
            os.mkdir(self.temp_dirs[host])
        assert code == 0, f"`ray start` failed on host {host}:\n{log_path.read_text()[-3000:]}"

    def close(self) -> None:
        for folder in self.temp_dirs:
            shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def ray_on_two_hosts(log_dir: Path, cpus: tuple[int, int] = (1, 1)):
    """Two network-namespace hosts with a Ray node on each (the head on the first), declaring
    `cpus` to Ray: yields (hosts, nodes); ends every process of both namespaces by pid, then the
    nodes' folders, also after a failed start (Ray's 30-s limit for a node, under load, once left
    two)."""
    hosts = TwoHosts()
    nodes = RayNodes(hosts, cpus)
    try:
        nodes.start(log_dir)
        yield hosts, nodes
    finally:
        hosts.close()  # every process of both namespaces, by pid: Ray's daemons and actors
        nodes.close()


def start_driver(hosts: TwoHosts, nodes: RayNodes, tmp_path: Path, source: str):
    """Runs the driver script `source` on the first host, as `python driver.py CELL HEAD`: CELL is
    helpers.PROCESS_CELL with its output layer zero-initialised (so a run equals one device's),
    HEAD the Ray head's address. Its stdin and stdout are pipes (text) for the test to talk
    over; its stderr goes to tmp_path/driver.err. Returns (the Popen, that log file)."""
    from helpers import PROCESS_CELL

    script = tmp_path / "driver.py"
    script.write_text(source)
    cell = PROCESS_CELL.replace("keras.layers.Dense(1)", "keras.layers.Dense(1, kernel_initializer='zeros')")
    log = open(tmp_path / "driver.err", "w")
    driver = subprocess.Popen(
        ["ip", "netns", "exec", hosts.names[0], sys.executable, str(script), cell, nodes.head],
        env={**os.environ, **nodes.env, "WORKBENCH_RUNS_DIR": str(tmp_path / "runs")},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        cwd=tmp_path,
    )
    return driver, log


def read_until(driver, tmp_path: Path, tag: str, timeout: float) -> dict:
    """The JSON of the driver's next stdout line `TAG {...}`; fails with the driver's stderr when
    it ends or `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = driver.stdout.readline()
        if not line:
            break
        kind, _, data = line.partition(" ")
        if kind == tag:
            return json.loads(data)
    raise AssertionError(
        f"the driver never said {tag}; its stderr:\n{(tmp_path / 'driver.err').read_text()[-4000:]}"
    )


# A driver (start_driver) for an async-ps run whose worker 1 loses its node: with
# `ray_on_two_hosts(..., cpus=(3, 1))`, "pack" and a CPU per process put the coordinator, the ps and
# worker 0 on the head and worker 1 alone on the far node. It says TRAINING (the processes) at 50
# rows, waits for a line on stdin (the test has cut the link), waits for the loss to be named and
# for 100 more rows, stops the run, and says RESULT (how long the naming, the next 10 rows after
# it and the stop took).
ASYNC_PS_NODE_CUT = r"""
import json, sys, time
import workbench as wb

cell, head = sys.argv[1], sys.argv[2]
cluster = wb.RayCluster(address=head, resources_per_worker={"CPU": 1}, placement="pack")
repl = wb.MultiWorkerAsyncReplicator(num_workers=2, num_ps=1, cluster=cluster)
run = repl.train_cell(cell, {}, steps=10**6, background=True, steps_per_execution=5)
while run.steps < 50 and run.running:
    time.sleep(0.01)
print("TRAINING " + json.dumps({"rows": run.steps, "processes": run.processes}), flush=True)
sys.stdin.readline()  # the test has cut the link
cut = time.monotonic()
said = lambda: [e.data.get("text", "") for e in run.events if e.kind == "message"]
while run.running and not any("worker 1 (" in t for t in said()) and time.monotonic() - cut < 120:
    time.sleep(0.05)
named = time.monotonic() - cut
rows = run.steps
while run.running and run.steps < rows + 10 and time.monotonic() - cut < 240:
    time.sleep(0.01)
resumed = time.monotonic() - cut - named  # (the other worker's steps, once the loss is known)
while run.running and run.steps < rows + 100 and time.monotonic() - cut < 240:
    time.sleep(0.05)
stopping = time.monotonic()
run.stop()
run.wait(timeout=60)
stopped = time.monotonic() - stopping
out = {"status": run.status, "named_s": named, "resumed_s": resumed, "stop_s": stopped, "rows_after": run.steps - rows,
       "after_s": stopping - cut,
       "workers": run.history["workers"].tolist(), "restarts": run.restarts, "said": said()}
repl.shutdown()
print("RESULT " + json.dumps(out, default=str), flush=True)
"""
