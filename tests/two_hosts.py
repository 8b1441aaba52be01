"""Two test hosts on one machine: two network namespaces joined by a veth pair (NOTES.md).

`TwoHosts()` makes them with names and a 10.x.y.0/24 subnet unique to this test process, so two
runs on one machine never meet; `close()` ends every process started in them (by the pids
`ip netns pids` lists for its own namespaces) and deletes the namespaces. Tests that need it skip
with the reason where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

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
