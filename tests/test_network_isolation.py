"""Local clusters are reachable from this machine only (issue 15): the private network namespace.

No mocks: real processes in a real loopback-only network namespace, real TensorFlow servers, a
real MultiWorkerMirroredStrategy across two of them. Every check looks only at the processes,
ports and folders these tests started (other users share the machine).

This file is also the probe the tests start inside the namespace:
`python -m test_network_isolation link|nested|listen PORT` (with tests/ on PYTHONPATH).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Client

import pytest
from helpers import connect_error, host_addresses, wait_for

TESTS = os.path.dirname(os.path.abspath(__file__))
PROBE_ENV = {"PYTHONPATH": TESTS}
SERVER_MODULE = "workbench._src.placements.local.server_main"
WORKER_MODULE = "workbench._src.placements.local.worker_main"


def assert_unreachable_from_host(group, ports: list[int]) -> None:
    """Every port of the group: loopback-only namespace, refused on every address of the host."""
    from workbench._src.placements.local import netns

    ours = os.readlink("/proc/self/ns/net")
    for child in group.children:
        assert os.readlink(f"/proc/{child.pid}/ns/net") == group.network.ns_id != ours
        assert netns.interfaces(child.pid) == ["lo"]  # a wildcard bind there reaches lo only
        assert netns.exposed_sockets(child.pid) == []
    listening = {port for _, port in netns.listening_sockets(group.children[0].pid)}
    assert set(ports) <= listening, (ports, listening)
    # The same servers in the host network would be exposed: the helper does see them there.
    assert any(address in ("0.0.0.0", "::") for address, _ in netns.listening_sockets(group.children[0].pid))
    for port in ports:
        for host in [*host_addresses(), "127.0.0.1"]:
            assert connect_error(host, port) == errno.ECONNREFUSED, f"{host}:{port} accepted a connection"


# ----- TensorFlow servers in the namespace ------------------------------------------------------------
@pytest.mark.slow
def test_tensorflow_servers_are_unreachable_from_the_host():
    from workbench._src.placements.local.processes import ProcessGroup
    from workbench._src.placements.ports import free_ports

    group = ProcessGroup("isolation test")
    assert group.network_isolated, group.network.reason
    try:
        ports = free_ports(2)
        cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
        env = {"WORKBENCH_CLUSTER": json.dumps(cluster), "CUDA_VISIBLE_DEVICES": ""}
        for i in range(2):
            group.start("worker", i, SERVER_MODULE, env)
        wait_for(lambda: all(group.port_open(p) for p in ports) or group.unexpected_exits(), 90, "servers")
        assert not group.unexpected_exits(), [c.log_tail() for c in group.children]
        assert_unreachable_from_host(group, ports)
        assert not any(group.port_open(p) for p in free_ports(1))  # port_open looks inside, for real
        if host_addresses():  # and exposed_sockets does flag a wildcard bind in the host network
            from workbench._src.placements.local import netns

            with socket.socket() as exposed:
                exposed.bind(("0.0.0.0", 0))
                exposed.listen()
                port = exposed.getsockname()[1]
                assert ("0.0.0.0", port) in netns.exposed_sockets(os.getpid())
    finally:
        group.stop()


@pytest.mark.slow
def test_multi_worker_mirrored_strategy_runs_inside_the_private_network():
    from workbench._src.placements.local.channel import Channel
    from workbench._src.placements.local.processes import ProcessGroup
    from workbench._src.placements.ports import free_ports

    group = ProcessGroup("isolation test")
    channel = Channel(group)
    try:
        ports = free_ports(2)
        cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
        for i in range(2):
            tf_config = {"cluster": cluster, "task": {"type": "worker", "index": i}}
            env = {
                **PROBE_ENV,
                **channel.env(),
                "TF_CONFIG": json.dumps(tf_config),
                "CUDA_VISIBLE_DEVICES": "",
            }
            group.start("worker", i, "test_network_isolation", env, ["all-reduce"])
        seen: dict[str, dict] = {}

        def heard(kind: str):
            while not channel.messages.empty():
                task, message = channel.messages.get()
                seen.setdefault(message["type"], {})[task] = message
            assert not group.unexpected_exits(), [c.log_tail() for c in group.children]
            return len(seen.get(kind, {})) == 2

        wait_for(lambda: heard("reduced"), 120, "both workers to run the all-reduce")
        assert_unreachable_from_host(group, ports)  # while the two servers are up
        assert [m["sum"] for m in seen["reduced"].values()] == [3.0, 3.0]  # 1 + 2 across processes
        assert {m["net"] for m in seen["reduced"].values()} == {group.network.ns_id}
        assert channel.rejected == 0
        channel.broadcast({"type": "go"})
        for child in group.children:
            child.popen.wait(timeout=30)
            assert child.popen.returncode == 0, child.log_tail()
    finally:
        group.stop()
        channel.close()


def say_bye(channel, child) -> None:
    """Ends a "link" probe child through the channel; it must exit cleanly."""
    assert channel.send("worker:0", {"type": "bye"})
    child.popen.wait(timeout=10)
    assert child.popen.returncode == 0, child.log_tail()


# ----- the channel over a Unix socket -------------------------------------------------------------------
@pytest.mark.slow
def test_channel_accepts_its_children_in_the_namespace_and_rejects_others():
    from workbench._src.placements.local.channel import Channel
    from workbench._src.placements.local.processes import ProcessGroup

    group = ProcessGroup("isolation test")
    channel = Channel(group)
    try:
        assert channel.address.startswith(channel.folder) and os.stat(channel.folder).st_mode & 0o777 == 0o700
        child = group.start("worker", 0, "test_network_isolation", {**PROBE_ENV, **channel.env()}, ["link"])
        task, hello = channel.messages.get(timeout=30)
        assert (task, hello["pid"]) == ("worker:0", child.pid)
        task, report = channel.messages.get(timeout=10)
        assert report == {"type": "net", "net": group.network.ns_id}  # it is inside, and got through

        import pytest

        with pytest.raises(Exception):  # noqa: B017 - multiprocessing.AuthenticationError
            Client(channel.address, family="AF_UNIX", authkey=b"not the key")
        stranger = Client(channel.address, family="AF_UNIX", authkey=channel.key)  # not our process
        stranger.send({"type": "hello", "task": "worker:1", "pid": os.getpid()})
        impostor = Client(channel.address, family="AF_UNIX", authkey=channel.key)  # claims a child's pid
        impostor.send({"type": "hello", "task": "worker:1", "pid": child.pid})
        wait_for(lambda: channel.rejected >= 3, 10, "three rejections")
        assert channel.rejected == 3
        for conn in (stranger, impostor):
            with pytest.raises((EOFError, OSError)):
                conn.recv()
        say_bye(channel, child)
    finally:
        group.stop()
        channel.close()


@pytest.mark.slow
def test_a_child_that_says_hello_before_the_group_has_recorded_its_pid_is_accepted():
    # On a busy machine the launcher's thread can be held between Popen's return and the group's
    # record of the child, while the child already says hello. Here that record comes 3 s late.
    from workbench._src.placements.local.channel import PID_RECORD_WAIT, Channel
    from workbench._src.placements.local.processes import ProcessGroup

    class RecordedLate(list):
        def append(self, child):
            time.sleep(3.0)  # the child starts, connects and says hello meanwhile
            super().append(child)

    assert PID_RECORD_WAIT > 3.0
    group = ProcessGroup("isolation test")
    channel = Channel(group)
    group.children = RecordedLate()
    try:
        child = group.start("worker", 0, "test_network_isolation", {**PROBE_ENV, **channel.env()}, ["link"])
        task, hello = channel.messages.get(timeout=30)
        assert (task, hello["pid"]) == ("worker:0", child.pid) and channel.rejected == 0
        say_bye(channel, child)
    finally:
        group.stop()
        channel.close()


def test_what_a_child_said_that_the_launchers_reader_has_not_taken_yet_is_seen_as_unread():
    # A launcher held up (its reader thread stuck) must not call a member silent whose messages
    # wait in the socket (launch/watch.py asks `unread` before it does). The reader is held here
    # at its queue, by its lock: the first "spoke" is read and waits to be queued, the second
    # waits in the socket.
    from workbench._src.placements.local.channel import Channel
    from workbench._src.placements.local.processes import ProcessGroup

    group = ProcessGroup("isolation test")
    channel = Channel(group)
    try:
        child = group.start("worker", 0, "test_network_isolation", {**PROBE_ENV, **channel.env()}, ["speak"])
        assert channel.messages.get(timeout=30)[1]["type"] == "hello"
        assert not channel.unread("worker:0")
        with channel.messages.mutex:
            assert channel.send("worker:0", {"type": "speak"})
            deadline = time.monotonic() + 30
            while not channel.unread("worker:0") and time.monotonic() < deadline:
                time.sleep(0.01)
            unread, queued = channel.unread("worker:0"), len(channel.messages.queue)
        assert unread and queued == 0
        assert [channel.messages.get(timeout=30)[1]["type"] for _ in range(2)] == ["spoke", "spoke"]
        assert not channel.unread("worker:0")
        say_bye(channel, child)
    finally:
        group.stop()
        channel.close()


# ----- a group inside the namespace inherits it -------------------------------------------------------
@pytest.mark.slow
def test_group_started_inside_the_namespace_shares_it():
    from workbench._src.placements.local.processes import ProcessGroup

    group = ProcessGroup("isolation test")
    try:
        child = group.start("coordinator", 0, "test_network_isolation", PROBE_ENV, ["nested"])

        def report():
            assert child.popen.poll() is None, child.log_path.read_text()
            lines = [line for line in child.log_path.read_text().splitlines() if line.startswith("{")]
            return json.loads(lines[-1]) if lines else None

        found = wait_for(report, 60, "the coordinator's report")
        assert found["isolated"] and found["inherited"]
        assert found["grandchild_net"] == found["net"] == group.network.ns_id
        assert found["port_open_inside"]  # the grandchild's server, seen from the coordinator
        assert connect_error("127.0.0.1", found["port"]) == errno.ECONNREFUSED  # not from here
        assert os.path.dirname(found["log_dir"]) == str(group.log_dir)  # nested: removed with ours
    finally:
        group.stop()
    assert not group.log_dir.exists()


# ----- temporary folders -------------------------------------------------------------------------------
@pytest.mark.slow
def test_log_and_channel_folders_are_removed(monkeypatch):
    from workbench._src.placements.local.channel import Channel
    from workbench._src.placements.local.processes import ProcessGroup

    group = ProcessGroup("isolation test")
    channel = Channel(group)
    child = group.start("worker", 0, "test_network_isolation", {**PROBE_ENV, **channel.env()}, ["link"])
    channel.messages.get(timeout=30)
    assert child.log_path.exists() and os.path.exists(channel.address)
    group.stop()
    channel.close()
    assert not group.log_dir.exists() and not os.path.exists(channel.folder)

    monkeypatch.setenv("WORKBENCH_KEEP_LOGS", "1")
    kept = ProcessGroup("isolation test")
    try:
        kept.start("worker", 0, "test_network_isolation", PROBE_ENV, ["netid"]).popen.wait(timeout=30)
        kept.stop()
        assert (kept.log_dir / "worker-0.log").exists()
    finally:
        shutil.rmtree(kept.log_dir, ignore_errors=True)


@pytest.mark.slow
def test_a_killed_launcher_leaves_no_folders_or_processes():
    """A kernel killed outright runs no clean-up: its children remove its folders as they exit."""
    import psutil

    script = """
import json, sys, time
from workbench._src.placements.local.channel import Channel
from workbench._src.placements.local.processes import ProcessGroup
group = ProcessGroup("killed launcher")
channel = Channel(group)
child = group.start("worker", 0, "test_network_isolation", channel.env(), ["link"])
channel.messages.get(timeout=30)
print(json.dumps({"logs": str(group.log_dir), "channel": channel.folder, "child": child.pid}), flush=True)
time.sleep(600)
"""
    launcher = subprocess.Popen(
        [sys.executable, "-c", script], env={**os.environ, **PROBE_ENV}, stdout=subprocess.PIPE, text=True
    )
    try:
        made = json.loads(launcher.stdout.readline())
        child = psutil.Process(made["child"])
        assert os.path.isdir(made["logs"]) and os.path.isdir(made["channel"])
    finally:
        launcher.kill()
        launcher.wait()
    child.wait(timeout=10)
    assert not os.path.exists(made["logs"]) and not os.path.exists(made["channel"])


@pytest.mark.slow
def test_a_child_outlives_its_dead_launcher_by_seconds_even_when_its_pipe_stays_open():
    """EOF on the child's stdin needs every copy of the pipe's write end closed. A process forked
    from the launcher without exec keeps one: the child then goes by the launcher's pid."""
    import psutil

    script = """
import json, os, time
from workbench._src.placements.local.channel import Channel
from workbench._src.placements.local.processes import ProcessGroup
group = ProcessGroup("launcher with a fork")
channel = Channel(group)
child = group.start("worker", 0, "test_network_isolation", channel.env(), ["link"])
channel.messages.get(timeout=30)
holder = os.fork()  # holds a copy of every descriptor, the child's stdin pipe among them
if holder == 0:
    time.sleep(600)
    os._exit(0)
print(json.dumps({"child": child.pid, "holder": holder}), flush=True)
time.sleep(600)
"""
    launcher = subprocess.Popen(
        [sys.executable, "-c", script], env={**os.environ, **PROBE_ENV}, stdout=subprocess.PIPE, text=True
    )
    made = {}
    try:
        made = json.loads(launcher.stdout.readline())
        child = psutil.Process(made["child"])
        launcher.kill()
        launcher.wait()
        child.wait(timeout=10)  # psutil.TimeoutExpired: the child waited for an EOF that never came
        assert psutil.pid_exists(made["holder"])  # (the pipe was still open all along)
    finally:
        launcher.kill()
        launcher.wait()
        if made.get("holder"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(made["holder"], 9)


# ----- without root, and where namespaces are refused ---------------------------------------------------
def test_unprivileged_user_gets_a_user_and_network_namespace():
    """Most users are not root: the user-namespace path, run as `nobody` (needs root to switch)."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("not root: the other tests in this file already take the unprivileged path")
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 that `nobody` may run")
    script = f"""
import importlib.util, json, os, subprocess, sys, time
spec = importlib.util.spec_from_file_location("netns", {_netns_path()!r})
netns = importlib.util.module_from_spec(spec); spec.loader.exec_module(netns)
network = netns.open_network("test")
argv, fds = network.wrap([sys.executable, "-c", "import os, socket, time; s = socket.socket(); "
    "s.bind(('127.0.0.1', 0)); s.listen(); print(s.getsockname()[1], flush=True); time.sleep(30)"])
child = subprocess.Popen(argv, pass_fds=fds, stdout=subprocess.PIPE, text=True)
port = int(child.stdout.readline())
print(json.dumps({{"isolated": network.isolated, "reason": network.reason, "kinds": sorted(network._fds),
    "uid": os.getuid(), "child_net": os.readlink(f"/proc/{{child.pid}}/ns/net"), "ns_id": network.ns_id,
    "interfaces": netns.interfaces(child.pid), "listening": netns.listening_sockets(child.pid), "port": port}}))
child.kill()
"""
    try:
        done = subprocess.run(
            [python, "-c", script], user=65534, group=65534, extra_groups=[], cwd="/",
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except PermissionError as error:
        pytest.skip(f"cannot run {python} as nobody: {error}")
    if done.returncode != 0 and "Permission denied" in done.stderr:
        pytest.skip(f"nobody cannot read the package: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["isolated"], report["reason"]
    assert report["kinds"] == ["net", "user"] and report["uid"] == 65534  # ids mapped to themselves
    assert report["child_net"] == report["ns_id"] and report["interfaces"] == ["lo"]
    assert report["listening"] == [["127.0.0.1", report["port"]]]


@pytest.mark.slow
def test_tensorflow_collectives_through_the_user_namespace_path():
    """What a non-root user gets (a user + network namespace), with real TensorFlow processes:
    the launcher runs as uid 1000 in a user namespace of its own, so it cannot take root's path."""
    import pytest

    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs util-linux unshare to run the launcher as a non-root user")
    script = """
import errno, json, os
import test_network_isolation as t
from workbench._src.placements.local import netns
from workbench._src.placements.local.channel import Channel
from workbench._src.placements.local.processes import ProcessGroup
from workbench._src.placements.ports import free_ports
group = ProcessGroup("user namespace test")
channel = Channel(group)
ports = free_ports(2)
cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
for i in range(2):
    tf_config = {"cluster": cluster, "task": {"type": "worker", "index": i}}
    env = {**channel.env(), "TF_CONFIG": json.dumps(tf_config), "CUDA_VISIBLE_DEVICES": ""}
    group.start("worker", i, "test_network_isolation", env, ["all-reduce"])
reduced = [channel.messages.get(timeout=120)[1] for _ in range(4)]
reduced = [m for m in reduced if m["type"] == "reduced"]
pid = group.children[0].pid
print(json.dumps({"uid": os.geteuid(), "kinds": sorted(group.network._fds), "sums": [m["sum"] for m in reduced],
    "nets": sorted({m["net"] for m in reduced}), "ns_id": group.network.ns_id, "ports": ports,
    "listening": [p for _, p in netns.listening_sockets(pid)], "exposed": netns.exposed_sockets(pid),
    "accepted": [f"{h}:{p}" for p in ports for h in [*t.host_addresses(), "127.0.0.1"]
                 if t.connect_error(h, p) != errno.ECONNREFUSED]}), flush=True)
channel.broadcast({"type": "go"})
for c in group.children:
    c.popen.wait(timeout=30)
group.stop()
channel.close()
"""
    done = subprocess.run(
        [unshare, "--user", "--map-user=1000", "--map-group=1000", sys.executable, "-c", script],
        env={**os.environ, **PROBE_ENV}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    if "unshare failed" in done.stderr:
        pytest.skip(f"cannot make the test's user namespace: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["uid"] == 1000 and report["kinds"] == ["net", "user"]
    assert report["sums"] == [3.0, 3.0] and report["nets"] == [report["ns_id"]]
    assert set(report["ports"]) <= set(report["listening"]) and report["exposed"] == []
    assert report["accepted"] == []  # checked from the host network while the servers were up


@pytest.mark.slow
def test_refused_namespaces_warn_once_and_fall_back():
    """A user namespace whose uid is not mapped may not make namespaces: a real refusal."""
    import pytest

    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs util-linux unshare to make a process that may not create namespaces")
    script = """
import json, warnings
warnings.simplefilter("always")
from workbench._src.placements.local.processes import ProcessGroup
with warnings.catch_warnings(record=True) as caught:
    groups = [ProcessGroup("multi-worker"), ProcessGroup("async-ps")]
    child = groups[0].start("worker", 0, "test_network_isolation", {}, ["netid"])
    child.popen.wait(timeout=30)
    for g in groups:
        g.stop()
print(json.dumps({"isolated": [g.network_isolated for g in groups], "code": child.popen.returncode,
                  "warnings": [str(w.message) for w in caught]}))
"""
    done = subprocess.run(
        [unshare, "--user", sys.executable, "-c", script],
        env={**os.environ, **PROBE_ENV}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if "unshare failed" in done.stderr:
        pytest.skip(f"cannot make the test's user namespace: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["isolated"] == [False, False] and report["code"] == 0
    assert len(report["warnings"]) == 1  # once per process, not once per group
    message = report["warnings"][0]
    assert "could not get a private network" in message and "Operation not permitted" in message
    assert "listen on EVERY network interface" in message and "Fix:" in message


@pytest.mark.slow
def test_opting_out_runs_in_the_host_network_and_children_follow():
    """WORKBENCH_PRIVATE_NETWORK=off: the host network, warned; a group made by a child follows."""
    script = """
import json, time, warnings
warnings.simplefilter("always")
from workbench._src.placements.local.processes import ProcessGroup
with warnings.catch_warnings(record=True) as caught:
    group = ProcessGroup("multi-worker")
    child = group.start("coordinator", 0, "test_network_isolation", {}, ["nested"])
    report = None
    while report is None and child.popen.poll() is None:
        lines = [l for l in child.log_path.read_text().splitlines() if l.startswith("{")]
        report = json.loads(lines[-1]) if lines else time.sleep(0.1)
    group.stop()
print(json.dumps({"isolated": group.network_isolated, "child": report, "warnings": [str(w.message) for w in caught]}))
"""
    env = {**os.environ, **PROBE_ENV, "WORKBENCH_PRIVATE_NETWORK": "off"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["isolated"] is False and report["child"]["isolated"] is False
    assert report["child"]["net"] == report["child"]["grandchild_net"] == os.readlink("/proc/self/ns/net")
    assert report["child"]["port_open_inside"]  # coordinator and its server share the host network
    assert len(report["warnings"]) == 1 and "WORKBENCH_PRIVATE_NETWORK=off is set" in report["warnings"][0]


def _netns_path() -> str:
    from workbench._src.placements.local import netns

    return netns.__file__


# ----- the probe, run inside the namespace -------------------------------------------------------------
def _probe(args: list[str]) -> None:
    if args[0] == "link":
        from workbench._src.placements.local.channel import ParentLink, exit_when_parent_dies

        exit_when_parent_dies()
        link = ParentLink()
        link.send({"type": "net", "net": os.readlink("/proc/self/ns/net")})
        link.recv()
        os._exit(0)  # as worker_main: the parent-watch thread holds stdin's lock
    elif args[0] == "speak":
        from workbench._src.placements.local.channel import ParentLink, exit_when_parent_dies

        exit_when_parent_dies()
        link = ParentLink()
        assert link.recv() == {"type": "speak"}
        link.send({"type": "spoke"})
        link.send({"type": "spoke"})
        link.recv()
        os._exit(0)
    elif args[0] == "all-reduce":
        _all_reduce()
    elif args[0] == "netid":
        print(os.readlink("/proc/self/ns/net"), flush=True)
    elif args[0] == "listen":
        with socket.socket() as s:
            s.bind(("127.0.0.1", int(args[1])))
            s.listen()
            print(s.getsockname()[1], flush=True)
            sys.stdin.read()  # until the parent goes (or stops us)
    elif args[0] == "nested":
        from workbench._src.placements.local.processes import ProcessGroup, port_open

        group = ProcessGroup("nested")
        child = group.start("server", 0, "test_network_isolation", PROBE_ENV, ["listen", "0"])
        port = int(wait_for(lambda: child.log_path.read_text().strip() or None, 30, "the port"))
        report = {
            "isolated": group.network_isolated,
            "inherited": group.network.inherited,
            "net": os.readlink("/proc/self/ns/net"),
            "grandchild_net": os.readlink(f"/proc/{child.pid}/ns/net"),
            "port_open_inside": port_open(port) and group.port_open(port),
            "port": port,
            "log_dir": str(group.log_dir),
        }
        print(json.dumps(report), flush=True)
        sys.stdin.read()  # serve until the test stops us; the grandchild follows (stdin EOF)


def _all_reduce() -> None:
    # A real collective across the two worker processes, over 127.0.0.1 inside the namespace.
    import tensorflow as tf

    from workbench._src.placements.local.channel import ParentLink, exit_when_parent_dies

    exit_when_parent_dies()
    link = ParentLink()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = strategy.cluster_resolver.task_id
    value = strategy.run(lambda: tf.constant(float(task + 1)))
    total = strategy.reduce("SUM", value, axis=None)
    link.send({"type": "reduced", "sum": float(total), "net": os.readlink("/proc/self/ns/net")})
    link.recv()  # "go": the test has looked at the live servers
    os._exit(0)  # the collective runtime can hang a normal shutdown (as in worker_main)


if __name__ == "__main__":
    _probe(sys.argv[1:])
