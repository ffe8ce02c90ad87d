"""The room left on a node's disk (marketplace.services.disk_room): what its server reported free, less the
instance disks and volumes promised there since. Before, a booking never looked (an instance disk could be
promised beyond the server's free space) and a volume counted only the volumes."""
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from marketplace.models import Node
from marketplace.services import instances as svc
from marketplace.services import volumes as volume_svc
from marketplace.services.disk_room import node_disk_room
from marketplace.services.instances.allocation import _lock_node_for_booking
from tests.factories import make_listed_node

from .renting_helpers import add_key, book, sent_jobs_fixture, snapshot  # noqa: F401 (the sent_jobs fixture)

pytestmark = pytest.mark.django_db


def _node(free_gb=200, reported_ago=timedelta(hours=1), **kwargs):
    node = make_listed_node(gpu_count=4, **kwargs)
    node.disk_free_gb, node.host_checked_at = free_gb, timezone.now() - reported_ago
    node.save()
    return node


def _book(api, node, disk_gb):
    key = api.user.ssh_keys.first() or add_key(api.user)
    return api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "pytorch-2-5",
                                           "ssh_keys": [key.pk], "disk_gb": disk_gb}, format="json")


def _gone(instance):
    """Destroyed on its node (while it is being destroyed, its disk is still there: it counts)."""
    svc.instance_destroy(instance=instance)
    assert node_disk_room(Node.objects.get(pk=instance.node_id)).promised_gb >= instance.disk_gb
    svc.instance_mark_destroyed(instance_id=instance.pk)


def test_a_booking_whose_disk_does_not_fit_is_refused_naming_the_room_left(api, user):
    node = _node(free_gb=200)
    refused = _book(api, node, 250)
    assert refused.status_code == 409, refused.content
    assert "reported 200 GB of free disk" in refused.json()["detail"] and "disk_gb" in refused.json()["detail"]
    assert _book(api, node, 120).status_code == 201
    before = snapshot(node)
    again = _book(api, node, 100)  # the 120 GB promised since the report count: 80 GB are left
    assert again.status_code == 409, again.content
    assert "less 120 GB promised to instances and volumes there since: 80 GB are left" in again.json()["detail"]
    assert snapshot(node) == before  # nothing written
    assert _book(api, node, 80).status_code == 201


def test_instance_disks_and_volumes_share_the_room(api, user):
    node = _node(free_gb=200)
    assert _book(api, node, 150).status_code == 201
    volume = api.post("/api/v1/volumes/", {"offer": node.pk, "size_gb": 60}, format="json")
    assert volume.status_code == 409 and "50 GB are left" in volume.json()["detail"], volume.content
    assert api.post("/api/v1/volumes/", {"offer": node.pk, "size_gb": 50}, format="json").status_code == 201
    assert _book(api, node, 50).status_code == 409


def test_what_is_over_or_came_before_the_report_does_not_count(user):
    node = _node(free_gb=200)
    old = book(user, node, disk_gb=100)
    node.host_checked_at = timezone.now() + timedelta(seconds=1)  # reported after it: already counted
    node.save()
    new = book(user, node, disk_gb=70)
    Node.objects.filter(pk=node.pk).update(host_checked_at=old.created_at + timedelta(microseconds=1))
    assert node_disk_room(Node.objects.get(pk=node.pk)).promised_gb == 70
    _gone(new)
    assert node_disk_room(Node.objects.get(pk=node.pk)).promised_gb == 0


def test_a_node_that_never_reported_its_disk_is_not_judged(api, user):
    node = _node(free_gb=None)
    assert node_disk_room(node) is None
    assert _book(api, node, 500).status_code == 201


def test_the_booking_statements_room_is_the_services(user):
    """Two forms of one rule: the column the booking's node statement computes, and the ORM's (volumes)."""
    node = _node(free_gb=1000)
    book(user, node, disk_gb=100)
    book(user, node, disk_gb=40)
    volume_svc.volume_create(owner=user, node_id=node.pk, size_gb=30)
    _gone(book(user, node, disk_gb=300))
    for reported_ago in (timedelta(hours=1), timedelta(0)):  # everything since, then nothing since
        Node.objects.filter(pk=node.pk).update(host_checked_at=timezone.now() - reported_ago)
        with transaction.atomic():
            locked = _lock_node_for_booking(node.pk, count_gpus=True)
        assert locked.disk_room == node_disk_room(Node.objects.get(pk=node.pk))
    assert locked.disk_room.promised_gb == 0
    Node.objects.filter(pk=node.pk).update(host_checked_at=None)  # never dated: everything live counts
    with transaction.atomic():
        locked = _lock_node_for_booking(node.pk, count_gpus=True)
    assert locked.disk_room == node_disk_room(Node.objects.get(pk=node.pk))
    assert locked.disk_room.promised_gb == 170
