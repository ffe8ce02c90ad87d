"""The fleet's periodic health checks and reconciles, split into batches that any worker on any machine takes.

- The dispatchers (`nodes_health_dispatch`, `nodes_reconcile_dispatch`; beat, one run at a time) split the
  watched nodes into batches of FLEET_BATCH_SIZE, in node order, and queue one task per batch
  (FLEET_HEALTH_BATCH, FLEET_RECONCILE_BATCH). A batch message expires BATCH_EXPIRY_MARGIN_S under one interval,
  as the dispatchers' beat ticks do, and a batch whose cycle is no longer the last one queued runs nothing: the
  later cycle's batches have its nodes. One cycle per interval: a dispatch less than half an interval after the
  last cycle (a tick delivered twice, or a backlog of them) queues nothing.
- A batch (`nodes_health_batch`, `nodes_reconcile_batch`) shares nothing with other batches but the database
  and the cache, so it runs in whichever worker takes it. It is idempotent: a message delivered twice for the
  same cycle runs once (a claim in the cache per cycle and batch), and each node is checked by one batch at a
  time (a PostgreSQL advisory lock per node, taken for the batch: a node still being checked by an earlier,
  slow batch is skipped and counted `locked`). Each SSH session still takes its per-node slot
  (provisioning.concurrency), over the worker's kept connection to the node (provisioning.ssh_pool). What one
  node's reconcile raises stays with that node: a NodeError as the node's outcome, anything else logged with the
  node and counted `errors`; the batch goes on with its other nodes.
- A health batch probes its nodes at once (one thread per node), then writes what it learnt in a few
  set-based statements for the whole batch (fleet_record.nodes_record_health); only the rare cases (a node
  back after failures, interrupted instances, changed GPUs) take a statement or a session per node. The nodes
  back after failures are reconciled after the others are recorded, several at once (threads), until
  HEALTH_RECONCILE_DEADLINE_S after the batch began, and recorded once reconciled. Celery's soft time limit is
  never caught with the errors of one node: it ends the batch.

`nodes_health_check` and `nodes_reconcile` run every batch in the calling process, one after another: what
tests, the bench and a single-process demo call.
"""
from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from datetime import datetime
from typing import Any, TypeVar

from celery import current_app
from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.core.cache import cache, caches
from django.core.cache.backends.redis import RedisCache
from django.db import DEFAULT_DB_ALIAS, close_old_connections, connection, connections
from django.utils import timezone

from core import dispatch, metrics
from core.locks import advisory_lock
from marketplace.models import Instance, InstanceStatus, Node, NodeState
from marketplace.selectors import instances_awaiting_cleanup_by_node
from provisioning.concurrency import SLOT_TTL_S, NodeBusy, slot_key
from provisioning.services.fleet_record import nodes_record_health
from provisioning.services.gpu_presence import holds_lost_gpu
from provisioning.services.nodes import (
    HEALTH_TIMEOUTS,
    HealthResult,
    connection_identity,
    health_result,
    node_health_probe,
    running_vm_ids_by_node,
    watched_nodes,
)
from provisioning.services.reconcile import node_reconcile
from provisioning.ssh import NodeSession
from provisioning.ssh_errors import AgentGarbage, NodeError, NodeUnreachable
from provisioning.ssh_pool import SshPool, worker_pool

log = logging.getLogger(__name__)
_T = TypeVar("_T")
Summary = Mapping[str, int | str]

FLEET_HEALTH_BATCH = dispatch.task_name("provisioning.tasks.fleet_health_batch")
FLEET_RECONCILE_BATCH = dispatch.task_name("provisioning.tasks.fleet_reconcile_batch")
# One thread per node of a batch up to this cap: probes wait on the network.
HEALTH_PARALLELISM = 256
RECONCILE_PARALLELISM = 32
# How long a batch waits for its threads; what has not ended by then is given up, and the batch goes on (before,
# one node that never answered held back every other node's check and record, and their locks, until the worker
# was killed; found by review). Every SSH step is bounded (provisioning.ssh), so these are a last guard, past what
# a thread can take: a health probe waits up to node_slot's 60 s for a slot of a busy node, then connects, opens
# its channel and asks (HEALTH_TIMEOUTS), twice at most (a kept connection that broke is tried again on a new
# one). A given-up probe is a failed check, unless it never contacted the node: still waiting for one of the
# worker's own connect slots (SshPool `connecting`, held by other nodes' slow connects or an earlier cycle's late
# probes), or not started; nothing was learnt, as for a busy node (found by review: such a healthy node was counted
# "no answer", offline after three). A reconcile has the batch task's 540 s soft limit
# (provisioning.tasks.fleet_reconcile_batch) less a minute; a given-up one is counted `unfinished`.
HEALTH_PROBE_DEADLINE_S = 60 + 2 * (2 * HEALTH_TIMEOUTS.connect + HEALTH_TIMEOUTS.command)
RECONCILE_DEADLINE_S = 480.0
# A health batch reconciles the nodes back after failures (or with instances to recover) before recording them,
# HEALTH_RECONCILE_PARALLELISM at once, and waits for those reconciles until HEALTH_RECONCILE_DEADLINE_S after the
# batch began: the task's 240 s soft limit (provisioning.tasks.fleet_health_batch) less 40 s to record what they
# found. A node not reconciled by then is not recorded (counted `unfinished`): it must not take rentals before it
# is, and the next check reconciles it (a reconcile left running ends by itself).
HEALTH_RECONCILE_PARALLELISM = 32
HEALTH_RECONCILE_DEADLINE_S = 200.0
# A batch message expires this much under its interval, as the dispatchers' beat ticks do
# (settings.CELERY_BEAT_SCHEDULE): by then the next cycle is due.
BATCH_EXPIRY_MARGIN_S = 5
# The advisory-lock class of each kind of batch (two-key form: (class, node id); apart from core.locks' keys).
_LOCK_CLASS = {"health": 0x6865616C, "reconcile": 0x7265636E}
# `errors`: nodes whose reconcile raised something other than a NodeError (a bug, a refusal): logged with the
# node, and the batch goes on with its other nodes.
# `unfinished`: nodes whose reconcile (before recording them, or after lost VMs) was not done by the deadline.
HEALTH_SUMMARY = ("checked", "failed", "busy", "interrupted", "recovered", "locked", "errors", "stale", "unfinished")
# What a health batch's reconcile thread answers besides the counts or a NodeError.
_NOT_STARTED, _BUSY, _ERROR = object(), object(), object()
RECONCILE_SUMMARY = ("nodes", "orphans_destroyed", "instances_failed", "resumed", "restarted", "cleaned_up",
                     "stopped_vms_stopped", "orphan_volumes_deleted", "volumes_missing", "volumes_deleted",
                     "volumes_lost", "unreachable", "busy", "locked", "errors", "unfinished")


@contextlib.contextmanager
def singleton(name: str, ttl: int) -> Iterator[bool]:
    """Run the block in one process at a time; yields False (run nothing) while another holds `name`.

    A PostgreSQL advisory lock (core.locks.advisory_lock): it ends with its holder, so `ttl` is not needed any
    more (kept for callers)."""
    with advisory_lock(f"singleton:{name}") as acquired:
        yield acquired


def fleet_batches(node_ids: Sequence[int], size: int) -> list[list[int]]:
    """Consecutive slices of `size` node ids (the last one shorter); none for no nodes."""
    if size < 1:
        raise ValueError("a batch holds at least one node")
    ids = list(node_ids)
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def _watched_ids() -> list[int]:
    return list(watched_nodes().order_by("pk").values_list("pk", flat=True))


# ------------------------------------------------------------------------------------ dispatchers

def nodes_health_dispatch(*, now: datetime | None = None) -> Summary:
    """Queue this cycle's health batches (beat, every HEALTH_CHECK_INTERVAL_S)."""
    return _dispatch("health", FLEET_HEALTH_BATCH, settings.HEALTH_CHECK_INTERVAL_S, now)


def nodes_reconcile_dispatch(*, now: datetime | None = None) -> Summary:
    """Queue this cycle's reconcile batches (beat, every RECONCILE_INTERVAL_S)."""
    return _dispatch("reconcile", FLEET_RECONCILE_BATCH, settings.RECONCILE_INTERVAL_S, now)


def _dispatch(kind: str, task: str, interval_s: int, now: datetime | None) -> Summary:
    with singleton(f"nodes_{kind}_dispatch", ttl=interval_s) as acquired:
        if not acquired:
            return {"skipped": f"another {kind} dispatcher is running"}
        now = now or timezone.now()
        # One cycle per interval: a dispatch less than half an interval after the last cycle queues nothing. Beat's
        # ticks expire a bit under their interval (settings.CELERY_BEAT_SCHEDULE), but a tick delivered again (its
        # worker lost after queuing) or two left in the queue across a restart ran back to back, each a cycle of
        # its own: a node silent at that moment got several failed checks at once, its renters interrupted after
        # two and the node offline after three (found by review). Taken before sending: a dispatch cut short is not
        # sent again; the next tick queues every node.
        last_key = _last_cycle_key(kind)
        last = cache.get(last_key)
        if isinstance(last, (int, float)) and abs(now.timestamp() - last) < interval_s / 2:
            return {"skipped": f"the last {kind} cycle was queued {abs(now.timestamp() - last):.0f} s ago"}
        cache.set(last_key, now.timestamp(), timeout=max(2 * interval_s, 60))
        cycle = now.isoformat()
        ids = _watched_ids()
        batches = fleet_batches(ids, settings.FLEET_BATCH_SIZE)
        sent = 0
        for batch in batches:
            try:
                current_app.send_task(task, args=[batch, cycle], expires=max(interval_s - BATCH_EXPIRY_MARGIN_S, 1))
            except SoftTimeLimitExceeded:
                raise  # the task's time is up: not the broker's refusal
            except Exception as exc:  # noqa: BLE001 (kombu's many errors: the broker is down; the next cycle tries)
                log.warning("fleet %s: the broker did not take a batch (%s); %d of %d queued", kind, exc, sent,
                            len(batches))
                return {"nodes": len(ids), "batches": sent, "send_failed": len(batches) - sent}
            sent += 1
        return {"nodes": len(ids), "batches": sent, "send_failed": 0}


def _last_cycle_key(kind: str) -> str:
    """The cache key of the time (a POSIX timestamp) of the last cycle of this kind queued."""
    return f"fleet-dispatch:{kind}:last"


# ------------------------------------------------------------------------------------ batch claims and locks

def _superseded(kind: str, cycle: str | None) -> bool:
    """Whether a later cycle of this kind was queued after this batch's (the time the dispatcher keeps, taken
    before it sends): its nodes are in that cycle's batches, so this one runs nothing. A batch message expires a
    little under its interval, but the next cycle may come half an interval after the last (a tick taken late, then
    the next on time): a late batch then ran after the next cycle's had checked its nodes, and a node silent at that
    moment got two failed checks back to back, its renters interrupted after two (found by review). No cycle (a run
    in this process), one not written by a dispatcher, or no time kept (the cache emptied): not superseded."""
    if cycle is None:
        return False
    try:
        queued = datetime.fromisoformat(cycle).timestamp()
    except ValueError:
        return False
    last = cache.get(_last_cycle_key(kind))
    return isinstance(last, (int, float)) and last > queued + 0.001


def _claim(kind: str, cycle: str | None, node_ids: Sequence[int]) -> bool:
    """False when this cycle's batch already ran (the same message delivered again). No cycle: always True."""
    if cycle is None or not node_ids:
        return True
    key = f"fleet-batch:{kind}:{cycle}:{node_ids[0]}-{node_ids[-1]}:{len(node_ids)}"
    return bool(cache.add(key, 1, timeout=24 * 3600))


@contextlib.contextmanager
def node_locks(kind: str, node_ids: Sequence[int]) -> Iterator[list[int]]:
    """Lock each node for this kind of batch if no other batch holds it; yields the ids locked (in order).

    PostgreSQL session advisory locks on a connection of their own, taken and released in one statement each:
    they end with the worker if it dies. Elsewhere (SQLite: the one-process demo) one batch at a time."""
    ids = sorted(set(node_ids))
    if not ids:
        yield []
        return
    if connections[DEFAULT_DB_ALIAS].vendor != "postgresql":
        with advisory_lock(f"fleet-batch:{kind}") as acquired:
            yield ids if acquired else []
        return
    conn = connections.create_connection(DEFAULT_DB_ALIAS)
    try:
        with conn.cursor() as cursor:
            cursor.execute("SELECT id FROM unnest(%s::bigint[]) AS t(id) WHERE pg_try_advisory_lock(%s, id::int) "
                           "ORDER BY id", [ids, _LOCK_CLASS[kind]])
            held = [row[0] for row in cursor.fetchall()]
        try:
            yield held
        finally:
            with conn.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s, id::int) FROM unnest(%s::bigint[]) AS t(id)",
                               [_LOCK_CLASS[kind], held])
    finally:
        conn.close()


def _in_thread(fn: Callable[..., _T], *args: Any) -> _T:
    """Run fn in a pool thread with its own database connection, closed afterwards."""
    try:
        return fn(*args)
    finally:
        connection.close()


def _run_all(fn: Callable[[_T], Any], items: Sequence[_T], parallelism: int,
             deadline_s: float) -> tuple[list[Any], list[_T]]:
    """fn(item) for every item in threads (_in_thread), waiting `deadline_s` at most: (the results of those that
    ended, in order; the items whose call had not). Never waits for a thread past the deadline, nor when the wait is
    interrupted (Celery's soft time limit): the `with ThreadPoolExecutor` it replaces waited for every thread on
    leaving, so a hung one kept the batch until the worker was killed. A thread left running ends by itself (its SSH
    steps are bounded); its result is dropped."""
    threads = ThreadPoolExecutor(max_workers=max(1, min(parallelism, len(items))))
    try:
        futures: list[Future[Any]] = [threads.submit(_in_thread, fn, item) for item in items]
        wait(futures, timeout=deadline_s)
    finally:
        threads.shutdown(wait=False, cancel_futures=True)
    done = [f.result() for f in futures if f.done() and not f.cancelled()]
    late = [item for item, f in zip(items, futures, strict=True) if not f.done() or f.cancelled()]
    return done, late


# ------------------------------------------------------------------------------------ health

def nodes_probe(nodes: list[Node], parallelism: int = HEALTH_PARALLELISM, *,
                pool: SshPool | None = None) -> list[HealthResult]:
    """`health` on many nodes at once: SSH round trips overlap, so wall time tracks the slowest node.

    Each probe holds one of its node's SSH slots (provisioning.concurrency), as every session does. The batch
    takes them for all its nodes in one round trip to Redis and gives them back in another (the same keys,
    tokens and expiry as node_slot); a node whose first slot is taken waits for one in its own probe, as
    node_slot does. A probe that has not ended within HEALTH_PROBE_DEADLINE_S is a failed check, saying so, unless
    it never contacted its node (not started, or still waiting for one of the worker's connect slots): that one is
    `busy`, nothing recorded."""
    if not nodes:
        return []
    with batch_slots([n.pk for n in nodes]) as held:
        done = _probe_served(nodes, held, pool) if pool is not None else {}
        rest = [n for n in nodes if n.pk not in done]
        if rest:
            probed_at, start = timezone.now(), time.monotonic()
            probing: dict[int, int] = {}  # node -> the thread probing it

            def probe(node: Node) -> HealthResult:
                probing[node.pk] = threading.get_ident()
                return node_health_probe(node, pool=pool, slot_held=node.pk in held)

            results, late = _run_all(probe, rest, parallelism, HEALTH_PROBE_DEADLINE_S)
            for result in results:
                done[result.node_id] = result
            for node in late:
                thread = probing.get(node.pk)
                if thread is None or (pool is not None and pool.waiting_to_connect(thread)):
                    log.warning("health: node %s: not contacted within %.0f s (its probe waited for this worker's "
                                "connect slots or threads); checked again next time", node.pk, HEALTH_PROBE_DEADLINE_S)
                    done[node.pk] = HealthResult(
                        node.pk, False, "The health check did not reach the node within "
                        f"{HEALTH_PROBE_DEADLINE_S:.0f}s: the worker was busy opening its connections to other "
                        "nodes.", time.monotonic() - start, probed_at=probed_at, busy=True)
                    continue
                log.warning("health: node %s: no answer within %.0f s; the check is counted as failed", node.pk,
                            HEALTH_PROBE_DEADLINE_S)
                done[node.pk] = HealthResult(
                    node.pk, False, f"The health check got no answer from the node within "
                    f"{HEALTH_PROBE_DEADLINE_S:.0f}s.", time.monotonic() - start, probed_at=probed_at)
    return [done[n.pk] for n in nodes]


def _probe_served(nodes: list[Node], held: set[int], pool: SshPool) -> dict[int, HealthResult]:
    """Probe, without a thread per node, the nodes whose kept connection runs the long-lived agent (`serve`)
    and whose SSH slot the batch holds: write every request first, then read every answer, so the round trips
    overlap. Returns the results it has; a node left out (no such connection, or it broke: the node's sshd
    restarted, the agent was replaced) is probed by the caller the usual way, on a new connection if need be."""
    sent: list[tuple[Node, Any, NodeSession, int]] = []
    handled = 0  # sent[:handled] were given back or closed
    try:
        probed_at, start = timezone.now(), time.monotonic()
        for node in nodes:
            if node.pk not in held:
                continue
            identity = connection_identity(node)
            session = pool.take(node.pk, identity)
            if session is None:
                continue
            if not session.serving:  # kept from other work (a reconcile): started by the usual probe
                pool.give_back(node.pk, identity, session)
                continue
            session.timeouts = HEALTH_TIMEOUTS
            try:
                sent.append((node, identity, session, session.serve_send("health")))
            except AgentGarbage:  # the agent's channel closed: the usual probe starts it anew
                pool.give_back(node.pk, identity, session)
            except NodeError:
                session.close()
        deadline = start + HEALTH_TIMEOUTS.command
        done: dict[int, HealthResult] = {}
        for index, (node, identity, session, request_id) in enumerate(sent):
            handled = index
            try:
                answer = session.serve_answer(request_id, max(deadline - time.monotonic(), 0.001))
            except NodeUnreachable:  # the connection broke: the usual probe tries a new one
                session.close()
                continue
            except AgentGarbage:  # the agent stopped, or its file was replaced: the usual probe starts it anew
                pool.give_back(node.pk, identity, session)
                continue
            except NodeError as exc:  # no answer in time, or the agent's refusal: a failed check, as usual
                session.close()
                result = HealthResult(node.pk, False, exc.message, time.monotonic() - start, probed_at=probed_at)
            else:
                pool.give_back(node.pk, identity, session)
                result = health_result(node, answer, seconds=time.monotonic() - start, probed_at=probed_at)
            metrics.ssh_probe_observe(result)
            done[node.pk] = result
    except BaseException:  # a bug or an interrupt: no taken connection may stay open outside the pool
        for _, _, session, _ in sent[handled:]:
            session.close()
        raise
    return done


# Django's Redis cache client builds a Redis client object per call: three calls per probe (take, look, give
# back) cost more CPU than the probe's SSH exchange; a pipeline per batch does not.
_GIVE_BACK = """
local done = 0
for i, key in ipairs(KEYS) do
  if redis.call('get', key) == ARGV[1] then done = done + redis.call('del', key) end
end
return done
"""


@contextlib.contextmanager
def batch_slots(node_ids: Sequence[int]) -> Iterator[set[int]]:
    """Take the first SSH slot of each node that has it free, in one round trip; yields the nodes taken. The
    slots are given back (only those still holding this batch's token) in one more. Without a Redis cache
    (the demo's local memory cache), none is taken here: each probe takes its own slot."""
    backend = caches["default"]
    if not isinstance(backend, RedisCache) or not node_ids:
        yield set()
        return
    token = secrets.token_hex(8)
    value = backend._cache._serializer.dumps(token)  # type: ignore[attr-defined]  # the format cache.add writes
    keys = {node_id: backend.make_and_validate_key(slot_key(node_id, 0)) for node_id in node_ids}
    client = backend._cache.get_client(write=True)
    with client.pipeline(transaction=False) as pipe:
        for key in keys.values():
            pipe.set(key, value, nx=True, ex=SLOT_TTL_S)
        taken = {node_id for node_id, ok in zip(keys, pipe.execute(), strict=True) if ok}
    try:
        yield taken
    finally:
        if taken:
            client.eval(_GIVE_BACK, len(taken), *[keys[node_id] for node_id in taken], value)


def nodes_health_check(*, pool: SshPool | None = None) -> Summary:
    """Every watched node, batch after batch, in this process (one run at a time)."""
    with singleton("nodes_health_check", ttl=300) as acquired:
        if not acquired:
            return {"skipped": "another health check is running"}
        summary = dict.fromkeys(HEALTH_SUMMARY, 0)
        for batch in fleet_batches(_watched_ids(), settings.FLEET_BATCH_SIZE):
            for key, value in nodes_health_batch(batch, pool=pool).items():
                summary[key] += int(value)
        return summary


def nodes_health_batch(node_ids: Sequence[int], *, cycle: str | None = None, pool: SshPool | None = None,
                       parallelism: int = HEALTH_PARALLELISM) -> Summary:
    """Probe these nodes (those still watched), then record every result; returns counts."""
    if _superseded("health", cycle):
        return {"skipped": "a later cycle was queued: its batches check these nodes"}
    if not _claim("health", cycle, node_ids):
        return {"skipped": "this batch already ran"}
    until = time.monotonic() + HEALTH_RECONCILE_DEADLINE_S
    pool = pool if pool is not None else worker_pool()
    summary = dict.fromkeys(HEALTH_SUMMARY, 0)
    with node_locks("health", node_ids) as held:
        summary["locked"] = len(set(node_ids)) - len(held)
        nodes = list(watched_nodes().filter(pk__in=held).order_by("pk"))
        results = nodes_probe(nodes, parallelism, pool=pool)
        _health_apply(nodes, results, pool, summary, until)
    return summary


def _health_apply(nodes: list[Node], results: list[HealthResult], pool: SshPool, summary: dict[str, int],
                  until: float) -> None:
    """Record the batch's results: first those that need no reconcile (most of them, in one nodes_record_health),
    then reconcile the nodes back after failures or with instances to recover, in threads until `until`
    (time.monotonic()), and record those reconciled; last, reconcile the nodes that answered but whose VMs were
    found not running. Before, the recovering nodes were reconciled one after another before anything was
    recorded: a few slow ones (a slot wait of 60 s, SSH steps of up to 120 s each) took the batch past its soft
    time limit, and none of its 250 nodes was recorded, every cycle (found by review)."""
    by_id = {n.pk: n for n in nodes}
    answered = [r.node_id for r in results if r.ok]
    pending = _nodes_with_instances_to_recover(answered)
    # Instances running since before the first probe began: one query for the batch, not one per node.
    running = running_vm_ids_by_node(
        node_ids=answered, probed_before=min((r.probed_at for r in results if r.probed_at), default=None))
    summary["checked"] += len(results)
    # A failed probe of a node whose state changed after the batch read it (its provider asked for a verification
    # or ended its maintenance, a verification concluded, an operator moved it) says nothing about the node since:
    # not recorded (counted `stale`); the next check judges it. Recorded, a failure probed before a verification
    # that concluded active sent the freshly verified node offline, its provider told so (found by review). One
    # read, for the failed ones only.
    failed = [r.node_id for r in results if not r.ok and not r.busy]
    moved = {pk for pk, changed_at in Node.objects.filter(pk__in=failed).values_list("pk", "state_changed_at")
             if changed_at != by_id[pk].state_changed_at} if failed else set()
    record: list[HealthResult] = []
    recovering: list[HealthResult] = []
    for result in results:
        node = by_id[result.node_id]
        if result.busy:  # its SSH sessions are all taken by work: it is alive; judge it next time
            summary["busy"] += 1
        elif result.node_id in moved:
            summary["stale"] += 1
        elif result.ok and (node.health_failures > 0 or node.state == NodeState.OFFLINE or node.pk in pending):
            # It answers again: before it takes rentals, resume or fail its interrupted instances and remove the
            # VMs of instances destroyed while it was unreachable; recorded once that is done.
            recovering.append(result)
        else:
            record.append(result)
    interrupted = nodes_record_health(record, running_vm_ids=running) if record else {}
    outcomes, late, limit = _health_reconciles([by_id[r.node_id] for r in recovering], pool, until, summary)
    back: list[HealthResult] = []
    for result in recovering:
        outcome = outcomes.get(result.node_id)
        if result.node_id in late or outcome is None:
            continue  # not recorded, as a busy node: it must not take rentals before it is reconciled
        if isinstance(outcome, NodeError):
            back.append(HealthResult(result.node_id, False, f"it answered, but reconciling its VMs failed: {outcome}",
                                     result.seconds, probed_at=result.probed_at))
        else:
            summary["recovered"] += _recovered(outcome)
            back.append(result)
    if back:
        interrupted.update(nodes_record_health(back, running_vm_ids=running))
    if limit is not None:
        raise limit  # Celery's soft time limit: what was reconciled before it is recorded, nothing more is done
    record += back
    # The node answers but those VMs are not running: start them again, or fail them if gone.
    lost = [by_id[r.node_id] for r in record if r.ok and interrupted.get(r.node_id)]
    outcomes, late, limit = _health_reconciles(lost, pool, until, summary)
    for node_id, outcome in outcomes.items():
        if isinstance(outcome, NodeError):
            log.info("health: node %s: reconcile after lost VMs failed: %s", node_id, outcome)
        else:
            summary["recovered"] += _recovered(outcome)
    if limit is not None:
        raise limit
    for result in record:
        summary["interrupted"] += len(interrupted.get(result.node_id, []))
        summary["failed"] += not result.ok


def _health_reconciles(nodes: list[Node], pool: SshPool, until: float, summary: dict[str, int]) -> tuple[
        dict[int, Mapping[str, int] | NodeError], set[int], SoftTimeLimitExceeded | None]:
    """node_reconcile of each node, HEALTH_RECONCILE_PARALLELISM at once, in threads (_in_thread) waited for
    until `until` (time.monotonic(); a node alone too, unless the caller holds a transaction): ({node id: its
    counts, or the NodeError it raised}, the ids of the nodes not done by then, counted `unfinished`, Celery's soft
    time limit if it came). A node busy (NodeBusy) or whose reconcile raised anything else (logged, counted
    `errors`) is in neither. What is not done is left running, or not started; the next check (or reconcile
    batch) does it. The soft time limit is never swallowed (an `except Exception` caught it, and the batch went on
    until the worker was killed; found by review): raised in the batch's thread while it waits, or by a reconcile,
    it ends the wait, no reconcile starts after it, and it is returned for the caller to record what was done and
    raise it."""
    if not nodes:
        return {}, set(), None
    wait_s = until - time.monotonic()
    if wait_s <= 0:
        summary["unfinished"] += len(nodes)
        return {}, {n.pk for n in nodes}, None
    stop = threading.Event()

    def one(node: Node) -> Any:
        if stop.is_set():
            return _NOT_STARTED
        try:
            return node_reconcile(node, pool=pool)
        except SoftTimeLimitExceeded:
            stop.set()
            raise
        except NodeBusy:
            return _BUSY
        except NodeError as exc:
            return exc
        except Exception:  # noqa: BLE001 (one node's error must not cost the batch the others' checks)
            log.exception("health: node %s answered, but reconciling it raised; judged next time", node.pk)
            return _ERROR

    futures: list[tuple[Node, Future[Any]]] = []
    limit: SoftTimeLimitExceeded | None = None
    if len(nodes) == 1 and connection.in_atomic_block:
        # Only when the batch was called inside a transaction (a test's, or a caller's that wrapped it in one; never
        # the task): a thread's connection would not see its writes and could wait on its locks, so the one node is
        # reconciled in the batch's thread, bounded by its steps' own timeouts only. Everywhere else one alone runs
        # in a thread as several do, waited for until `until`: in the batch's thread it had no deadline, so a node
        # that answered its probe and then hung (a slot wait of 60 s, SSH steps of up to 120 s each) kept the
        # batch past it, into the soft time limit, which cut the reconcile wherever it was (found by review).
        future: Future[Any] = Future()
        try:
            future.set_result(one(nodes[0]))
        except SoftTimeLimitExceeded as exc:
            future.set_exception(exc)
        futures = [(nodes[0], future)]
    else:
        threads = ThreadPoolExecutor(max_workers=max(1, min(HEALTH_RECONCILE_PARALLELISM, len(nodes))))
        try:
            futures = [(node, threads.submit(_in_thread, one, node)) for node in nodes]
            wait([f for _, f in futures], timeout=wait_s, return_when=FIRST_EXCEPTION)
        except SoftTimeLimitExceeded as exc:
            limit = exc
        finally:
            stop.set()  # past the deadline, or interrupted: none starts now
            threads.shutdown(wait=False, cancel_futures=True)
    outcomes: dict[int, Mapping[str, int] | NodeError] = {}
    late: set[int] = set()
    for node, future in futures:
        if not future.done() or future.cancelled():
            late.add(node.pk)
            continue
        raised = future.exception()
        if isinstance(raised, SoftTimeLimitExceeded):  # the only Exception `one` lets through
            limit = limit or raised
            continue
        outcome = future.result()
        if outcome is _NOT_STARTED:
            late.add(node.pk)
        elif outcome is _BUSY:
            summary["busy"] += 1
        elif outcome is _ERROR:
            summary["errors"] += 1
        else:
            outcomes[node.pk] = outcome
    for pk in sorted(late):
        log.warning("health: node %s: its reconcile was not done within the batch's %.0f s; left to the next check",
                    pk, HEALTH_RECONCILE_DEADLINE_S)
    summary["unfinished"] += len(late)
    return outcomes, late, limit


def _recovered(counts: Mapping[str, int]) -> int:
    return counts["resumed"] + counts["restarted"] + counts["instances_failed"]


def _nodes_with_instances_to_recover(node_ids: list[int]) -> set[int]:
    """Nodes with interrupted instances, or over ones whose VM is still to be removed (the retire's question,
    selectors.instances_awaiting_cleanup). Not for an instance that waits for a lost GPU (gpu_presence): the
    reconciler would pass it by at every check, over SSH, for as long as the card is gone; once the card is listed
    again it counts, and the next check resumes it."""
    if not node_ids:
        return set()
    interrupted = Instance.objects.filter(status=InstanceStatus.INTERRUPTED, node_id__in=node_ids).exclude(
        holds_lost_gpu())
    return {*interrupted.values_list("node_id", flat=True).distinct(),
            *instances_awaiting_cleanup_by_node(node_ids=node_ids)}


# ------------------------------------------------------------------------------------ reconcile

def nodes_reconcile(*, pool: SshPool | None = None) -> Summary:
    """Compare each node's VMs with the database, batch after batch, in this process (one run at a time)."""
    with singleton("nodes_reconcile", ttl=600) as acquired:
        if not acquired:
            return {"skipped": "another reconcile is running"}
        summary = dict.fromkeys(RECONCILE_SUMMARY, 0)
        for batch in fleet_batches(_watched_ids(), settings.FLEET_BATCH_SIZE):
            for key, value in nodes_reconcile_batch(batch, pool=pool).items():
                summary[key] += int(value)
        return summary


def nodes_reconcile_batch(node_ids: Sequence[int], *, cycle: str | None = None, pool: SshPool | None = None,
                          parallelism: int = RECONCILE_PARALLELISM) -> Summary:
    """Reconcile these nodes (those still watched), several at once: remove VMs nobody knows, fail instances
    whose VM vanished, resume interrupted ones (provisioning.services.reconcile.node_reconcile)."""
    if _superseded("reconcile", cycle):
        return {"skipped": "a later cycle was queued: its batches reconcile these nodes"}
    if not _claim("reconcile", cycle, node_ids):
        return {"skipped": "this batch already ran"}
    pool = pool if pool is not None else worker_pool()
    summary = dict.fromkeys(RECONCILE_SUMMARY, 0)
    with node_locks("reconcile", node_ids) as held:
        summary["locked"] = len(set(node_ids)) - len(held)
        nodes = list(watched_nodes().filter(pk__in=held).order_by("pk"))
        if not nodes:
            return summary
        outcomes, late = _run_all(lambda n: _reconcile_one(n, pool), nodes, parallelism, RECONCILE_DEADLINE_S)
    for node in late:
        log.warning("reconcile: node %s: not done within %.0f s; left to run, tried again next cycle", node.pk,
                    RECONCILE_DEADLINE_S)
    summary["unfinished"] += len(late)
    for outcome in outcomes:
        for key, value in outcome.items():
            summary[key] += value
    return summary


def _reconcile_one(node: Node, pool: SshPool) -> dict[str, int]:
    close_old_connections()
    try:
        counts = node_reconcile(node, pool=pool)
    except SoftTimeLimitExceeded:
        raise  # never an `errors` count: the batch's task ends on it (raised where _run_all waits, it starts no more)
    except NodeBusy:
        return {"busy": 1}  # alive and working: reconciled next time
    except NodeError as exc:
        log.info("reconcile: node %s unreachable: %s", node.pk, exc)
        return {"unreachable": 1}
    except Exception:  # noqa: BLE001 (a bug or a refusal on one node must not lose the batch's other nodes)
        log.exception("reconcile: node %s: reconcile raised; tried again next cycle", node.pk)
        return {"errors": 1}
    return {"nodes": 1, **counts}
