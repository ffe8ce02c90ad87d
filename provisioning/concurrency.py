"""A cap on concurrent SSH sessions per node, shared by every worker through the cache (Redis).

A slot is a cache key taken with `add` (atomic in Redis) and given back on exit;
its timeout frees it if a worker dies holding it.

A node whose slots stay taken raises NodeBusy, a transient NodeError: nothing is wrong with the node or the
work, so jobs try again later (provisioning.tasks) and fleet loops count it and go on to the next node.
"""
import contextlib
import secrets
import time

from django.core.cache import cache

from provisioning.ssh_errors import NodeError  # imports nothing of provisioning's: no import circle

MAX_SESSIONS_PER_NODE = 4
SLOT_TTL_S = 1200  # longer than any task's hard time limit


class NodeBusy(NodeError):
    """Every SSH slot of the node stayed taken while we waited: try again later (nothing was sent to the node)."""

    code = "node_busy"
    transient = True


def slot_key(node_id: int, slot: int) -> str:
    """The cache key of one of the node's slots (provisioning.services.fleet takes them by batch)."""
    return f"node-ssh-slot:{node_id}:{slot}"


@contextlib.contextmanager
def node_slot(node_id: int, *, wait_s: float = 60.0, limit: int = MAX_SESSIONS_PER_NODE):
    token = secrets.token_hex(8)
    deadline = time.monotonic() + wait_s
    while True:
        for slot in range(limit):
            key = slot_key(node_id, slot)
            if cache.add(key, token, timeout=SLOT_TTL_S):
                try:
                    yield slot
                finally:
                    if cache.get(key) == token:
                        cache.delete(key)
                return
        if time.monotonic() >= deadline:
            raise NodeBusy(f"The platform already has {limit} SSH sessions open to node {node_id} "
                           f"(waited {wait_s:.0f} s for one to end).")
        time.sleep(0.2)
