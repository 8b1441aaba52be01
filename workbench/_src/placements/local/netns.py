"""A private network for the processes of a local cluster: reachable from this machine only.

TensorFlow binds its gRPC servers (workers, parameter servers, the coordinator) to every
interface, without authentication, in C++. So instead of changing where they bind, the processes
of a local cluster run in a network namespace of their own that holds nothing but a loopback
device: 127.0.0.1 inside it is theirs alone, and no address of the machine leads in. The launcher
stays in the host namespace and talks to them over a Unix socket (a path in the file system is
reachable from every network namespace; see channel.py).

How, without root: a tiny anchor process (`python -I netns.py anchor`) calls
`unshare(CLONE_NEWUSER | CLONE_NEWNET)`, maps its own uid/gid (so files keep their owner), brings
`lo` up and reports back; the launcher opens its /proc/<pid>/ns/{user,net} files and keeps the
descriptors, which keep the namespace alive, and the anchor exits. Each child is then started
through `python -I netns.py join USER_FD NET_FD -- python -m module`, which `setns()`s into both
and `exec`s the real command (same pid, same session, same pipes). A wrapper rather than a
`preexec_fn`: preexec_fn is unsafe in a threaded parent (a notebook kernel is), and a
fresh interpreter is single-threaded, as `setns(CLONE_NEWUSER)` requires. A child forked by the
fork server (fork_server.py) is single-threaded too, and calls the same `enter()` itself. When
already root, `CLONE_NEWNET` alone is tried first: a user namespace would take away root's rights
over files owned by other users.

A process inside such a network carries PRIVATE_NETWORK_ENV (the namespace's id); a process group
started there (the async-ps coordinator starting its servers) makes no namespace of its own: its
children inherit the one they are in. Where the system refuses namespaces, `open_network()` warns
once, says what stays exposed, and the group runs in the host network as before.
"""

from __future__ import annotations

# Only os and sys at the top: this file is also the `join` wrapper every child starts through,
# so its start-up time is paid per child (subprocess alone costs more than the rest).
import os
import sys

# "net:[<inode>]": this process runs in that private namespace (children of a group inherit it).
# "off": local clusters run in the host network (set by hand to opt out, e.g. to attach a profiler
# to a worker's port; set by a group that could not isolate, so its children's groups follow it).
PRIVATE_NETWORK_ENV = "WORKBENCH_PRIVATE_NETWORK"
OFF = "off"

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_warned = False
_FIX_REFUSED = (
    "allow unprivileged user namespaces (sysctl user.max_user_namespaces > 0, "
    "kernel.unprivileged_userns_clone=1, or lift the AppArmor userns restriction on Ubuntu), or "
    "firewall incoming TCP on this machine"
)


class PrivateNetwork:
    """The network namespace one process group's children share (or the host's, on fallback).

    Attributes:
      isolated: True when the children run in a loopback-only namespace (made here or inherited).
      inherited: True when this process already runs in one; children simply inherit it.
      reason: why isolation did not hold ("" when it did).
      setup_seconds: what making the namespace cost.
    """

    def __init__(self, isolated: bool, inherited: bool = False, reason: str = "", fds=None, ns_id=""):
        self.isolated = isolated
        self.inherited = inherited
        self.reason = reason
        self.ns_id = ns_id  # "net:[...]", the value children get in PRIVATE_NETWORK_ENV
        self.setup_seconds = 0.0
        self._fds: dict[str, int] = dict(fds or {})  # "user"/"net" -> descriptor keeping it alive

    def wrap(self, argv: list[str]) -> tuple[list[str], tuple[int, ...]]:
        """The command that runs `argv` inside this network, and the descriptors it must inherit."""
        if not self._fds:
            return list(argv), ()  # host network, or inherited: the child is where we are
        user, net = self._fds.get("user", -1), self._fds["net"]
        wrapper = [sys.executable, "-I", "-S", os.path.abspath(__file__), "join", str(user), str(net), "--"]
        return wrapper + list(argv), tuple(fd for fd in (user, net) if fd >= 0)

    def namespace_fds(self) -> dict[str, int]:
        """The descriptors ("user", "net") of the namespaces made for the children ({} when they
        stay where this process is: host network, or inherited)."""
        return dict(self._fds)

    def env(self) -> dict[str, str]:
        # Children of a group that is not isolated stay in the host network too, and so do the
        # groups they make: a coordinator must share its servers' network.
        return {PRIVATE_NETWORK_ENV: self.ns_id if self.isolated else OFF}

    def close(self) -> None:
        """Drops the descriptors: the namespace ends when its last process does."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass


def current_network_id() -> str:
    return os.readlink("/proc/self/ns/net")


def inside_private_network() -> bool:
    """True when this process runs in a private network a workbench launcher made."""
    marker = os.environ.get(PRIVATE_NETWORK_ENV, "")
    # Compared with the real namespace: a stale variable (copied into an unrelated process) is no
    # reason to skip isolation.
    try:
        return bool(marker) and marker == current_network_id()
    except OSError:
        return False


def open_network(label: str = "local cluster", timeout: float = 20.0) -> PrivateNetwork:
    """A loopback-only network for a process group; on refusal warns once and returns the host's."""
    if inside_private_network():
        return PrivateNetwork(True, inherited=True, ns_id=os.environ[PRIVATE_NETWORK_ENV])
    if os.environ.get(PRIVATE_NETWORK_ENV) == OFF:
        reason = f"{PRIVATE_NETWORK_ENV}={OFF} is set"
        # A launched child (WORKBENCH_TASK set) follows its launcher, which has warned already.
        if not os.environ.get("WORKBENCH_TASK"):
            warn_exposed(label, reason, fix=f"unset {PRIVATE_NETWORK_ENV} once you are done")
        return PrivateNetwork(False, reason=reason)
    import time

    started = time.monotonic()
    try:
        if not sys.platform.startswith("linux"):
            raise _Refused(f"network namespaces are a Linux feature; this is {sys.platform}")
        try:
            network = _make_namespace(timeout)
        except OSError as error:  # the helper could not even start (no fds, no processes left)
            raise _Refused(f"cannot start the namespace helper: {error}") from None
    except _Refused as refusal:
        warn_exposed(label, str(refusal))
        return PrivateNetwork(False, reason=str(refusal))
    network.setup_seconds = time.monotonic() - started
    return network


class _Refused(Exception):
    pass


def _make_namespace(timeout: float) -> PrivateNetwork:
    import contextlib
    import select
    import subprocess

    anchor = subprocess.Popen(
        [sys.executable, "-I", "-S", os.path.abspath(__file__), "anchor"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        close_fds=True,
        start_new_session=True,
    )
    fds: dict[str, int] = {}
    try:
        ready, _, _ = select.select([anchor.stdout], [], [], timeout)
        line = anchor.stdout.readline().decode(errors="replace").strip() if ready else ""
        if line.startswith("error "):
            raise _Refused(line.removeprefix("error "))
        if not line.startswith("ok "):
            said = f"it said {line!r}" if line else f"no answer in {timeout:.0f} s"
            raise _Refused(f"the helper `python {__file__} anchor` failed: {said}")
        kinds = line.split()[1].split(",")  # "user,net" or "net"
        for kind in kinds:
            fds[kind] = os.open(f"/proc/{anchor.pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
        ns_id = f"net:[{os.fstat(fds['net']).st_ino}]"
        return PrivateNetwork(True, fds=fds, ns_id=ns_id)
    except OSError as error:
        for fd in fds.values():
            os.close(fd)
        raise _Refused(f"cannot open the namespace of the helper process: {error}") from None
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    finally:
        with contextlib.suppress(OSError):
            anchor.stdin.close()  # EOF: the anchor exits; our descriptors keep the namespace
        with contextlib.suppress(subprocess.TimeoutExpired):
            anchor.wait(timeout=5)
        if anchor.poll() is None:
            anchor.kill()
            anchor.wait()
        anchor.stdout.close()


def warn_exposed(label: str, reason: str, fix: str = "") -> None:
    """The warning (once per process, shared by local pools and a local Ray instance) that a
    group's TensorFlow servers run in this machine's network: `reason` why, `fix` what to do (by
    default: allow namespaces)."""
    import warnings

    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        f"workbench: the {label} could not get a private network ({reason}). Its processes run in "
        "this machine's network instead, and their TensorFlow gRPC servers (workers, parameter "
        "servers, coordinator) listen on EVERY network interface without authentication while a "
        "run lasts: anyone who can reach this machine can read and write files and run code in "
        f"them. Fix: {fix or _FIX_REFUSED}. This warning is shown once per process.",
        RuntimeWarning,
        stacklevel=4,
    )


# ----- inspection: what a namespace listens on ------------------------------------------------------
def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket in the network namespace of process `pid`."""
    return [(address, port) for address, port, _ in _listening_rows(str(pid))]


def interfaces(pid) -> list[str]:
    """Names of the network interfaces in the namespace of process `pid` ("lo" only when private);
    `pid` may also be "PID/task/TID", a thread's namespace."""
    with open(f"/proc/{pid}/net/dev") as f:
        return [line.split(":")[0].strip() for line in f.read().splitlines()[2:]]


def exposed_sockets(pid: int) -> list[tuple[str, int]]:
    """The listening sockets of `pid`'s network namespace that another machine could reach: none
    in a loopback-only namespace; elsewhere those bound to a wildcard or non-loopback address."""
    if interfaces(pid) == ["lo"]:
        return []
    return [(a, p) for a, p in listening_sockets(pid) if not _loopback(a)]


def _loopback(address: str) -> bool:
    """127.0.0.0/8 or ::1, also as an IPv4-mapped IPv6 address (::ffff:127.0.0.1, which Python's
    is_loopback does not see before 3.13)."""
    import ipaddress

    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def own_listeners(pid: int) -> list[tuple[str, str, int, bool]]:
    """(network namespace, address, port, closed) of each listening TCP socket that process `pid`
    holds itself (not its namespace's other processes'); `closed`: in a loopback-only namespace.
    Every namespace one of its threads is in is read: a thread can be in another network than its
    process's main thread (a kernel's Ray threads are: placements/ray/instance_owner.py), and
    /proc/<pid>/net (psutil's source too) shows only the main thread's. A socket made in a
    namespace none of its threads is in any more is not seen."""
    found, sockets, networks = [], set(), {}
    for path, kind in ((f"/proc/{pid}/fd", "fd"), (f"/proc/{pid}/task", "task")):
        try:
            names = os.listdir(path)
        except OSError:  # (the process ended)
            return []
        for name in names:
            try:
                if kind == "fd":
                    sockets.add(os.readlink(f"{path}/{name}"))  # "socket:[inode]" for a socket
                else:
                    networks.setdefault(os.readlink(f"{path}/{name}/ns/net"), f"{pid}/task/{name}")
            except OSError:  # (closed, or the thread ended, meanwhile)
                pass
    for network, thread in networks.items():
        try:
            closed = interfaces(thread) == ["lo"]
            rows = _listening_rows(thread)
        except OSError:
            continue
        found += [(network, a, port, closed) for a, port, inode in rows if f"socket:[{inode}]" in sockets]
    return found


def non_loopback_listeners(pid: int) -> list[tuple[str, str, int]]:
    """(network namespace, address, port) of each listening TCP socket that process `pid` holds
    itself and another host could reach: bound to a wildcard or non-loopback address, in a
    namespace with more than a loopback device (own_listeners)."""
    return [(n, a, port) for n, a, port, closed in own_listeners(pid) if not closed and not _loopback(a)]


def _listening_rows(proc_entry: str) -> list[tuple[str, int, str]]:
    """(address, port, socket inode) of the listening TCP sockets in /proc/<proc_entry>/net (a
    missing table, as tcp6 without IPv6 or of an ended process, has none)."""
    rows = []
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{proc_entry}/net/{name}") as f:
                table = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in table:
            fields = row.split()
            if fields[3] == "0A":  # TCP_LISTEN
                address, port = fields[1].split(":")
                rows.append((_address(address), int(port, 16), fields[9]))
    return rows


def enter_network_of_this_thread(net_fd: int) -> None:
    """Moves the calling thread, and only it, into the network namespace of `net_fd` (allowed in
    a multi-threaded process, unlike a user namespace's setns): threads and processes it starts
    from then on, and sockets it makes, are in that network. Needs CAP_SYS_ADMIN over the
    namespace (root, or its own user namespace: not reachable from a process with threads)."""
    _call(_libc(), "setns", net_fd, _CLONE_NEWNET)


def _address(hex_address: str) -> str:
    import ipaddress

    raw = bytes.fromhex(hex_address)
    # /proc prints each 32-bit word in host byte order (little-endian here).
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw))


# ----- the helper processes (run as `python -I netns.py anchor|join ...`) ---------------------------
def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _call(libc, name: str, *args) -> None:
    import ctypes

    if getattr(libc, name)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def _anchor() -> None:
    libc = _libc()
    uid, gid = os.geteuid(), os.getegid()
    attempts = [_CLONE_NEWNET, _CLONE_NEWUSER | _CLONE_NEWNET]
    if uid != 0:
        attempts = attempts[1:]  # without root only a user namespace grants the right to make one
    errors = []
    for flags in attempts:
        try:
            _call(libc, "unshare", flags)
            break
        except OSError as error:
            errors.append(f"unshare({_flag_names(flags)}) failed: {error.strerror}")
    else:
        print("error " + "; ".join(errors), flush=True)
        return
    try:
        if flags & _CLONE_NEWUSER:
            # Map our own ids to themselves: files keep their owner inside. setgroups must be
            # denied before an unprivileged process may write gid_map.
            _write("/proc/self/uid_map", f"{uid} {uid} 1\n")
            _write("/proc/self/setgroups", "deny\n")
            _write("/proc/self/gid_map", f"{gid} {gid} 1\n")
        _loopback_up()
    except OSError as error:
        print(f"error {_flag_names(flags)} made, but setting it up failed: {error}", flush=True)
        return
    print("ok " + ("user,net" if flags & _CLONE_NEWUSER else "net"), flush=True)
    sys.stdin.buffer.read()  # until the launcher has opened our namespace files


def _flag_names(flags: int) -> str:
    return " | ".join(
        n for f, n in ((_CLONE_NEWUSER, "CLONE_NEWUSER"), (_CLONE_NEWNET, "CLONE_NEWNET")) if flags & f
    )


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _loopback_up() -> None:
    import fcntl
    import socket
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), siocgifflags, request))[1]
        fcntl.ioctl(s.fileno(), siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def enter(user_fd: int, net_fd: int) -> None:
    """Moves this (single-threaded) process into the namespaces of the two descriptors (-1: that
    one stays), closing them; also a fork server's child's way in (fork_server.py)."""
    libc = _libc()
    for fd, kind, flag in ((user_fd, "user", _CLONE_NEWUSER), (net_fd, "net", _CLONE_NEWNET)):
        # The user namespace first: it gives the rights (in it) to join its network. Joining the
        # namespace we are already in is refused for a user namespace: skipped.
        if fd < 0:
            continue
        if os.fstat(fd).st_ino != os.stat(f"/proc/self/ns/{kind}").st_ino:
            _call(libc, "setns", fd, flag)
        os.close(fd)


def _join(user_fd: int, net_fd: int, argv: list[str]) -> None:
    enter(user_fd, net_fd)
    os.execv(argv[0], argv)


def _main(args: list[str]) -> None:
    if args[:1] == ["anchor"]:
        _anchor()
    elif args[:1] == ["join"] and len(args) > 4 and args[3] == "--":
        try:
            _join(int(args[1]), int(args[2]), args[4:])
        except OSError as error:
            sys.stderr.write(f"workbench: cannot enter the cluster's private network: {error}\n")
            sys.exit(71)
    else:
        sys.exit("usage: netns.py anchor | join USER_FD NET_FD -- COMMAND...")


if __name__ == "__main__":
    _main(sys.argv[1:])
