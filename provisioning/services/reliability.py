"""What each health check leaves behind: a count per node and day, the node's reliability figure, and a
re-verification when the GPUs the node reports have changed.

reliability = (health checks answered / health checks made, over the last 30 days)
              - 0.02 for each instance job on the node that failed in those 30 days, kept within 0..1.
A node nobody has checked yet has reliability 0.
"""
from __future__ import annotations

from datetime import timedelta

from django.db import IntegrityError, transaction
from django.db.models import F, Sum
from django.utils import timezone

from marketplace.models import Node, NodeState
from provisioning.agent.gpumarket_agent import inventory_hash as gpus_hash
from provisioning.models import OPEN_JOB_STATUSES, HealthSample, Job, JobKind, JobStatus, NodeEvent

RELIABILITY = {
    "window_days": 30,
    "failed_job_penalty": 0.02,
    # Jobs whose failure a renter feels; a failed verification already shows in the verdict.
    "job_kinds": (JobKind.INSTANCE_PROVISION, JobKind.INSTANCE_START, JobKind.INSTANCE_STOP,
                  JobKind.INSTANCE_RESTART, JobKind.INSTANCE_DESTROY),
}


def health_sample_record(*, node_id: int, ok: bool, now=None) -> None:
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


def node_reliability(*, node_id: int, now=None) -> float:
    now = now or timezone.now()
    since = now - timedelta(days=RELIABILITY["window_days"])
    counts = HealthSample.objects.filter(node_id=node_id, day__gt=since.date()).aggregate(ok=Sum("ok"),
                                                                                          failed=Sum("failed"))
    checks = (counts["ok"] or 0) + (counts["failed"] or 0)
    if not checks:
        return 0.0
    failed_jobs = Job.objects.filter(node_id=node_id, kind__in=RELIABILITY["job_kinds"], status=JobStatus.FAILED,
                                     finished_at__gt=since).count()
    value = (counts["ok"] or 0) / checks - RELIABILITY["failed_job_penalty"] * failed_jobs
    return round(min(1.0, max(0.0, value)), 4)


def node_reliability_update(*, node_id: int, now=None) -> float:
    value = node_reliability(node_id=node_id, now=now)
    Node.objects.filter(pk=node_id).update(reliability=value)
    return value


def node_inventory_changed(*, node_id: int, reported_hash: str) -> bool:
    """True (and a verification queued) when an active node's GPUs differ from those it was verified with."""
    node = Node.objects.filter(pk=node_id).only("id", "state", "inventory").first()
    stored = (node.inventory or {}).get("gpus") if node else None
    if node is None or node.state != NodeState.ACTIVE or stored is None or gpus_hash(stored) == reported_hash:
        return False
    if node.jobs.filter(kind=JobKind.NODE_VERIFY, status__in=OPEN_JOB_STATUSES).exists():
        return False
    from provisioning.services.nodes import node_event
    from provisioning.services.verification import node_verify_request

    node_event(node, "inventory_changed", "The GPUs the node reports changed since its last verification "
                                          "(model, memory, power limit, MIG, link or driver); verifying it again.",
               NodeEvent.Level.WARNING)
    node_verify_request(node=node, reason="the GPU inventory changed")
    return True


def node_health_observed(*, node_id: int, ok: bool, inventory_hash: str | None = None, now=None) -> None:
    """Called by node_record_health after each health check."""
    health_sample_record(node_id=node_id, ok=ok, now=now)
    node_reliability_update(node_id=node_id, now=now)
    if ok and inventory_hash:
        node_inventory_changed(node_id=node_id, reported_hash=inventory_hash)
