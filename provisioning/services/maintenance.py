"""The periodic jobs that keep the fleet honest: health checks, reconciling VMs with the
database, reaping stuck jobs, and retrying pending verifications.

Each runs as a singleton (a cache lock), since beat may fire again before a slow run ends.
"""
from __future__ import annotations

import contextlib
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from django.core.cache import cache
from django.db import close_old_connections, connection
from django.utils import timezone

from marketplace.models import Instance, InstanceStatus, Node, NodeState
from marketplace.services import instances as instance_svc
from provisioning.models import OPEN_JOB_STATUSES, Job, JobKind, NodeEvent
from provisioning.services.nodes import (
    WATCHED_STATES,
    HealthResult,
    node_event,
    node_health_probe,
    node_record_health,
    node_session,
)
from provisioning.services.runner import job_finish
from provisioning.ssh import NodeError

log = logging.getLogger(__name__)

# One thread per node up to this cap: probes wait on the network, so batches would multiply wall time.
HEALTH_PARALLELISM = 256
PENDING_RETRY_AFTER = timedelta(minutes=10)
_VM_ID = re.compile(r"^inst-(\d+)$")


@contextlib.contextmanager
def singleton(name: str, ttl: int):
    key = f"singleton:{name}"
    if not cache.add(key, 1, timeout=ttl):
        yield False
        return
    try:
        yield True
    finally:
        cache.delete(key)


def _in_thread(fn, *args):
    """Run fn in a pool thread with its own database connection, closed afterwards."""
    try:
        return fn(*args)
    finally:
        connection.close()


def nodes_probe(nodes: list[Node], parallelism: int = HEALTH_PARALLELISM) -> list[HealthResult]:
    """`health` on many nodes at once: SSH round trips overlap, so wall time tracks the slowest node."""
    if not nodes:
        return []
    with ThreadPoolExecutor(max_workers=min(parallelism, len(nodes))) as pool:
        return list(pool.map(lambda n: _in_thread(node_health_probe, n), nodes))


def nodes_health_check() -> dict:
    with singleton("nodes_health_check", ttl=300) as acquired:
        if not acquired:
            return {"skipped": "another health check is running"}
        nodes = list(Node.objects.filter(state__in=WATCHED_STATES))
        results = nodes_probe(nodes)
        for result in results:
            node_record_health(node_id=result.node_id, ok=result.ok, error=result.error,
                               inventory_hash=result.inventory_hash)
        return {"checked": len(results), "failed": sum(not r.ok for r in results)}


def nodes_reconcile() -> dict:
    """Compare each node's VMs with the database: remove VMs nobody knows, fail instances whose VM vanished."""
    with singleton("nodes_reconcile", ttl=600) as acquired:
        if not acquired:
            return {"skipped": "another reconcile is running"}
        summary = {"nodes": 0, "orphans_destroyed": 0, "instances_failed": 0, "unreachable": 0}
        for node in Node.objects.filter(state__in=WATCHED_STATES):
            close_old_connections()
            try:
                counts = node_reconcile(node)
            except NodeError as exc:
                log.info("reconcile: node %s unreachable: %s", node.pk, exc)
                summary["unreachable"] += 1
                continue
            summary["nodes"] += 1
            for key, value in counts.items():
                summary[key] += value
        return summary


def node_reconcile(node: Node) -> dict:
    counts = {"orphans_destroyed": 0, "instances_failed": 0}
    with node_session(node) as session:
        vms = session.agent("vm", "list", {"runtime": node.runtime})["vms"]
        # Read the database after the node, so an instance created meanwhile is known.
        known = {i.pk: i for i in Instance.objects.filter(node=node).exclude(status=InstanceStatus.DESTROYED)}
        seen = set()
        for vm in vms:
            match = _VM_ID.match(vm.get("vm_id", ""))
            instance = known.get(int(match.group(1))) if match else None
            if instance is None:
                session.agent("vm", "destroy", {"runtime": node.runtime, "vm_id": vm["vm_id"]})
                node_event(node, "orphan_destroyed", f"Destroyed VM {vm['vm_id']}, which no instance owns.",
                           NodeEvent.Level.WARNING)
                counts["orphans_destroyed"] += 1
                continue
            seen.add(instance.pk)
            if instance.status == InstanceStatus.FAILED and vm.get("state") == "running":
                # A failed instance holds no GPUs any more: its VM must not keep using them.
                session.agent("vm", "stop", {"runtime": node.runtime, "vm_id": vm["vm_id"]})
        for instance in known.values():
            if instance.status == InstanceStatus.RUNNING and instance.pk not in seen:
                instance_svc.instance_mark_failed(
                    instance_id=instance.pk, message="The VM disappeared from the node; the GPUs were released."
                )
                node_event(node, "vm_vanished", f"The VM of instance {instance.pk} vanished.",
                           NodeEvent.Level.WARNING)
                counts["instances_failed"] += 1
    return counts


def jobs_reap() -> dict:
    """Fail jobs still open past their deadline, releasing what they held."""
    reaped = 0
    for job in Job.objects.filter(status__in=OPEN_JOB_STATUSES, deadline__lt=timezone.now()).select_related("node"):
        error = "The job did not finish in time and was stopped by the platform."
        if job.kind == JobKind.NODE_VERIFY:
            from provisioning.services.verification import node_verify_failed

            node_verify_failed(job=job, error=NodeError(error))
        else:
            # Only the instance's latest job speaks for it: an old stuck job must not fail an
            # instance that a later job has already brought back.
            newer = Job.objects.filter(instance_id=job.instance_id, id__gt=job.pk).exists()
            if job.instance_id and not newer:
                instance_svc.instance_mark_failed(instance_id=job.instance_id, message=error)
            job_finish(job, error=error)
        reaped += 1
    return {"reaped": reaped}


def nodes_verify_pending() -> dict:
    """Retry verification of pending nodes now and then: the provider may have installed the key since."""
    from provisioning.services.verification import node_verify_request

    cutoff = timezone.now() - PENDING_RETRY_AFTER
    queued = 0
    for node in Node.objects.filter(state=NodeState.PENDING):
        last = node.jobs.filter(kind=JobKind.NODE_VERIFY).order_by("-created_at").first()
        if last is None or (last.status not in OPEN_JOB_STATUSES and last.created_at < cutoff):
            node_verify_request(node=node)
            queued += 1
    return {"queued": queued}
