"""A node holding only renters' volumes counts as in use (marketplace.selectors.node_in_use_q), found by review r53.

Before, a scheduled re-check that rejected such a node moved it to `rejected`: no health check or reconcile visited it
again, a deletion whose job gave up stayed `deleting` for ever, its retire was refused for ever ("try again in a few
minutes"), and the unwatched time was billed in one catch-up charge once the node was verified again.
"""
from datetime import timedelta

import pytest
from django.utils import timezone

from billing.services.storage import node_storage_outage_end, storage_meter
from marketplace.models import Node, NodeState, Verdict, Volume, VolumeState
from marketplace.services import nodes as node_svc
from marketplace.services import volumes as volume_svc
from provisioning.models import Job, JobKind
from provisioning.services.fleet_record import announced_downtime
from provisioning.services.nodes import watched_nodes
from provisioning.services.verification import node_verify_conclude, node_verify_request
from provisioning.services.volumes import volume_job_failed
from provisioning.ssh_errors import NodeUnreachable
from tests.factories import UserFactory, make_listed_node

pytestmark = pytest.mark.django_db


def _reject(node: Node) -> Node:
    job = node_verify_request(node=node)
    node_verify_conclude(job=job, verdict="rejected", findings=[], inventory={})
    return Node.objects.get(pk=node.pk)


def _available_volume(node: Node, size_gb: int = 10, at=None) -> Volume:
    volume = volume_svc.volume_create(owner=UserFactory(), node_id=node.pk, size_gb=size_gb)
    volume_svc.volume_mark_available(volume_id=volume.pk, at=at)
    Job.objects.filter(volume=volume).update(status="succeeded", finished_at=timezone.now())
    return Volume.objects.get(pk=volume.pk)


def test_a_node_holding_only_a_volume_stays_active_and_watched_when_a_recheck_rejects_it():
    node = make_listed_node(gpu_count=1)
    volume = _available_volume(node)
    node = _reject(node)
    assert node.state == NodeState.ACTIVE and node.verdict == Verdict.REJECTED
    assert watched_nodes().filter(pk=node.pk).exists()
    assert node_svc.node_in_use(node_id=node.pk)
    # Its deletion, whose job gave up, is left to the node's reconcile, which visits it.
    volume_svc.volume_delete(volume=volume, confirm=volume.name)
    volume_job_failed(job=Job.objects.get(volume=volume, kind=JobKind.VOLUME_DELETE),
                      error=NodeUnreachable("connection timed out"))
    assert Volume.objects.get(pk=volume.pk).state == VolumeState.DELETING
    assert node_svc.node_in_use(node_id=node.pk)  # its data is on the node until it is deleted there
    assert watched_nodes().filter(pk=node.pk).exists()


def test_a_node_whose_volumes_are_over_is_in_use_no_more():
    node = make_listed_node(gpu_count=1)
    volume = _available_volume(node)
    Volume.objects.filter(pk=volume.pk).update(state=VolumeState.DELETED)
    failed = volume_svc.volume_create(owner=UserFactory(), node_id=node.pk, size_gb=10)
    volume_svc.volume_mark_failed(volume_id=failed.pk, message="Failed")
    Job.objects.filter(volume=failed).update(status="failed", finished_at=timezone.now())
    assert not node_svc.node_in_use(node_id=node.pk)
    assert _reject(node).state == NodeState.REJECTED


def test_maintenance_ends_active_for_a_rejected_node_holding_a_volume_and_its_failures_count():
    node = make_listed_node(gpu_count=1)
    _available_volume(node)
    Node.objects.filter(pk=node.pk).update(state=NodeState.MAINTENANCE, verdict=Verdict.REJECTED)
    node = Node.objects.get(pk=node.pk)
    assert node_svc.node_return_state(node=node) == NodeState.ACTIVE
    # A renter's data there: the maintenance does not excuse its failed checks (fleet_record.announced_downtime).
    assert announced_downtime([node]) == set()


def test_a_volume_kept_on_a_rejected_node_is_billed_from_its_verification_not_across_the_unwatched_time(
        django_capture_on_commit_callbacks):
    """A node rejected with a volume on it before this fix (or by any other path) was unwatched, as a quarantined node
    is: when it is verified again, its volumes are not billed for that time (quarantine's rule,
    node_storage_outage_end(unseen=True)); before, the meter caught it all up at once."""
    node = make_listed_node(gpu_count=1)
    Node.objects.filter(pk=node.pk).update(disk_price_per_gb_month_micros=1_000_000)
    now = timezone.now()
    volume = _available_volume(Node.objects.get(pk=node.pk), size_gb=100, at=now - timedelta(days=10))
    Node.objects.filter(pk=node.pk).update(last_seen_at=now - timedelta(days=9), health_failures=0)
    storage_meter(now=now - timedelta(days=9))
    assert Volume.objects.get(pk=volume.pk).billed_seconds == 86400
    Node.objects.filter(pk=node.pk).update(state=NodeState.REJECTED, verdict=Verdict.REJECTED)  # unwatched since
    storage_meter(now=now - timedelta(days=1))
    assert Volume.objects.get(pk=volume.pk).billed_seconds == 86400
    with django_capture_on_commit_callbacks(execute=True):
        job = node_verify_request(node=Node.objects.get(pk=node.pk))
    node_verify_conclude(job=job, verdict="verified", findings=[], inventory={})
    # What the verification's inventory records once the node answered (_apply_inventory): seen now.
    Node.objects.filter(pk=node.pk).update(last_seen_at=now)
    node_storage_outage_end(node_id=node.pk, now=now)  # the reconcile's call
    storage_meter(now=now)
    billed = Volume.objects.get(pk=volume.pk).billed_seconds
    assert billed < 86400 + 3600, f"{billed - 86400} s of the unwatched time billed"
