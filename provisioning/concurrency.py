"""A cap on concurrent SSH sessions per node, shared by every worker through the cache (Redis).

A slot is a cache key taken with `add` (atomic in Redis) and given back on exit;
its timeout frees it if a worker dies holding it.
"""
import contextlib
import secrets
import time

from django.core.cache import cache

MAX_SESSIONS_PER_NODE = 4
SLOT_TTL_S = 1200  # longer than any task's hard time limit


class NodeBusy(Exception):
    pass


@contextlib.contextmanager
def node_slot(node_id: int, *, wait_s: float = 60.0, limit: int = MAX_SESSIONS_PER_NODE):
    token = secrets.token_hex(8)
    deadline = time.monotonic() + wait_s
    while True:
        for slot in range(limit):
            key = f"node-ssh-slot:{node_id}:{slot}"
            if cache.add(key, token, timeout=SLOT_TTL_S):
                try:
                    yield slot
                finally:
                    if cache.get(key) == token:
                        cache.delete(key)
                return
        if time.monotonic() >= deadline:
            raise NodeBusy(f"node {node_id} already has {limit} sessions open")
        time.sleep(0.2)
