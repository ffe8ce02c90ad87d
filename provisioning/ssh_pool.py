"""Persistent SSH connections to nodes, per worker process: a bounded pool keyed by node.

A fleet health check every minute would otherwise pay a TCP connect, a key exchange and an authentication per
node and probe (on both sides). The pool keeps each node's connection open between uses:

- one idle connection per node at most; a connection is lent to one borrower at a time (a second borrower of
  the same node meanwhile gets a connection of its own, closed after use: the per-node slots in
  provisioning.concurrency still cap how many sessions the platform has open to a node);
- a lent connection whose transport died (the node's sshd restarted, the network cut it) is replaced by a new
  one; the caller retries once when a kept connection breaks during its first command (`fresh` says whether
  the connection is new);
- every new connection goes through the caller's `connect` (NodeSession.connect: the host key is pinned on
  each), and a node's connection is only reused while the node's address, port, user, pinned host key and
  platform key (`identity`) are the same as when it was opened;
- at most `connecting` connections are being opened at once (a fresh worker's first cycle opens one per node);
  `waiting_to_connect(thread)` says whether a thread still waits for one of those slots (it has not contacted its
  node yet: a health probe given up then is no failed check);
- keepalive (NodeSession sets transport.set_keepalive); idle connections are closed after `idle_s`, and the
  least recently used one when the pool holds `max_size`; `close_all()` on worker shutdown;
- a kept connection keeps the long-lived agent (`serve`) it started, so that a health probe over it is one
  line written and one read (NodeSession.served); the fleet batch takes and gives back connections itself
  (take, give_back) to send to all its nodes before it reads any answer;
- the agent's remote path, once uploaded or checked over SFTP on a node, is recorded per node: a new connection
  to that node skips the SFTP check while the agent's hash (in its file name) is the same. Callers forget it
  when the node says the agent is missing (`forget_agent`).

Idle paramiko transports wake every 0.1 s to look for work (Transport._active_check_timeout); a pooled one is
made to wake every `poll_s` instead, so that a thousand idle connections cost little CPU. Closing is not
delayed by it: Transport.close() does not wait for the wake-up.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

from provisioning.ssh import NodeSession, agent_bundle


@dataclass
class _Kept:
    session: NodeSession
    identity: Hashable
    since: float  # time.monotonic() when it was given back


class SshPool:
    def __init__(self, *, max_size: int = 1000, idle_s: float = 300.0, poll_s: float = 10.0,
                 connecting: int = 32):
        self.max_size = max_size
        self.idle_s = idle_s
        self.poll_s = poll_s
        self._lock = threading.Lock()
        # New connections opened at once: a fresh worker's first cycle opens one per node, and a few hundred key
        # exchanges at once on a small control plane would run past the connect timeout.
        self._connecting = threading.BoundedSemaphore(connecting)
        self._queued: set[int] = set()  # the threads (idents) waiting for a connect slot
        self._idle: OrderedDict[int, _Kept] = OrderedDict()  # least recently used first
        self._agents: dict[int, tuple[Hashable, str, str]] = {}  # node -> (identity, bundle name, absolute path)
        self._next_eviction = 0.0  # time.monotonic() of the next look for idle connections
        self.connects = 0  # new connections opened (figures for benches and tests)
        self.reuses = 0

    def __len__(self) -> int:
        return len(self._idle)

    @contextlib.contextmanager
    def borrow(self, node_id: int, identity: Hashable,
               connect: Callable[[], NodeSession]) -> Iterator[tuple[NodeSession, bool]]:
        """Lend the node's kept connection (or a new one from `connect`); yields (session, fresh).

        Given back for reuse when the block ends normally; closed when it raises (the connection's state is then
        unknown)."""
        session = self.take(node_id, identity)
        fresh = session is None
        if session is None:
            with self._connect_slot():
                session = connect()
            self._tune(session)
            with self._lock:
                self.connects += 1
            self._known_agent(node_id, identity, session)
        try:
            yield session, fresh
        except BaseException:
            session.close()
            raise
        self.give_back(node_id, identity, session)

    def take(self, node_id: int, identity: Hashable) -> NodeSession | None:
        """The node's kept connection (alive, opened with this identity), taken out of the pool; None if there is
        none. Give it back with give_back (or close it)."""
        session = self._take(node_id, identity)
        if session is not None:
            with self._lock:
                self.reuses += 1
            self._known_agent(node_id, identity, session)
        return session

    def give_back(self, node_id: int, identity: Hashable, session: NodeSession) -> None:
        """Keep a connection for the next use (closed instead if it died)."""
        if session._agent_path:
            self._agents[node_id] = (identity, agent_bundle()[1], session._agent_path)
        self._give_back(node_id, identity, session)

    def _known_agent(self, node_id: int, identity: Hashable, session: NodeSession) -> None:
        known = self._agents.get(node_id)
        if session._agent_path is None and known and known[0] == identity and known[1] == agent_bundle()[1]:
            session._agent_path = known[2]  # uploaded or checked before on this node: no SFTP round trip

    def waiting_to_connect(self, thread_id: int) -> bool:
        """Whether that thread (threading.get_ident()) waits for a connect slot now: its connection to the node is
        not opened yet, held back by this worker's own connects to other nodes."""
        with self._lock:
            return thread_id in self._queued

    @contextlib.contextmanager
    def _connect_slot(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._lock:
            self._queued.add(me)
        try:
            self._connecting.acquire()
        finally:
            with self._lock:
                self._queued.discard(me)
        try:
            yield
        finally:
            self._connecting.release()

    def forget_agent(self, node_id: int) -> None:
        """The node said the agent is not there: the next use checks (and uploads) it again."""
        self._agents.pop(node_id, None)

    def discard(self, node_id: int) -> None:
        with self._lock:
            kept = self._idle.pop(node_id, None)
        if kept is not None:
            kept.session.close()

    def close_all(self) -> None:
        with self._lock:
            kept, self._idle = list(self._idle.values()), OrderedDict()
        for k in kept:
            k.session.close()

    def evict_idle(self) -> int:
        """Close the connections idle for longer than idle_s; returns how many."""
        now = time.monotonic()
        with self._lock:
            old = [node_id for node_id, k in self._idle.items() if now - k.since > self.idle_s]
            closing = [self._idle.pop(node_id) for node_id in old]
        for k in closing:
            k.session.close()
        return len(closing)

    # -- internals --------------------------------------------------------------------------------
    def _take(self, node_id: int, identity: Hashable) -> NodeSession | None:
        if time.monotonic() >= self._next_eviction:  # a look over the whole pool now and then, not per use
            self._next_eviction = time.monotonic() + min(self.idle_s, 10.0)
            self.evict_idle()
        with self._lock:
            kept = self._idle.pop(node_id, None)
        if kept is None:
            return None
        if kept.identity != identity or not _alive(kept.session):
            kept.session.close()  # the node was changed (address, key...), or the connection died
            return None
        return kept.session

    def _give_back(self, node_id: int, identity: Hashable, session: NodeSession) -> None:
        if not _alive(session):
            session.close()
            return
        closing = []
        with self._lock:
            previous = self._idle.pop(node_id, None)  # another borrower's connection to the same node
            if previous is not None:
                closing.append(previous.session)
            self._idle[node_id] = _Kept(session, identity, time.monotonic())
            while len(self._idle) > self.max_size:
                closing.append(self._idle.popitem(last=False)[1].session)
        for s in closing:
            s.close()

    def _tune(self, session: NodeSession) -> None:
        transport = session._client.get_transport() if session._client is not None else None
        if transport is not None and transport.sock is not None:
            transport.sock.settimeout(self.poll_s)


def _alive(session: NodeSession) -> bool:
    transport = session._client.get_transport() if session._client is not None else None
    return transport is not None and transport.is_active()


_pool: SshPool | None = None
_pool_lock = threading.Lock()


def worker_pool() -> SshPool:
    """This process's pool (created on first use, sized by the FLEET_SSH_POOL_* settings)."""
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                from django.conf import settings

                _pool = SshPool(max_size=getattr(settings, "FLEET_SSH_POOL_SIZE", 1000),
                                idle_s=getattr(settings, "FLEET_SSH_POOL_IDLE_S", 300))
    return _pool


def worker_pool_close() -> None:
    """Close every kept connection (worker shutdown; tests)."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.close_all()
