"""One lock for singleton periodic jobs, shared by every process: a PostgreSQL advisory lock.

    with advisory_lock("nodes_health_check") as acquired:
        if not acquired:
            return {"skipped": "another run is under way"}
        ...

- Never waits: `acquired` is False while another process (or another block in this one) holds the name.
- Session-level (`pg_try_advisory_lock`), keyed by a stable 64-bit hash of the name (`lock_key`), taken on a
  database connection of its own. So the caller may commit, roll back, or close and reopen its own connection
  (`close_old_connections` in a long loop, CONN_MAX_AGE) without losing the lock midway.
- Released in `finally`, and by PostgreSQL itself when the holder's connection ends: a worker that is killed
  (a hard time limit, OOM) never leaves it behind, so there is no TTL to guess.

On another database (the SQLite first-run demo: web, worker and beat on one machine) the same name takes an
exclusive, non-blocking `flock` on a file under VAR_DIR/locks, which the kernel also releases with its holder.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections

try:
    import fcntl
except ImportError:  # not POSIX: no file locks (the demo needs sshd, so a POSIX machine, anyway)
    fcntl = None  # type: ignore[assignment]  # the module or None; checked before each use

log = logging.getLogger(__name__)


def lock_key(name: str) -> int:
    """The advisory lock key of `name`: a signed 64-bit integer (PostgreSQL's bigint), the same in every process,
    machine and release (a hash, not Python's per-process `hash()`)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


@contextlib.contextmanager
def advisory_lock(name: str, *, using: str = DEFAULT_DB_ALIAS) -> Iterator[bool]:
    """Hold the lock `name` for the block if no one else does; yields whether it was acquired."""
    if connections[using].vendor != "postgresql":
        with file_lock(name) as acquired:
            yield acquired
        return
    key = lock_key(name)
    conn = connections.create_connection(using)  # its own session: the caller's may be closed meanwhile
    try:
        with conn.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_lock(%s)", [key])
            acquired = bool(cursor.fetchone()[0])
        try:
            yield acquired
        finally:
            if acquired:
                try:
                    with conn.cursor() as cursor:
                        cursor.execute("SELECT pg_advisory_unlock(%s)", [key])
                except DatabaseError:  # the connection broke: closing it (below) ends the lock anyway
                    log.warning("advisory lock %r: unlock failed; released with its connection", name)
    finally:
        conn.close()


@contextlib.contextmanager
def file_lock(name: str) -> Iterator[bool]:
    """The stand-in on a database without advisory locks: an exclusive flock on VAR_DIR/locks/<name>.lock."""
    if fcntl is None:
        yield True
        return
    folder = Path(getattr(settings, "VAR_DIR", None) or tempfile.gettempdir()) / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:80]
    fd = os.open(folder / f"{safe}-{lock_key(name) & 0xFFFF_FFFF:08x}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            acquired = True
        except BlockingIOError:
            acquired = False
        try:
            yield acquired
        finally:
            if acquired:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
