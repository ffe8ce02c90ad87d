"""Applying each health check (node_record_health: offline after failures in a row, back when it answers, the
instances it interrupts) and what it leaves behind: a count per node and day, the node's reliability figure, and
a re-verification when the GPUs the node reports have changed.

reliability = (health checks answered / health checks made, over the last 30 days)
              - 0.02 for each instance job on the node that failed by the node's fault in those 30 days, kept
                within 0..1.
A node nobody has checked yet has reliability 0. A failed job counts only when the failure was the node's
(Job.fault, decided where the job failed: provisioning.services.faults); the platform's (its own sessions holding
the node, a lost worker, its own error or time) and the renter's (their image, their destroy) do not.
"""
from __future__ import annotations

from datetime import datetime, timedelta
from typing import TypedDict

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F, QuerySet, Sum
from django.utils import timezone

from marketplace.models import InterruptionCause, Node, NodeState
from marketplace.services import instances as instance_svc
from marketplace.services.nodes import node_return_state
from notifications.services.notify import Kind, notify
from provisioning.agent.gpumarket_agent import inventory_hash as gpus_hash
from provisioning.models import OPEN_JOB_STATUSES, HealthSample, Job, JobFault, JobKind, JobStatus, NodeEvent
from provisioning.services.nodes import OFFLINE_AFTER_FAILED_CHECKS, node_event, running_vm_ids_by_node
from provisioning.services.verification import node_verify_request


class _ReliabilityRule(TypedDict):
    window_days: int
    failed_job_penalty: float
    job_kinds: tuple[str, ...]
    job_fault: str


RELIABILITY: _ReliabilityRule = {
    "window_days": 30,
    "failed_job_penalty": 0.02,
    # Jobs whose failure a renter feels; a failed verification already shows in the verdict.
    "job_kinds": (JobKind.INSTANCE_PROVISION, JobKind.INSTANCE_START, JobKind.INSTANCE_STOP,
                  JobKind.INSTANCE_RESTART, JobKind.INSTANCE_DESTROY),
    # Only the node's failures: the platform's and the renter's say nothing about it.
    "job_fault": JobFault.NODE,
}


def failed_jobs_counted(*, since: datetime) -> QuerySet[Job]:
    """The failed jobs that count against their node since `since` (every node's; filter by node)."""
    return Job.objects.filter(kind__in=RELIABILITY["job_kinds"], status=JobStatus.FAILED,
                              fault=RELIABILITY["job_fault"], finished_at__gt=since)


def health_sample_record(*, node_id: int, ok: bool, now: datetime | None = None) -> None:
    """Count one health check in the node's row for today (one row per node and day)."""
    day = (now or timezone.now()).date()
    counter = "ok" if ok else "failed"
    if HealthSample.objects.filter(node_id=node_id, day=day).update(**{counter: F(counter) + 1}):
        return
    try:
        with transaction.atomic():
            HealthSample.objects.create(node_id=node_id, day=day, **{counter: 1})
    except IntegrityError:  # another check created today's row first
        HealthSample.objects.filter(node_id=node_id, day=day).update(**{counter: F(counter) + 1})


def node_reliability(*, node_id: int, now: datetime | None = None) -> float:
    now = now or timezone.now()
    since = now - timedelta(days=RELIABILITY["window_days"])
    counts = HealthSample.objects.filter(node_id=node_id, day__gt=since.date()).aggregate(ok=Sum("ok"),
                                                                                          failed=Sum("failed"))
    checks = (counts["ok"] or 0) + (counts["failed"] or 0)
    if not checks:
        return 0.0
    failed_jobs = failed_jobs_counted(since=since).filter(node_id=node_id).count()
    value = (counts["ok"] or 0) / checks - RELIABILITY["failed_job_penalty"] * failed_jobs
    return round(min(1.0, max(0.0, value)), 4)


def node_reliability_update(*, node_id: int, now: datetime | None = None) -> float:
    value = node_reliability(node_id=node_id, now=now)
    Node.objects.filter(pk=node_id).update(reliability=value)
    return value


def node_inventory_changed(*, node_id: int, reported_hash: str) -> bool:
    """True (and a verification queued) when an active node's GPUs differ from those it was verified with."""
    node = Node.objects.filter(pk=node_id).only("id", "state", "inventory").first()
    stored = (node.inventory or {}).get("gpus") if node else None
    if node is None or node.state != NodeState.ACTIVE or stored is None or gpus_hash(stored) == reported_hash:
        return False
    if node.jobs.filter(instance__isnull=True, volume__isnull=True, status__in=OPEN_JOB_STATUSES).exists():
        return False  # a verification under way, or a spot check (then the next health check queues one)
    node_event(node=node, kind="inventory_changed",
               message="The GPUs the node reports changed since its last verification "
                       "(model, memory, power limit, MIG, link or driver); verifying it again.",
               level=NodeEvent.Level.WARNING)
    node_verify_request(node=node, reason="the GPU inventory changed")
    return True


def node_health_observed(*, node_id: int, ok: bool, inventory_hash: str | None = None,
                         now: datetime | None = None) -> None:
    """Called by node_record_health after each health check."""
    health_sample_record(node_id=node_id, ok=ok, now=now)
    node_reliability_update(node_id=node_id, now=now)
    if ok and inventory_hash:
        node_inventory_changed(node_id=node_id, reported_hash=inventory_hash)


def node_record_health(*, node_id: int, ok: bool, error: str = "", inventory_hash: str | None = None,
                       vms: dict[str, str] | None = None, probed_at: datetime | None = None,
                       running_vm_ids: set[str] | None = None) -> list[int]:
    """Apply one health check: offline after N failures in a row, back when it answers.

    A running instance is interrupted (billing closed at the node's last healthy moment) when its node has
    missed NODE_INTERRUPT_AFTER_FAILED_CHECKS checks in a row, or when the node answers but its VM is not
    running. Returns the ids of the instances interrupted by this check. `running_vm_ids` (the VM ids of the
    node's instances running since before the probe) saves a query per node when the fleet check has them.
    """
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node_id)
        last_healthy = node.last_seen_at  # before this check: the last moment the node was known to be well
        now = timezone.now()
        if ok:
            node.health_failures = 0
            node.last_seen_at = now
            if node.state == NodeState.OFFLINE:  # the health batch reconciled it before this
                node.transition_to(node_return_state(node=node))
                node.last_error = ""
                node_event(node=node, kind="back_online", message="The node answers health checks again.")
        else:
            node.health_failures += 1
            node.last_error = error
            # A node in maintenance stays there: its provider ends it, and node_update sends it offline then.
            if node.health_failures >= OFFLINE_AFTER_FAILED_CHECKS and node.can_transition_to(NodeState.OFFLINE) \
                    and node.state not in (NodeState.OFFLINE, NodeState.MAINTENANCE):
                node.transition_to(NodeState.OFFLINE)
                node_event(node=node, kind="offline",
                           message=f"{node.health_failures} health checks failed in a row: {error}",
                           level=NodeEvent.Level.WARNING)
                notify(user=node.provider, kind=Kind.NODE_OFFLINE,
                       dedupe_key=f"node_offline:{node.pk}:{node.state_changed_at.isoformat()}", payload={
                           "node": node.pk, "name": node.name, "message": f"Node {node.name} is offline: "
                           f"{node.health_failures} health checks failed in a row ({error[:300]}). It takes no new "
                           "rentals until it answers again."})
        node.save()
    interrupted = []
    if not ok and node.health_failures >= settings.NODE_INTERRUPT_AFTER_FAILED_CHECKS:
        interrupted = instance_svc.node_instances_interrupt(
            node_id=node_id, since=last_healthy, cause=InterruptionCause.NODE_LOST,
            detail=f"{node.health_failures} health checks failed in a row: {error}")
    elif ok and vms is not None:
        stopped = {vm_id for vm_id, state in vms.items() if state != "running"}
        if running_vm_ids is None:
            running_vm_ids = running_vm_ids_by_node(node_ids=[node_id], probed_before=probed_at).get(node_id, set())
        missing_or_stopped = running_vm_ids - (set(vms) - stopped)
        if missing_or_stopped:
            interrupted = instance_svc.node_instances_interrupt(
                node_id=node_id, since=last_healthy, cause=InterruptionCause.VM_LOST, vm_ids=missing_or_stopped,
                started_before=probed_at, detail="the server answers, but the VM is not running on it")
    if interrupted:
        node_event(node=node, kind="instances_interrupted",
                   message=f"Instance(s) {', '.join(map(str, interrupted))} interrupted: "
                           f"{'the node is unreachable' if not ok else 'their VM is not running'}.",
                   level=NodeEvent.Level.CRITICAL)
    node_health_observed(node_id=node_id, ok=ok, inventory_hash=inventory_hash)
    return interrupted
