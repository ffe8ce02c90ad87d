"""Round trips of an SSH connection that the node's agent does not answer.

The platform takes the round trip off every timed answer (the challenge's commitments, the memory proof's fresh
roots). Timed with the agent's own pongs alone, a node that holds each pong back buys its slow answers that much
time. These two are answered below the agent: the SSH server's reply to a keepalive global request (sshd answers
`keepalive@openssh.com` itself, with a failure reply, which is all the timing needs) and the platform kernel's
smoothed TCP round trip of the connection (from the node's ACKs). The credit is the least of them all
(verification/round_trip.py), so a node must slow its sshd and its TCP stack as well as its agent, and the credit
stays under a cap whatever it does.
"""
from __future__ import annotations

import socket
import struct
import threading
import time
import weakref

import paramiko

KEEPALIVE = "keepalive@openssh.com"
KEEPALIVES = 3
TCP_INFO_BYTES = 104  # struct tcp_info up to tcpi_total_retrans (Linux)
TCP_INFO_RTT_OFFSET = 68  # tcpi_rtt, microseconds: after 8 one-byte fields and 15 u32 ones
# One measurement at a time per transport: paramiko keeps one completion_event per transport for global requests,
# so two exchanges measuring a pooled connection at once would wake on each other's replies (short or missing).
_MEASURING: weakref.WeakKeyDictionary[paramiko.Transport, threading.Lock] = weakref.WeakKeyDictionary()
_MEASURING_GUARD = threading.Lock()


def _measuring(transport: paramiko.Transport) -> threading.Lock:
    with _MEASURING_GUARD:
        return _MEASURING.setdefault(transport, threading.Lock())


def sshd_round_trips(transport: paramiko.Transport, timeout: float) -> list[float]:
    """KEEPALIVES keepalive round trips, each on the monotonic clock; none when the server did not answer one
    within `timeout` (paramiko's global_request has no timeout of its own, so it waits in a daemon thread, which
    ends when the transport closes). Measurements of one transport take turns (_MEASURING)."""
    lock = _measuring(transport)
    if not lock.acquire(timeout=timeout * KEEPALIVES):
        return []
    try:
        return _keepalive_trips(transport, timeout)
    finally:
        lock.release()


def _keepalive_trips(transport: paramiko.Transport, timeout: float) -> list[float]:
    trips = []
    for _ in range(KEEPALIVES):
        timed: dict[str, float] = {}
        done = threading.Event()

        def ask(timed=timed, done=done) -> None:
            timed["sent"] = time.monotonic()
            transport.global_request(KEEPALIVE, wait=True)
            timed["answered"] = time.monotonic()
            done.set()

        threading.Thread(target=ask, name="ssh-keepalive-rtt", daemon=True).start()
        if not done.wait(timeout) or not transport.is_active():
            return []
        trips.append(timed["answered"] - timed["sent"])
    return trips


def tcp_round_trip(transport: paramiko.Transport) -> float | None:
    """The platform kernel's smoothed round trip of the connection's TCP socket; None for anything else (a
    proxy command, a socket pair) or where TCP_INFO is not to be had."""
    sock = getattr(transport, "sock", None)
    if (not isinstance(sock, socket.socket) or sock.family not in (socket.AF_INET, socket.AF_INET6)
            or sock.type != socket.SOCK_STREAM or not hasattr(socket, "TCP_INFO")):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
    except OSError:
        return None
    if len(info) < TCP_INFO_RTT_OFFSET + 4:
        return None
    rtt_us = struct.unpack_from("I", info, TCP_INFO_RTT_OFFSET)[0]
    return rtt_us / 1e6 if rtt_us > 0 else None


def transport_round_trips(transport: paramiko.Transport | None, timeout: float) -> dict[str, list[float]]:
    """{"sshd": [s, ...], "tcp": [s]}, each where it could be measured."""
    if transport is None or not transport.is_active():
        return {}
    tcp = tcp_round_trip(transport)
    trips = {"sshd": sshd_round_trips(transport, timeout), "tcp": [tcp] if tcp is not None else []}
    return {name: samples for name, samples in trips.items() if samples}
