"""Ports for servers that start later: a TensorFlow server of a pool's member, a Ray agent.

A port is chosen now and bound by its server seconds later (tens of them on a loaded machine,
where a process imports TensorFlow or Ray's dashboard for long). Meanwhile the processes around
it open sockets: every TCP connection's own end and every server bound to port 0 (Ray's core
workers, its GCS) gets a port of the kernel's ephemeral range (ip_local_port_range). A port
chosen in that range was once given away meanwhile (CI: a Ray instance ended when its
runtime-env agent met "OSError: [Errno 98] Address already in use"). So ports are chosen outside
it, where a port is bound only by a process that names it: in a private network namespace (a
local pool's, a local Ray instance's) that is only the servers chosen for here.
"""

from __future__ import annotations

import random
import socket

LOOPBACK = "127.0.0.1"
# The first port of IANA's dynamic/private range: below it are services' registered ports.
_PRIVATE_RANGE_START = 49152


def free_ports(count: int, avoiding=frozenset(), host: str = LOOPBACK) -> list[int]:
    """`count` distinct ports that `host` can be bound at now, none in `avoiding` (ports given to
    other servers, free yet), chosen at random among those this network's kernel never hands out
    by itself; from its ephemeral range only when none of those is left."""
    chooser = random.SystemRandom()  # (not the global one: a user's random.seed() must not repeat choices)
    candidates = [port for port in _unassigned_ports() if port not in avoiding]
    chooser.shuffle(candidates)
    ports = []
    for port in candidates:
        if len(ports) == count:
            break
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:  # (taken: someone named it)
                continue
        ports.append(port)
    missing = count - len(ports)
    return ports + (_kernels_free_ports(missing, set(avoiding) | set(ports), host) if missing else [])


def _unassigned_ports() -> list[int]:
    """The ports this network's kernel never gives out by itself (to a bind to port 0, to an
    outgoing connection's end) from _PRIVATE_RANGE_START up: those above its ephemeral range and
    those between _PRIVATE_RANGE_START and the range's start. Empty when the range covers them."""
    try:
        # (the network of the calling thread: a thread may have joined a namespace of its own)
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(n) for n in f.read().split())
    except (OSError, ValueError):
        return []
    return list(range(high + 1, 65536)) + list(range(_PRIVATE_RANGE_START, low))


def _kernels_free_ports(count: int, avoiding: set[int], host: str) -> list[int]:
    """`count` ports the kernel gives out as free now, none in `avoiding`."""
    sockets, ports = [], []
    try:
        while len(ports) < count:  # (sockets held open together: no port twice)
            sockets.append(socket.socket())
            sockets[-1].bind((host, 0))
            port = sockets[-1].getsockname()[1]
            if port not in avoiding:
                ports.append(port)
        return ports
    finally:
        for s in sockets:
            s.close()
