"""The fork server (workbench/_src/placements/local/fork_server.py): the workbench's worker and server
modules start as forks of a process that has imported TensorFlow, each as the process a fresh
`python -m` would have been (own session, pipes, log, environment, network), and nothing outlives
the launcher. The process-backend tests run every cluster through it."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from workbench._src.placements.local import fork_client, fork_server
from workbench._src.placements.local.processes import ProcessGroup
from workbench._src.placements.ports import free_ports

pytestmark = pytest.mark.slow  # each test process starts a fork server once (~3-5 s)

SERVER = "workbench._src.placements.local.server_main"
REPO = Path(__file__).resolve().parent.parent


def _server_env() -> tuple[dict, int]:
    port = free_ports(1)[0]
    return {"WORKBENCH_CLUSTER": json.dumps({"worker": [f"127.0.0.1:{port}"]})}, port


def _wait_listening(group, port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not group.port_open(port):
        assert time.monotonic() < deadline, f"the server did not listen within {timeout} s"
        time.sleep(0.05)


def test_a_server_is_forked_into_the_groups_network_and_session():
    group = ProcessGroup("fork-probe")
    try:
        env, port = _server_env()
        child = group.start("worker", 0, SERVER, env)
        assert isinstance(child.popen, fork_client.ForkedProcess)
        process = psutil.Process(child.pid)
        # `ps` shows the command it stands for; its parent is the fork server, not us
        assert SERVER in " ".join(process.cmdline())
        assert "fork_server" in " ".join(process.parent().cmdline())
        assert process.parent().ppid() == os.getpid()
        assert os.getsid(child.pid) == child.pid  # its own session: a kernel's interrupt stays there
        _wait_listening(group, port)  # listening inside the group's private network ...
        if group.network_isolated:
            assert os.readlink(f"/proc/{child.pid}/ns/net") == group.network.ns_id
            assert os.readlink(f"/proc/{child.pid}/ns/net") != os.readlink("/proc/self/ns/net")
        # ... and its output in its own log (the fork server's own stays in its folder)
        assert os.path.samefile(os.readlink(f"/proc/{child.pid}/fd/1"), child.log_path)
        os.kill(child.pid, signal.SIGKILL)
        assert child.popen.wait(timeout=10) == -signal.SIGKILL
        assert child.exit_description() == "killed by SIGKILL"
    finally:
        group.stop()


def test_a_forked_process_that_fails_reports_its_code_and_traceback():
    group = ProcessGroup("fork-probe", private_network=False)
    try:
        # A server with no cluster in its environment: the KeyError a fresh interpreter would print
        child = group.start("worker", 0, SERVER, {})
        assert isinstance(child.popen, fork_client.ForkedProcess)
        assert child.popen.wait(timeout=30) == 1
        assert child.exit_description() == "exited with code 1"
        assert "KeyError: 'WORKBENCH_CLUSTER'" in child.log_tail()
    finally:
        group.stop()


def test_the_parent_pipes_eof_ends_a_forked_process():
    group = ProcessGroup("fork-probe", private_network=False)
    try:
        env, port = _server_env()
        child = group.start("worker", 0, SERVER, env)
        _wait_listening(group, port)
        child.popen.stdin.close()  # what the launcher's death does
        assert child.popen.wait(timeout=20) == 4, child.log_tail()  # exit_when_parent_dies' code
    finally:
        group.stop()


def test_off_starts_a_fresh_interpreter(monkeypatch):
    monkeypatch.setenv(fork_server.FORK_SERVER_ENV, "off")
    group = ProcessGroup("fork-probe", private_network=False)
    try:
        env, port = _server_env()
        child = group.start("worker", 0, SERVER, env)
        assert isinstance(child.popen, subprocess.Popen)
        assert psutil.Process(child.pid).ppid() == os.getpid()
        _wait_listening(group, port)
    finally:
        group.stop()


def test_nothing_outlives_the_launcher(tmp_path):
    """A script starts a forked server and exits without stopping anything (stop_at_exit=False:
    the stdin rule alone): the server, the fork server and its folder are gone soon after."""
    script = tmp_path / "launcher.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, sys
            sys.path.insert(0, {str(REPO)!r})
            from workbench._src.placements.local import fork_client
            from workbench._src.placements.local.processes import ProcessGroup
            from workbench._src.placements.ports import free_ports
            group = ProcessGroup("fork-probe", stop_at_exit=False)
            port = free_ports(1)[0]
            child = group.start("worker", 0, {SERVER!r},
                                {{"WORKBENCH_CLUSTER": json.dumps({{"worker": [f"127.0.0.1:{{port}}"]}})}})
            server = fork_client.STATE.started[0]
            print(json.dumps({{"child": child.pid, "server": server.popen.pid, "folder": server.folder}}))
            """
        )
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    started = json.loads(done.stdout.strip().splitlines()[-1])
    deadline = time.monotonic() + 20
    left = [pid for pid in (started["child"], started["server"]) if psutil.pid_exists(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [
            p for p in left if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
    assert not left, f"still running after the launcher exited: {left}"
    assert not os.path.exists(started["folder"])
    assert done.stderr == ""


def test_a_malformed_request_is_dropped_and_the_fork_server_serves_on():
    group = ProcessGroup("fork-probe", private_network=False)
    try:
        first, second = free_ports(2)
        env = {"WORKBENCH_CLUSTER": json.dumps({"worker": [f"127.0.0.1:{first}", f"127.0.0.1:{second}"]})}
        group.start("worker", 0, SERVER, env)  # (the fork server is up)
        server = fork_client.STATE.server
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(server.path)
            s.send(b"not json")
            assert s.recv(100) == b""  # no answer: the client would start a fresh interpreter
        assert server.popen.poll() is None
        child = group.start("worker", 1, SERVER, env)
        assert isinstance(child.popen, fork_client.ForkedProcess)
        _wait_listening(group, second)
    finally:
        group.stop()
