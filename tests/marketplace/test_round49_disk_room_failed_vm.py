"""r49 review (suspected, confirmed): the disk room left out the disk of an instance over whose VM is still there.

A failed instance that ran keeps its VM, with its disk, on the node until it is destroyed (the volumes' rule,
services.volumes._failed_vm_kept); one destroyed or failed while the node could not be reached keeps it until the
reconciler removes that VM (instances_awaiting_cleanup). marketplace.services.disk_room counted only instances not
in FINAL_STATUSES: the moment one failed, its whole disk was offered again, though nothing on the node was freed,
and the same disk could be promised twice. All three forms are checked: the ORM's (node_disk_room), the booking's
SQL (_lock_node_for_booking's disk_room) and the offers' disk_left_gb (selectors.offers_search)."""

from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from marketplace.models import Node
from marketplace.selectors import disk_left_gb, offers_search
from marketplace.services import instances as svc
from marketplace.services.disk_room import node_disk_room
from marketplace.services.instances.allocation import _lock_node_for_booking
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import book, run, sent_jobs_fixture  # noqa: F401

pytestmark = pytest.mark.django_db


def _node():
    node = make_listed_node(gpu_count=4)
    node.disk_free_gb, node.disk_total_gb, node.host_checked_at = 100, 100, timezone.now() - timedelta(hours=1)
    node.save()
    return node


def _left(node) -> tuple[int, int, int, int]:
    """The room left as each form computes it: the ORM's, the booking statement's, the annotation, the offers'."""
    room = node_disk_room(Node.objects.get(pk=node.pk))
    with transaction.atomic():
        booking = _lock_node_for_booking(node.pk, count_gpus=True).disk_room
    shown = Node.objects.filter(pk=node.pk).annotate(left=disk_left_gb()).get().left
    offered = offers_search().get(pk=node.pk).disk_left_gb
    return room.left_gb, booking.left_gb, shown, offered


def test_a_failed_instance_that_ran_still_takes_its_disks_room(user, sent_jobs):  # noqa: F811
    node = _node()
    instance = run(book(user, node, disk_gb=40))
    assert _left(node) == (60, 60, 60, 60)

    svc.instance_mark_failed(instance_id=instance.pk, message="its container exited")
    instance.refresh_from_db()
    assert instance.status == "failed" and instance.started_at is not None  # its VM and disk are kept
    assert _left(node) == (60, 60, 60, 60)

    svc.instance_destroy(instance=instance)  # its destroy removes that VM
    svc.instance_mark_destroyed(instance_id=instance.pk)
    assert _left(node) == (100, 100, 100, 100)


def test_a_failed_instance_that_never_ran_gives_its_room_back(user, sent_jobs):  # noqa: F811
    node = _node()
    instance = book(user, node, disk_gb=40)
    assert _left(node) == (60, 60, 60, 60)
    svc.instance_mark_failed(instance_id=instance.pk, message="the image did not pull")  # its VM removed with it
    assert _left(node) == (100, 100, 100, 100)


@pytest.mark.parametrize("over", ["destroyed", "failed"])
def test_an_instance_whose_vm_is_still_to_be_removed_keeps_its_disks_room(user, sent_jobs, over):  # noqa: F811
    node = _node()
    instance = book(user, node, disk_gb=40)
    if over == "destroyed":
        instance = run(instance)
        svc.instance_destroy(instance=instance)
        svc.instance_mark_destroyed(instance_id=instance.pk, cleanup_pending=True)  # the node could not be reached
    else:  # never ran, but its job gave up before the node confirmed its VM gone
        svc.instance_mark_failed(instance_id=instance.pk, message="unreachable", cleanup_pending=True)
    instance.refresh_from_db()
    assert instance.status == over and instance.vm_cleanup_pending
    assert _left(node) == (60, 60, 60, 60)

    svc.instance_cleanup_done(instance_id=instance.pk)  # the reconciler removed its VM
    assert _left(node) == (100, 100, 100, 100)
