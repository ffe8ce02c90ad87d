"""A volume its node no longer has (found by review r53): it stayed `available` and billed for ever, its renter
untold, and operators had no way to settle it. Now the reconciler's first look that misses it stops its billing
there and says so (not mountable); the next look that misses it too ends it as lost (deleted, its renter told,
billed up to the first look), as a VM listed missing is judged gone only at a second look; a look that finds it
again puts it back. Operators can end it from the admin once a look missed it. Against a simulated node over SSH."""
from datetime import timedelta

import pytest
from django.contrib.admin.sites import site
from django.contrib.messages.storage.fallback import FallbackStorage
from django.test import RequestFactory
from django.utils import timezone

from billing.services.storage import storage_meter
from core.errors import Conflict
from marketplace.models import Node, Volume, VolumeState
from marketplace.services import volumes as volume_svc
from notifications.models import Kind, Notification
from provisioning.models import Job, NodeEvent
from provisioning.services import fleet
from provisioning.services.nodes import node_session
from provisioning.services.reconcile import node_reconcile
from tests.factories import UserFactory
from tests.provisioning.test_reconcile_volumes import node, simbase  # noqa: F401

pytestmark = pytest.mark.django_db


def _missing_volume(node, renter=None) -> Volume:  # noqa: F811
    """An available volume the node never made (as if its data were removed there), billed from a day ago."""
    Node.objects.filter(pk=node.pk).update(disk_price_per_gb_month_micros=1_000_000)
    volume = volume_svc.volume_create(owner=renter or UserFactory(), node_id=node.pk, size_gb=100)
    Job.objects.filter(volume=volume).update(status="succeeded", finished_at=timezone.now())
    return volume_svc.volume_mark_available(volume_id=volume.pk, at=timezone.now() - timedelta(days=1))


def _seen_now(node) -> None:  # noqa: F811
    Node.objects.filter(pk=node.pk).update(last_seen_at=timezone.now(), health_failures=0)


def test_a_volume_missing_at_one_look_is_billed_no_further_and_its_renter_sees_why(node):  # noqa: F811
    renter = UserFactory()
    volume = _missing_volume(node, renter)
    assert node_reconcile(node)["volumes_missing"] == 1
    v = Volume.objects.get(pk=volume.pk)
    assert v.state == VolumeState.AVAILABLE and v.missing_since is not None
    assert "did not list it" in v.status_message
    billed = v.billed_until
    assert billed is not None and billed <= v.missing_since and v.cost_micros > 0  # billed up to the look
    _seen_now(node)
    storage_meter(now=timezone.now() + timedelta(hours=1))
    assert Volume.objects.get(pk=volume.pk).billed_until == billed  # not after it
    with pytest.raises(Conflict, match="did not list it"):
        volume_svc.volume_mounts_for_booking(renter=renter, node_id=node.pk,
                                             specs=[{"volume": volume.pk, "mount": "/data"}])
    assert not Notification.objects.filter(user=renter).exists()  # one look ends nothing


def test_a_volume_missing_at_two_looks_in_a_row_is_ended_as_lost_and_its_renter_told_once(node):  # noqa: F811
    renter = UserFactory()
    volume = _missing_volume(node, renter)
    node_reconcile(node)
    first = Volume.objects.get(pk=volume.pk)
    counts = node_reconcile(node)
    assert counts["volumes_lost"] == 1 and counts["volumes_missing"] == 0
    v = Volume.objects.get(pk=volume.pk)
    assert v.state == VolumeState.DELETED and v.deleted_at is not None
    assert v.status_message == f"Deleted: {volume_svc.LOST_ON_NODE}."
    assert v.billed_until == first.billed_until and v.cost_micros == first.cost_micros
    notice = Notification.objects.get(user=renter)
    assert notice.kind == Kind.VOLUME_LOST and volume.name in notice.payload["message"]
    assert NodeEvent.objects.filter(node=node, kind="volume_lost").count() == 1
    assert node_reconcile(node)["volumes_lost"] == 0  # nothing twice
    assert Notification.objects.filter(user=renter).count() == 1


def test_a_volume_listed_again_after_one_look_missed_it_is_available_and_billed_on(node):  # noqa: F811
    volume = _missing_volume(node)
    node_reconcile(node)
    missed = Volume.objects.get(pk=volume.pk)
    with node_session(node) as session:  # the list that missed it was wrong: the node has it
        session.agent("volume", "create", {"name": volume.name, "size_gb": 1})
    node_reconcile(node)
    v = Volume.objects.get(pk=volume.pk)
    assert v.state == VolumeState.AVAILABLE and v.missing_since is None and v.status_message == "Available"
    assert NodeEvent.objects.filter(node=node, kind="volume_found").count() == 1
    assert v.cost_micros == missed.cost_micros and v.billed_until >= missed.missing_since  # the gap: not billed
    later = timezone.now() + timedelta(hours=1)
    Node.objects.filter(pk=node.pk).update(last_seen_at=later, health_failures=0)
    storage_meter(now=later)
    billed = Volume.objects.get(pk=volume.pk)
    assert billed.billed_until > v.billed_until + timedelta(minutes=59)  # billed on from where it was found


def test_the_time_a_volume_was_missing_is_never_billed_when_it_is_found_again(node):  # noqa: F811
    """Its renter was told it was not billed meanwhile: found ten hours later, the next tick bills from then on."""
    volume = _missing_volume(node)
    node_reconcile(node)
    missed = Volume.objects.get(pk=volume.pk)
    Volume.objects.filter(pk=volume.pk).update(missing_since=missed.missing_since - timedelta(hours=10),
                                               billed_until=missed.billed_until - timedelta(hours=10))
    with node_session(node) as session:
        session.agent("volume", "create", {"name": volume.name, "size_gb": 1})
    node_reconcile(node)
    _seen_now(node)
    storage_meter(now=timezone.now())
    cost = Volume.objects.get(pk=volume.pk).cost_micros
    assert cost - missed.cost_micros < 1_000_000 * 100 // (30 * 24) // 10  # a few seconds, not ten hours ($1.39)
    counts = node_reconcile(node)  # found again, then missed once: a new first look, not the second
    assert counts["volumes_lost"] == 0


def test_an_operator_ends_a_volume_a_look_found_missing_from_the_admin(node):  # noqa: F811
    renter = UserFactory()
    volume = _missing_volume(node, renter)
    kept = volume_svc.volume_mark_available(volume_id=volume_svc.volume_create(
        owner=renter, node_id=node.pk, size_gb=1).pk)
    with node_session(node) as session:
        session.agent("volume", "create", {"name": kept.name, "size_gb": 1})
    node_reconcile(node)
    operator = UserFactory(is_staff=True, is_superuser=True)
    request = RequestFactory().post("/admin/marketplace/volume/")
    request.user = operator
    request.session = {}
    request._messages = FallbackStorage(request)
    admin = site._registry[Volume]
    admin.end_lost(request, Volume.objects.filter(pk__in=[volume.pk, kept.pk]))
    assert Volume.objects.get(pk=volume.pk).state == VolumeState.DELETED
    assert Volume.objects.get(pk=kept.pk).state == VolumeState.AVAILABLE  # never missed: not ended
    assert "confirmed by an operator" in Notification.objects.get(user=renter).payload["message"]
    said = [str(m) for m in request._messages]
    assert said[0] == "1 volume(s) ended as lost." and f"volume {kept.pk}" in said[1]


@pytest.mark.django_db(transaction=True)  # the batch reconciles in threads, each with its own connection
def test_the_fleets_reconcile_batch_counts_volumes_lost_and_goes_on(node):  # noqa: F811
    """Through the fleet's batch (as the beat runs it), not node_reconcile alone: the batch adds up each node's counts
    under RECONCILE_SUMMARY's keys, and a count it did not know (volumes_lost) raised there for every node."""
    volume = _missing_volume(node)
    _seen_now(node)
    first = fleet.nodes_reconcile_batch([node.pk])
    assert first["volumes_missing"] == 1, str(first)
    _seen_now(node)
    summary = fleet.nodes_reconcile_batch([node.pk])
    assert (summary["nodes"], summary["volumes_lost"], summary["errors"]) == (1, 1, 0)
    assert Volume.objects.get(pk=volume.pk).state == VolumeState.DELETED
