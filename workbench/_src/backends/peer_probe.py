"""Is a cluster task's address held by a TensorFlow peer? One short probe that tells a peer from
a port that merely accepts TCP, and both from a host that does not answer.

A TCP accept proves nothing: a stale process, another program that reused the port, or a frozen
process (the kernel accepts on its behalf) all accept. Two answers count as a peer:
- the workbench's join placeholder (backends/join_watchdog.py), which greets every probe with
  GREETING while its task waits for the others;
- a TensorFlow server: it speaks gRPC, i.e. HTTP/2, and answers a client's connection preface
  with a SETTINGS frame (RFC 9113 section 3.4).

Only the standard library here: the join watchdog process imports this with nothing else loaded.
"""

from __future__ import annotations

import socket
import time

GREETING = b"workbench-peer\n"
# The HTTP/2 client connection preface, then an empty SETTINGS frame (length 0, type 4, no
# flags, stream 0).
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_SETTINGS_FRAME_TYPE = 4

PEER = "peer"
NOT_A_PEER = "not a peer"  # accepted, but answered nothing a peer says
UNREACHABLE = "unreachable"  # refused, or no answer to the connection at all


def probe(address: str, timeout: float = 1.0) -> str:
    """PEER, NOT_A_PEER or UNREACHABLE for "host:port", within about `timeout` seconds."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except (OSError, ValueError):
        return UNREACHABLE
    with sock:
        try:
            sock.sendall(_HTTP2_PREFACE)
        except OSError:
            return NOT_A_PEER
        answer = b""
        while len(answer) < 9:  # a frame header is 9 bytes; the greeting is longer
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(left)
            try:
                data = sock.recv(64)
            except OSError:  # (socket.timeout included)
                break
            if not data:
                break
            answer += data
    if len(answer) >= 9 and (GREETING.startswith(answer) or answer[3] == _SETTINGS_FRAME_TYPE):
        return PEER
    return NOT_A_PEER
