"""A local Ray instance (`--cluster ray=local`) is as closed as a local pool (issue 39): no process
of it, nor this process (Ray's driver), holds a listener another host could reach, TensorFlow's
servers in its actors included (they bind every interface: the instance lives in a loopback-only
network namespace, started there by a thread of its own that lives as long as the instance:
placements/ray/instance_owner.py). Where a process with threads may not join a namespace (not
root), the start keeps the host network and warns once.

Real Ray, real TensorFlow servers, real namespaces; every check looks only at the processes this
test started (the pool's, the instance's, this process), never at the whole machine. The instance
belongs to this test process and is ended by `cluster.shutdown()` (by pid; never `ray stop`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys

import psutil
import pytest
from helpers import connect_error, host_addresses, regression_setup, wait_for, wait_for_steps

import workbench as wb
from workbench._src.placements.local import netns

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
# Processes of each pool: multi-worker's 2 workers; async-ps's coordinator, 2 workers and 1 ps.
POOL_SIZE = {"multi-worker": 2, "async-ps": 4}
LISTENERS_BEFORE: list = []  # this process's non-loopback listeners before the instance started


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance of this process, as `--cluster ray=local` makes it."""
    pytest.importorskip("ray", reason='Ray is an optional extra: pip install -e ".[ray,test]"')
    import ray

    from workbench._src.core.owned_folders import pid_alive
    from workbench._src.launch import pool as pools
    from workbench._src.placements.proc import pids_naming, process_tree

    assert not ray.is_initialized(), "a Ray connection was left by another test module"
    if os.geteuid() != 0:
        pytest.skip("not root: a kernel joins a private network only as root (the fallback is tested below)")
    # This process's own listeners before the instance: an earlier test in the same process (a
    # TensorFlow server of its own) may have left some; they are not the instance's.
    LISTENERS_BEFORE[:] = netns.non_loopback_listeners(os.getpid())
    cluster = wb.RayCluster.from_option("ray=local")
    cluster.resources_per_worker = {"CPU": 0.5}
    cluster.connect()
    root = cluster.local_root
    try:
        yield cluster
    finally:
        pools.shutdown()
        instance = [pid for pid, _ in process_tree(pids_naming(root))]
        cluster.shutdown()
        wait_for(lambda: not any(pid_alive(pid) for pid in instance), 15, "the Ray instance's processes to end")


def instance_pids(cluster) -> set[int]:
    """Every process of the local instance: whatever names the instance's private root (GCS,
    raylet, agents) and their descendants (workers, actors). Not all of this process's children:
    in a test process that ran other modules, a child of theirs may still be ending."""
    from workbench._src.placements.proc import pids_naming, process_tree

    return {pid for pid, _ in process_tree(pids_naming(cluster.local_root))}


def thread_networks(pid: int) -> set[str]:
    networks = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            networks.add(os.readlink(f"/proc/{pid}/task/{tid}/ns/net"))
        except OSError:  # (ended meanwhile)
            pass
    return networks


@pytest.mark.slow
@pytest.mark.usefixtures("no_orphans")
@pytest.mark.parametrize("backend", ["multi-worker", "async-ps"])
def test_no_process_of_a_local_ray_run_listens_beyond_loopback(ray_local, backend):
    """While a multi-worker x2 or an async-ps (2 workers, 1 ps) run trains on `ray=local`: every
    pool process and every process of the instance is in one loopback-only network; none, nor
    this process, holds a listener another host could reach; the TensorFlow servers are there,
    bound to every interface of that network, and refuse a connection from this machine's
    network. This process's Ray threads are in that network, its other threads are not."""
    host = os.readlink("/proc/self/ns/net")
    repl = wb.replicator(backend, num_workers=2, cluster=ray_local)
    run = repl.train(setup=regression_setup, steps=10**7, background=True)
    try:
        wait_for_steps(run, 20, timeout=300)
        wait_for(lambda: len(run.processes) >= POOL_SIZE[backend], 30, "every process of the pool")
        pool = [p["pid"] for p in run.processes]
        assert len(pool) == POOL_SIZE[backend], run.processes
        private = {os.readlink(f"/proc/{pid}/ns/net") for pid in pool}
        assert len(private) == 1 and host not in private, (host, private)
        assert netns.interfaces(pool[0]) == ["lo"]
        instance = instance_pids(ray_local)
        assert set(pool) <= instance
        everyone = sorted(instance | {os.getpid()})
        exposed = {pid: netns.non_loopback_listeners(pid) for pid in everyone}
        exposed[os.getpid()] = [socket for socket in exposed[os.getpid()] if socket not in LISTENERS_BEFORE]
        assert not any(exposed.values()), f"listeners another host can reach: {exposed}"
        for pid in instance:  # (an agent's helper may have ended since it was listed)
            if psutil.pid_exists(pid):
                assert thread_networks(pid) <= private, f"process {pid} runs outside the private network"
        # The driver's Ray threads are inside. (An instance this process started before, in a
        # network of its own, leaves gRPC's process-wide threads there: they live as long as the
        # process, and hold no listener: checked above.)
        assert {host} | private <= thread_networks(os.getpid())
        # The TensorFlow servers: the wildcard listeners of the private network (Ray's own are on
        # 127.0.0.1). From this machine's network (its own addresses, and its 127.0.0.1) they refuse.
        tensorflow = sorted({port for address, port in netns.listening_sockets(pool[0]) if address in ("0.0.0.0", "::")})
        assert len(tensorflow) >= POOL_SIZE[backend], netns.listening_sockets(pool[0])
        for port in tensorflow:
            for address in [*host_addresses(), "127.0.0.1"]:
                assert connect_error(address, port) == errno.ECONNREFUSED, f"{address}:{port} accepted"
        wait_for_steps(run, run.steps + 5, timeout=120)  # (and it still trains)
    finally:
        run.stop()
        run.wait(timeout=120)
    assert run.status == "stopped", run.stop_reason


@pytest.mark.slow
@pytest.mark.usefixtures("no_orphans")
def test_ray_calls_made_after_the_start_from_this_network_work(ray_local):
    """Threads started after the start, in this machine's network, drive Ray: the cluster's nodes
    and free resources (Ray's state accessor), a placement group, an actor's streaming generator,
    a large object, a kill; their connections are made by Ray's threads, inside."""
    import threading

    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from workbench._src.placements.ray.capacity import room_for

    @ray.remote(num_cpus=0.5)
    class Probe:
        def network(self):
            return os.readlink("/proc/self/ns/net")

        def count(self, n):
            for i in range(n):  # noqa: UP028 - a streaming generator: Ray drives it with send(), not `yield from`
                yield i

        def blob(self):
            return b"x" * (8 << 20)

    said, host = {}, os.readlink("/proc/self/ns/net")

    def drive():
        said["thread"] = os.readlink("/proc/thread-self/ns/net")
        said["nodes"] = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
        said["room"] = room_for(ray_local, 1, set())
        group = placement_group([{"CPU": 0.5}], strategy="PACK")
        try:
            ray.get(group.ready(), timeout=120)
            probe = Probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0)).remote()
            try:
                said["actor"] = ray.get(probe.network.remote(), timeout=120)
                said["count"] = [ray.get(ref) for ref in probe.count.remote(3)]
                said["blob"] = len(ray.get(probe.blob.remote(), timeout=60))
            finally:
                ray.kill(probe, no_restart=True)
        finally:
            remove_placement_group(group)
        said["done"] = True

    thread = threading.Thread(target=drive)
    thread.start()
    thread.join(timeout=300)
    assert not thread.is_alive() and said.get("done"), said
    assert said["thread"] == host and said["actor"] != host, said
    assert said["nodes"] == ["127.0.0.1"] and said["room"] and said["count"] == [0, 1, 2], said
    assert said["blob"] == 8 << 20


# An instance started on a thread that then ends (a background run's), used afterwards; shut down,
# and a second one started in the same process (a new private network), used too.
TWO_STARTS = """
import json, os, sys, threading, time
import workbench as wb
import ray

said = []
for attempt in range(2):
    cluster = wb.RayCluster(address=None, resources_per_worker={"CPU": 0.5}, placement="pack")
    starter = threading.Thread(target=cluster.connect)
    starter.start()
    starter.join()
    time.sleep(3)  # (a death tied to the ended thread is immediate)

    @ray.remote(num_cpus=0.5)
    def network():
        return os.readlink("/proc/self/ns/net")

    said.append({"task": ray.get(network.remote(), timeout=300), "owner": cluster.local_owner.network,
                 "nodes": len([n for n in ray.nodes() if n["Alive"]])})
    cluster.shutdown()
said.append({"host": os.readlink("/proc/self/ns/net"), "pid": os.getpid()})
print(json.dumps(said), flush=True)
"""


@pytest.mark.slow
def test_an_instance_outlives_the_thread_that_started_it_and_a_second_one_starts_in_a_new_network():
    """Ray ties each process it starts to the thread that started it (PR_SET_PDEATHSIG): the start
    runs on a thread of its own that lives as long as the instance, so an instance started from
    a thread that has ended still serves. A second instance after a shutdown gets a new private
    network and serves too."""
    pytest.importorskip("ray", reason='Ray is an optional extra: pip install -e ".[ray,test]"')
    if os.geteuid() != 0:
        pytest.skip("not root: a kernel joins a private network only as root")
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", TWO_STARTS], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    first, second, process = json.loads(done.stdout.strip().splitlines()[-1])
    for start in (first, second):
        assert start["task"] == start["owner"] != process["host"] and start["nodes"] == 1, (start, process)
    assert first["owner"] != second["owner"]
    import glob
    import tempfile

    roots = [f"{base}/wbray-{process['pid']}-*" for base in (tempfile.gettempdir(), "/tmp")]
    assert not [path for pattern in roots for path in glob.glob(pattern)]  # nothing left of either


# Not root, in a process with threads (a kernel): the instance's network cannot be joined.
WITHOUT_ROOT = """
import json, os, tempfile, threading, warnings
warnings.simplefilter("always")
threading.Thread(target=threading.Event().wait, daemon=True).start()  # (a kernel has threads)
from workbench._src.placements.ray.instance_owner import InstanceOwner
with warnings.catch_warnings(record=True) as caught:
    roots = [tempfile.mkdtemp() for _ in range(2)]  # (each start's; its sentinel's to sweep)
    owners = [InstanceOwner(start=lambda: None, end=lambda: None, root=root) for root in roots]  # two starts
    for owner, root in zip(owners, roots):
        owner.wait()
        owner.release()
        os.rmdir(root)
print(json.dumps({"same": [o.network == os.readlink("/proc/self/ns/net") for o in owners],
                  "uid": os.getuid(), "warnings": [str(w.message) for w in caught]}))
"""


def test_without_root_a_start_keeps_the_host_network_and_warns_once():
    """As `nobody`: a namespace comes with a user namespace, which a process with threads cannot
    join; the start runs in the host network, and says once what stays exposed and what to do."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as nobody")
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 that `nobody` may run")
    try:
        done = subprocess.run(
            [python, "-c", WITHOUT_ROOT], user=65534, group=65534, extra_groups=[], cwd="/",
            env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except PermissionError as error:
        pytest.skip(f"cannot run {python} as nobody: {error}")
    if done.returncode != 0 and "Permission denied" in done.stderr:
        pytest.skip(f"nobody cannot read the package: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["uid"] == 65534 and report["same"] == [True, True], report
    assert len(report["warnings"]) == 1, report["warnings"]
    message = report["warnings"][0]
    assert "local Ray instance could not get a private network" in message and "setns()" in message
    assert "listen on EVERY network interface" in message and "start the kernel as root" in message
