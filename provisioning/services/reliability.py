"""What each health check leaves behind (the checks are applied by fleet_record.nodes_record_health): a count per
node and day, the node's reliability figure, and a re-verification when the GPUs the node reports have changed.

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

from django.db import IntegrityError, transaction
from django.db.models import F, QuerySet, Sum
from django.utils import timezone

from marketplace.models import Node, NodeState
from provisioning.agent.gpumarket_agent import inventory_hash as gpus_hash
from provisioning.models import OPEN_JOB_STATUSES, HealthSample, Job, JobFault, JobKind, JobStatus, NodeEvent
from provisioning.services.nodes import node_event
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
