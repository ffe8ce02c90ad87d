"""One test run at a time against one PostgreSQL and one Redis.

Two runs on the same servers share what they cannot both own: the test databases (`test_<name>`, `..._gw1`, ...),
the Redis databases of each xdist worker (config/settings/test.py) and the queues the suite's Celery worker reads.
Started together they fail each other's tests at random. So a run takes an exclusive lock named after the servers
it uses (in /tmp, or TEST_RUN_LOCK_DIR) before it creates anything, and a second run waits for the first, saying
whose run it waits for, up to TEST_RUN_LOCK_WAIT_S (then it stops with that message). The kernel lets go of the
lock when the holder exits, killed or not, so a crashed run never blocks the next.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import time
from collections.abc import Callable
from typing import IO
from urllib.parse import urlsplit

DEFAULT_WAIT_S = 1800  # longer than a whole `make test`, shorter than CI's limit
POLL_S = 0.2


class RunLockTimeout(Exception):
    pass


def lock_path(database: dict, broker_url: str) -> str:
    """The lock's file, one per (PostgreSQL server, Redis server): runs against other servers do not wait."""
    redis = urlsplit(broker_url)
    servers = f"{database.get('HOST') or 'local'}:{database.get('PORT') or 5432} {redis.hostname}:{redis.port or 6379}"
    digest = hashlib.sha256(servers.encode()).hexdigest()[:16]
    # Not TMPDIR: two shells with different ones must still find the same lock.
    return os.path.join(os.environ.get("TEST_RUN_LOCK_DIR", "/tmp"), f"gpumarket-test-run-{digest}.lock")


def _holder(handle: IO[str]) -> str:
    handle.seek(0)
    return handle.read().strip() or "a run that has not written its name yet"


def acquire(path: str, *, wait_s: float, say: Callable[[str], None]) -> IO[str]:
    """Hold the lock at `path` (the returned file; closing it lets go). Waits up to `wait_s` for another holder."""
    handle = open(path, "a+")  # noqa: SIM115 (held open for the whole run)
    deadline, told = time.monotonic() + wait_s, False
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = _holder(handle)
            if time.monotonic() >= deadline:
                handle.close()
                raise RunLockTimeout(
                    f"another test run uses the same PostgreSQL and Redis ({holder}) and did not end within "
                    f"{wait_s:g} s; two runs at once would share their test databases and Redis databases. "
                    f"Wait for it, or raise TEST_RUN_LOCK_WAIT_S. Lock: {path}") from None
            if not told:
                say(f"waiting for another test run on the same PostgreSQL and Redis to end: {holder}")
                told = True
            time.sleep(POLL_S)
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}, since {time.strftime('%H:%M:%S')}: {' '.join(sys.argv)[:300]}\n")
    handle.flush()
    return handle


def wait_s_from_environment() -> float:
    raw = os.environ.get("TEST_RUN_LOCK_WAIT_S", "")
    try:
        return float(raw) if raw.strip() else DEFAULT_WAIT_S
    except ValueError:
        raise RunLockTimeout(f"TEST_RUN_LOCK_WAIT_S must be a number of seconds, not {raw!r}") from None
