"""What each health check leaves behind (the checks are applied by fleet_record.nodes_record_health): a count per
node and day, the node's reliability figure, and a re-verification when the GPUs the node reports have changed
(at once, or at the end of its provider's verify cooldown: node_inventory_changed).

reliability = (health checks answered / health checks made, over the last 30 days)
              - 0.02 for each instance job on the node that failed by the node's fault in those 30 days, kept
                within 0..1.
A failed check of a node in announced maintenance with no renter on it is counted neither way
(fleet_record.announced_downtime); with renters on it, it counts as any. A node with no counted check has
reliability 0 (nobody has checked it yet). A failed job counts only when the failure was the node's
(Job.fault, decided where the job failed: provisioning.services.faults); the platform's (its own sessions holding
the node, a lost worker, its own error or time) and the renter's (their image, their destroy) do not.
"""
from __future__ import annotations

from datetime import datetime
from typing import TypedDict

from django.db.models import QuerySet

from marketplace.models import Node, NodeState
from provisioning.agent.gpumarket_agent import inventory_hash as gpus_hash
from provisioning.models import OPEN_JOB_STATUSES, Job, JobFault, JobKind, JobStatus, NodeEvent
from provisioning.services.nodes import node_event
from provisioning.services.verification import node_verify_deferred, node_verify_request


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


def node_inventory_changed(*, node_id: int, reported_hash: str) -> bool:
    """True when an active node's GPUs differ from those it was verified with and a verification was queued, or,
    within its provider's cooldown, made due at the cooldown's end (said in an event). The fingerprint is the
    provider's agent's, a power limit or a MIG, ECC or driver change included, which the provider can flip and flip
    back at will: each flip was a fresh verdict at once, the re-roll NODE_VERIFY_COOLDOWN_S stops (found by
    review). So within NODE_VERIFY_COOLDOWN_S of the node's last verdict nothing is queued now: its next full check
    is due at the cooldown's end (verification.node_verify_deferred), the re-verification beat queues it then, and
    the change is recorded once (health checks meanwhile, every minute, write no more events). The node stays as
    it is meanwhile, listed or not, as while a verification runs."""
    node = Node.objects.filter(pk=node_id).only("id", "state", "inventory").first()
    stored = (node.inventory or {}).get("gpus") if node else None
    if node is None or node.state != NodeState.ACTIVE or stored is None or gpus_hash(stored) == reported_hash:
        return False
    if node.jobs.filter(instance__isnull=True, volume__isnull=True, status__in=OPEN_JOB_STATUSES).exists():
        return False  # a verification under way, or a spot check (then the next health check queues one)
    deferred = node_verify_deferred(node)
    if deferred is not None:
        refusal, due = deferred
        if node.events.filter(kind="inventory_changed", created_at__gt=refusal.finished_at).exists():
            return False  # said already, since the verdict: the check is due as that event says
        node_event(node=node, kind="inventory_changed",
                   message=f"The GPUs the node reports changed since its last verification (model, memory, power "
                           f"limit, MIG, link or driver). Its last check ended with a verdict at "
                           f"{refusal.finished_at:%Y-%m-%d %H:%M:%S} UTC, and a node is verified again at most once "
                           f"per {refusal.every} after a verdict: its check is due at {due:%Y-%m-%d %H:%M:%S} UTC.",
                   level=NodeEvent.Level.WARNING)
        return True
    node_event(node=node, kind="inventory_changed",
               message="The GPUs the node reports changed since its last verification "
                       "(model, memory, power limit, MIG, link or driver); verifying it again.",
               level=NodeEvent.Level.WARNING)
    node_verify_request(node=node, reason="the GPU inventory changed")
    return True
