"""r49 review (suspected, confirmed): the disk room leaves out the disk of a failed instance that ran.

A failed instance that ran keeps its VM, with its disk, on the node until it is destroyed (the volumes' rule,
services.volumes._failed_vm_kept), yet marketplace.services.disk_room counts only instances not in FINAL_STATUSES
(FAILED among them): the moment it fails, its whole disk is offered again, though nothing on the node was freed.
The fix lies in disk_room.py (its three forms: the ORM's, the booking's SQL, selectors.disk_left_gb), outside this
change: xfail(strict) until then."""

from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.models import Node
from marketplace.selectors import disk_left_gb
from marketplace.services import instances as svc
from marketplace.services.disk_room import node_disk_room
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import book, run, sent_jobs_fixture  # noqa: F401

pytestmark = pytest.mark.django_db


@pytest.mark.xfail(
    strict=True,
    reason="disk_room counts no FINAL instance, yet a failed one that ran keeps its "
    "VM and disk on the node (fix in marketplace/services/disk_room.py)",
)
def test_a_failed_instance_that_ran_still_takes_its_disks_room(user, sent_jobs):  # noqa: F811
    node = make_listed_node(gpu_count=4)
    node.disk_free_gb, node.disk_total_gb, node.host_checked_at = 100, 100, timezone.now() - timedelta(hours=1)
    node.save()
    instance = run(book(user, node, disk_gb=40))
    assert node_disk_room(Node.objects.get(pk=node.pk)).left_gb == 60

    svc.instance_mark_failed(instance_id=instance.pk, message="its container exited")
    instance.refresh_from_db()
    assert instance.status == "failed" and instance.started_at is not None  # its VM and disk are kept
    room = node_disk_room(Node.objects.get(pk=node.pk))
    shown = Node.objects.filter(pk=node.pk).annotate(left=disk_left_gb()).get().left
    assert (room.left_gb, shown) == (60, 60), f"room {room}, offers show {shown} GB"
